"""Every combination a user can launch is refused before the model loads, naming the keys, or
it trains: algorithm × shipped config file × graph kind × context mode × team.anonymous.

Each combination is what `python -m launch.train --config=launch/configs/<file>
--config.algorithm=... --config.team.graph=... --config.rollout.context_mode=...
--config.team.anonymous=...` builds (the file's ConfigDict with those overrides, then
`from_config_dict` and `algorithms.resolve`, as `cli.run` does), sized down to the tiny model
(one iteration, two environments, replies of two tokens). It is then trained by `loop.train`
with no model given, so the run loads its own through `model_lib.load` after the checks that
`launch.train` runs before its load too (the mesh and processes, the task's files, the team
and its graph). `model_lib.load` is replaced by a recorder returning the tiny model: an error
once it has been called fails the test (the user waited for the model for nothing); a refusal
must be a ValueError raised before it that names a key.

The full product is 60 combinations a shipped file (600 with the 10 files of 29 Nov 2026).
Files equal once a combination's keys are set are one level (`_file_levels`: train.py,
marft_t.py and grpo.py), and a pairwise cover of the levels (every pair of two factors'
values in at least one combination; `pairwise_cover`, a seeded greedy construction) was
40 combinations then, the least possible (8 levels × 5 algorithms).

`MARFT_COMBINATIONS=all` runs the whole product of the levels instead of the cover (480
combinations then, 7 min 18 s on 2 cores: too long for the suite's budget; all 480 passed on
29 Nov 2026).
"""

import dataclasses
import glob
import itertools
import json
import math
import os
import random
import re

import pytest

from launch.cli import CONFIG_DIR, _load_config_file
from marft_jax.configs import from_config_dict
from marft_jax.models import sampler
from marft_jax.rollout import read_transcripts
from marft_jax.train import algorithms, loop
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train.config import TrainConfig
from tests.train.echo_config import set_keys, tiny_trainer_model

CONFIG_FILES = tuple(sorted(
    os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
    if os.path.basename(p) not in ("__init__.py", "generate.py")))  # generate: not training
FACTORS = {
    "algorithm": tuple(algorithms.ALGORITHMS),
    "config": CONFIG_FILES,  # grouped below (`_file_levels`)
    "graph": ("chain", "dag", "orchestrator"),
    "context_mode": ("per_agent", "shared_stream"),
    "anonymous": (False, True),
}
# What makes one combination one fast iteration on the tiny model (command-line overrides).
SMALL = {"iterations": 1, "eval_every": 0, "eval_episodes": 1, "checkpoint_every": 1000,
         "rollout.num_envs": 2, "team.last_max_new_tokens": 2,
         "optimizer.epochs": 1, "optimizer.minibatches": 1, "lora.rank": 2}
# And those a combination reads only sometimes (set where it does not, they are refused).
SMALL_IF = {"team.max_new_tokens": (2, lambda row, roles: roles > 1),
            "team.orchestrator_max_new_tokens": (2, lambda row, _: row["graph"] == "orchestrator"),
            "team.orchestrator_max_calls": (1, lambda row, _: row["graph"] == "orchestrator"),
            "critic.hidden": ((8,), lambda row, _: algorithms.get(row["algorithm"]).critic)}
# A refusal names at least one key the combination set (or one its file set).
KEY_WORDS = ("algorithm", "context_mode", "graph", "edges", "anonymous", "team.", "rollout.",
             "num_roles", "order")


def pairwise_cover(factors: dict, seed: int = 0, candidates: int = 40) -> list[dict]:
  """Rows (one value per factor) in which every pair of two factors' values meets at least
  once. Greedy (AETG-like): each new row starts from an uncovered pair and fills the other
  factors, in a random order, with the value that covers the most uncovered pairs with the
  factors already filled; of `candidates` such rows the one covering most is kept. Seeded:
  the same rows every run."""
  rng = random.Random(seed)
  names = list(factors)
  pairs = lambda row: {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)
                       if a in row and b in row}
  uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
               for x in factors[a] for y in factors[b]}
  rows = []
  while uncovered:
    (a, x), (b, y) = min(uncovered, key=str)
    best = None
    for _ in range(candidates):
      row = {a: x, b: y}
      for name in rng.sample([n for n in names if n not in row], len(names) - 2):
        row[name] = max(factors[name], key=lambda v: (
            len(pairs({**row, name: v}) & uncovered), rng.random()))
      row = {n: row[n] for n in names}
      if best is None or len(pairs(row) & uncovered) > len(pairs(best) & uncovered):
        best = row
    rows.append(best)
    uncovered -= pairs(best)
  return rows



def _dag_edges(order):
  """A DAG over the roles: every other role feeds the last (3 or more roles: parallel roots
  and a join); '' for one role (refused: a DAG needs edges)."""
  return ", ".join(f"{r}>{order[-1]}" for r in order[:-1])


def _config_dict(row):
  """The ConfigDict `launch.train` builds for `row` (file, then command-line overrides)."""
  config = _load_config_file(os.path.join(CONFIG_DIR, row["config"] + ".py"))
  order = [r.strip() for r in config.team.order.split(",") if r.strip()]
  overrides = dict(SMALL, **{
      "algorithm": row["algorithm"], "team.graph": row["graph"],
      "team.edges": ("" if row["graph"] != "dag" else config.team.edges
                     if config.team.graph == "dag" else _dag_edges(order)),
      "rollout.context_mode": row["context_mode"], "team.anonymous": row["anonymous"]})
  if row["algorithm"] == "grpo":  # its default 4 rollouts of a task would need 4 envs
    overrides["rollout.group_size"] = 2
  overrides.update({key: value for key, (value, reads) in SMALL_IF.items()
                    if reads(row, len(order))})
  set_keys(config, overrides)
  for name in config.team.roles:  # every role on the team's tiny budget
    config.team.roles[name].max_new_tokens = 0
  return config


def _file_levels() -> dict:
  """{representative file: the files it stands for}: files whose ConfigDicts are equal once a
  combination's keys and `SMALL` are applied (train.py, marft_t.py and grpo.py differ only
  in the algorithm and sizes) run the same combination, so they are one level of the factor."""
  groups = {}
  for name in CONFIG_FILES:
    config = _config_dict(dict(algorithm="marft_a", config=name, graph="chain",
                               context_mode="per_agent", anonymous=False))
    groups.setdefault(json.dumps(config.to_dict(), sort_keys=True, default=str), []).append(name)
  return {names[0]: tuple(names) for names in groups.values()}


FILE_LEVELS = _file_levels()
LEVELS = dict(FACTORS, config=tuple(FILE_LEVELS))
COVER = pairwise_cover(LEVELS)
ROWS = ([dict(zip(LEVELS, values)) for values in itertools.product(*LEVELS.values())]
        if os.environ.get("MARFT_COMBINATIONS") == "all" else COVER)


def test_the_cover_meets_every_pair_of_values():
  """Checked from the definition, pair by pair (the generator's own bookkeeping aside); every
  shipped file is one of the config levels or stands beside one."""
  assert sorted(sum(FILE_LEVELS.values(), ())) == sorted(CONFIG_FILES)
  for a, b in itertools.combinations(LEVELS, 2):
    for x, y in itertools.product(LEVELS[a], LEVELS[b]):
      assert any(row[a] == x and row[b] == y for row in COVER), (a, x, b, y)
  assert len(COVER) < math.prod(len(v) for v in LEVELS.values()) / 8


@pytest.fixture(scope="module")
def tiny_model():
  return tiny_trainer_model(max_position_embeddings=2048)


def _row_id(row):
  named = dict(row, config="+".join(FILE_LEVELS[row["config"]]),
               anonymous="anonymous" if row["anonymous"] else "named")
  return "-".join(map(str, named.values()))


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_refused_before_the_model_loads_or_trains(row, tiny_model, tmp_path, monkeypatch):
  loads = []

  def load(config, backbone=None):  # each backbone a role runs on (`run_lib.load_models`)
    loads.append(config)
    return tiny_model

  monkeypatch.setattr(model_lib, "load", load)
  # The learning-curve PNG (matplotlib, each checkpoint) is the same for every combination.
  monkeypatch.setattr(loop, "plot_learning_curves", lambda *args, **kwargs: None)
  # A one-iteration run never reaches the next prompt bucket that the trainer's sampler
  # compiles ahead (`sampler.generate(compile_ahead=)`: the program only, never run).
  generate = sampler.generate
  monkeypatch.setattr(sampler, "generate",
                      lambda *args, **kwargs: generate(*args, **dict(kwargs, compile_ahead=False)))
  config_dict = _config_dict(row)
  try:
    config = algorithms.resolve(from_config_dict(TrainConfig, config_dict))
    metrics = loop.train(config, str(tmp_path), progress=False)
  except ValueError as e:
    if loads:
      raise AssertionError(f"{row}: refused after the model loaded: {e}") from e
    assert any(word in str(e) for word in KEY_WORDS), f"{row}: names no key: {e}"
    return
  except Exception as e:
    raise AssertionError(f"{row}: failed {'after' if loads else 'before'} the model "
                         f"loaded: {e!r}") from e
  assert len(loads) == len(config.used_backbones)
  assert math.isfinite(metrics["reward"]) and math.isfinite(metrics["policy_loss"]), metrics
  if row["anonymous"]:
    _assert_anonymous(str(tmp_path), config_dict)


def _assert_anonymous(workdir, config_dict):
  """The run played the ablation arm: no turn is a named role's, no prompt holds a role's
  system prompt (the rollout and the update ran with neutral names)."""
  names = set(config_dict.team.roles)
  system_prompts = [config_dict.team.roles[n].system_prompt for n in names]
  turns = [turn for episode in read_transcripts(os.path.join(workdir, "transcripts"), 0)
           for turn in episode["turns"]]
  assert turns
  for turn in turns:
    assert turn["role"] not in names, turn
    assert re.fullmatch(r"agent\d+|orchestrator", turn["role"]), turn
    assert not any(p and p in turn["prompt"] for p in system_prompts), turn


@pytest.mark.parametrize("algorithm", ["shared_stream_ppo", "marft_a"])
def test_a_shared_stream_over_parallel_branches_is_refused_before_the_model_loads(
    algorithm, tmp_path, monkeypatch):
  """Was: accepted by every check, then the first rollout refused it, after the model loaded.
  A DAG that orders every role (one branch a layer) is a chain in disguise and trains."""
  monkeypatch.setattr(model_lib, "load", lambda config: pytest.fail("the model was loaded"))
  row = dict(algorithm=algorithm, config="dag_3agents", graph="dag",
             context_mode="shared_stream", anonymous=False)
  config = algorithms.resolve(from_config_dict(TrainConfig, _config_dict(row)))
  with pytest.raises(ValueError, match=r"rollout\.context_mode='shared_stream'.*team\.graph="
                     r"'dag'.*team\.edges="):
    loop.train(config, str(tmp_path), progress=False)
  sequential = dataclasses.replace(config, team=dataclasses.replace(
      config.team, edges="calculator>estimator, estimator>judge"))
  team_lib.build_team(sequential)
