"""What a checkpoint records of the problems its run trained on (`train/trained_problems.py`),
checked against the problems the trainer's own environments deal (`envs_build.build_envs`,
reset round by round as the rollout does), not against the record's replay of them."""

import dataclasses
import hashlib
import json

import pytest

from marft_jax.envs import splits
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import team as team_lib
from marft_jax.train import config as config_lib
from marft_jax.train import trained_problems


def _digest(text: str) -> str:
  return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


def _dealt(config, rounds):
  """{statement hash: problem id} of what the run's environments deal in `rounds` rollouts
  (every environment one episode a round), and their data cursor after them."""
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=config.seed)
  dealt = {}
  for _ in range(rounds):
    for i in range(len(envs)):
      envs.reset(i)
      problem = envs.envs[i].problem
      dealt[_digest(problem.question)] = problem.id
  envs.close()
  return dealt, envs.state_dict()


@pytest.mark.parametrize("algorithm, level, rounds", [("marft_a", 1, 3), ("grpo", 3, 2)])
def test_an_arithmetic_record_gives_exactly_the_problems_dealt(algorithm, level, rounds):
  """GRPO's groups play one task per group; a level picks the generator's stream."""
  config = config_lib.preset(algorithm, seed=5, task=config_lib.TaskSection(level=level),
                             rollout=dataclasses.replace(config_lib.preset(algorithm).rollout,
                                                         num_envs=8))
  dealt, cursor = _dealt(config, rounds)
  assert len(dealt) == rounds * 8 // config.rollout.group_size  # no repeats here
  recorded = json.loads(json.dumps(trained_problems.record(config, cursor)))  # as saved
  assert trained_problems.fingerprints(recorded) == dealt


def test_a_split_file_records_its_training_part_whole(tmp_path):
  path = tmp_path / "all.jsonl"
  path.write_text("".join(json.dumps({"question": f"What is {n} + 1?", "answer": f"#### {n + 1}"})
                          + "\n" for n in range(20)))
  config = config_lib.preset("marft_a", task=config_lib.TaskSection(name="math_jsonl",
                                                                    path=str(path)))
  train, test = splits.task_problems("math_jsonl", str(path))
  cursor = {"seed": 0, "episodes": [0] * 16}  # none drawn yet
  recorded = trained_problems.record(config, cursor)
  assert recorded == {"task": "math_jsonl",
                      "problems": [[p.id, _digest(p.question)] for p in train]}
  assert len(train) == 18
  trained = trained_problems.fingerprints(recorded)
  assert trained_problems.heldout_problems("math_jsonl", str(path), "", trained) == (test, 0)
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0)  # as the trainer's: the file read once
  path.unlink()  # a checkpoint after the file is gone records the part it was read as
  assert trained_problems.record(config, cursor, envs) == recorded
  envs.close()


def test_generated_held_out_problems_a_checkpoint_trained_on_are_replaced():
  """A file-trained run (its record: two problems of the generated test split) evaluated on
  generated arithmetic: the environments that would deal those deal the next problem of the
  same seed's stream (derived here with `generate_problems`); the others are unchanged."""
  from types import SimpleNamespace
  from marft_jax.envs import arithmetic
  config = config_lib.preset("marft_a", task=config_lib.TaskSection(level=2))
  team, _ = team_lib.build_team(config)

  def dealt(trained):
    envs = envs_build.build_envs(config, team, seed=7, split="test", num_envs=6, group_size=1,
                               trained=trained)
    tasks = [envs.reset(i) for i in range(6)]
    envs.close()
    return [(seed, observation.task) for seed, observation in tasks]

  plain = dealt(())
  trained = {_digest(plain[1][1]), _digest(plain[4][1])}
  filtered = dealt(trained)
  assert [seed for seed, _ in filtered] == [seed for seed, _ in plain]
  for i, ((seed, task), (_, got)) in enumerate(zip(plain, filtered)):
    want = arithmetic.generate_problems(2, 2, seed, "test")[1].question if i in (1, 4) else task
    assert got == want, i
  episodes = [SimpleNamespace(seed=seed) for seed, _ in plain]
  assert trained_problems.replaced_draws(config, episodes, trained) == 2
