"""The problems a run trained on, as its checkpoints record them, and keeping them out of every
evaluation of the run, whatever data the evaluation is given.

A problem's fingerprint is a hash of its statement (`splits.statement`: the question or the
prompt, whitespace collapsed; SHA-256, 16 hex digits), so the same problem in another file,
under another id or wrapped differently, has the same fingerprint. Each checkpoint's meta holds
`record(config, cursor, envs)` under "training_problems":

- file tasks ("math_jsonl", "code"): the id and fingerprint of every problem of the training
  part (`splits.task_problems`; the whole of `task.path` with a `task.test_path`, else all but
  its held-out 10 %). Each is drawn once an epoch, so the part is what a run trains on,
  recorded whole;
- "arithmetic": the seeded task stream the run drew from, up to the checkpoint's data cursor
  (the level, the batch's seed, size and groups, and how many episodes each environment has
  started): `fingerprints` replays it (`EnvBatch.episode_seed`, `ArithmeticProblems`), which
  gives exactly the problems played, never stored one by one for an endless stream;
- the team tasks ("split_facts", "verify_correct", "grid_path"): their stream, as arithmetic's
  (its level unread). Their test split never holds a training problem (disjoint hash
  buckets, `envs/team_tasks.py`), so an evaluation of one leaves nothing out;
- "echo": none (its tasks are numbers to repeat, no problem a file could hold).

`launch.eval` reads the latest checkpoint's record (`of_checkpoint`), plays a problem file's
held-out problems less those (`heldout_problems`) and reports how many it dropped. So a run
trained on one file and scored on another, or given only a test file, is never scored on a
problem it trained on. Generated arithmetic's test split never holds a problem of a generated
training stream (`envs/arithmetic.py`: disjoint hash buckets), but a file can: its seeds'
problems a checkpoint trained on are replaced by the next ones of the same seeded streams
(`Unseen`), and counted (`replaced_draws`).
"""

from __future__ import annotations

import os
from typing import Any, Collection, Mapping, Sequence

from absl import logging

from marft_jax.envs import arithmetic, splits
from marft_jax.envs.batch import EnvBatch
from marft_jax.train import tasks
from marft_jax.train.checkpoint import Checkpointer
from marft_jax.train.config.saved import read_saved_config
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.heldout import EVAL_SEED_OFFSET, Unseen, fingerprint, heldout_problems

KEY = "training_problems"  # in a checkpoint's meta


def record(config: TrainConfig, cursor: Mapping[str, Any], envs=None) -> dict:
  """What a checkpoint of a `config` run records of its training problems (see the module
  docstring); `cursor`: the environments' data cursor saved beside it (`EnvBatch.state_dict`:
  "seed", "episodes"). `envs`: the run's `EnvBatch`, whose environments hold a problem file's
  training part as read when the run started (a file moved or deleted since does not fail
  the save); None: the files are read now."""
  task = config.task
  entry = tasks.lookup(task.name)
  if entry.record == "file":
    if envs is not None:  # CodeEnv.problems, MathEnv.problems: the part, in file order
      train = envs.envs[0].problems
    else:
      train = splits.task_problems(task.name, task.path, task.test_path)[0]
    return {"task": task.name, "problems": [[p.id, fingerprint(p)] for p in train]}
  if entry.record == "stream":
    return {"task": task.name, "stream": {
        "level": task.level, "seed": int(cursor["seed"]), "group_size": config.rollout.group_size,
        "episodes": [int(n) for n in cursor["episodes"]]}}
  if entry.record == "ids":
    return {"task": task.name, "problems": _played_ids(config, cursor, envs)}
  return {"task": task.name, "problems": []}


def _played_ids(config: TrainConfig, cursor: Mapping[str, Any], envs=None) -> list:
  """[[id, fingerprint]] of the problems a factory's training stream played up to `cursor`
  (its environments' `problem_id` of each episode's seed; [] without one), by id."""
  env = envs.envs[0] if envs is not None else tasks.lookup(config.task.name).factory(
      config.task, "train", int(cursor["seed"]))
  if not hasattr(env, "problem_id"):
    return []
  ids = {env.problem_id(seed) for seed in _stream_seeds(
      int(cursor["seed"]), config.rollout.group_size, cursor["episodes"])}
  return [[i, tasks.id_fingerprint(i)] for i in sorted(ids)]


def _stream_seeds(seed: int, group_size: int, episodes: Sequence[int]) -> list[int]:
  """The episode seeds an `EnvBatch` of `len(episodes)` environments drew, environment i its
  first episodes[i]."""
  batch = EnvBatch(lambda i: None, len(episodes), seed=seed, group_size=group_size)
  return sorted({batch.episode_seed(i, k) for i, n in enumerate(episodes) for k in range(n)})


def fingerprints(recorded: Mapping[str, Any]) -> dict[str, str]:
  """{fingerprint: id} of the problems a `record` names (arithmetic: its stream replayed)."""
  if "stream" not in recorded:
    return {fp: problem_id for problem_id, fp in recorded["problems"]}
  stream = recorded["stream"]
  episodes = stream["episodes"]
  source = tasks.lookup(recorded.get("task", "arithmetic")).stream(stream["level"], "train")
  seeds = _stream_seeds(stream["seed"], stream["group_size"], episodes)
  return {fingerprint(p): p.id for p in map(source.problem_for_seed, seeds)}


def of_checkpoint(workdir: str) -> dict[str, str]:
  """{fingerprint: id} of the problems the latest checkpoint in `workdir` trained on ({} if
  there is none). A checkpoint written before the record was kept gives them from its saved
  config and data cursor (its problem files read now), with a warning; where those cannot
  be read, none, with a warning that says so."""
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    return {}
  with Checkpointer(workdir, read_only=True) as checkpointer:
    step = checkpointer.latest_step()
    meta = {} if step is None else checkpointer.read_meta(step)
  if KEY in meta:
    return fingerprints(meta[KEY])
  if step is None or "config" not in meta:
    return {}
  where = f"{workdir}: step {step}"
  try:
    saved = read_saved_config(meta["config"], where)
    cursor = meta.get("envs")
    if tasks.lookup(saved.task.name).record in ("stream", "ids") and cursor is None:
      raise ValueError("no data cursor saved")
    trained = fingerprints(record(saved, cursor))
  except (OSError, ValueError) as e:
    logging.warning("%s records no training problems and its saved config does not give them "
                    "(%s): none can be left out of this evaluation", where, e)
    return {}
  logging.warning("%s records no training problems (written before they were kept): taken "
                  "from its saved config's task and data cursor", where)
  return trained


def heldout_dropped(config: TrainConfig, trained: Collection[str]) -> int:
  """How many held-out problems of a problem file task (`heldout_problems`) an evaluation of
  `config` leaves out as trained on (0 for the other tasks: their draws are replaced,
  `replaced_draws`)."""
  task = config.task
  if tasks.lookup(task.name).heldout != "file":
    return 0
  return heldout_problems(task.name, task.path, task.test_path, trained)[1]


def replaced_draws(config: TrainConfig, episodes: Sequence[Any],
                   trained: Collection[str]) -> int:
  """How many of the tasks of `episodes` (an evaluation, one task per `Episode.seed`, several
  samples of it alike) were dealt another problem than their seed's first, a training
  problem: generated arithmetic's (`Unseen`), a factory's by its `problem_id`
  (`tasks.unplayed`); 0 for the other tasks."""
  seeds = {e.seed for e in episodes}
  heldout = tasks.lookup(config.task.name).heldout
  if heldout == "ids":
    env = tasks.lookup(config.task.name).factory(config.task, "test",
                                                 config.seed + EVAL_SEED_OFFSET)
    try:
      return 0 if not hasattr(env, "problem_id") else sum(
          tasks.id_fingerprint(env.problem_id(seed)) in trained for seed in seeds)
    finally:
      env.close()
  if heldout != "replaced":
    return 0
  source = arithmetic.ArithmeticProblems(levels=(config.task.level,), split="test")
  return sum(fingerprint(source.problem_for_seed(seed)) in trained for seed in seeds)
