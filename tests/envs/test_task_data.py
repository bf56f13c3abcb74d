"""Tasks built from the config (`loop.build_envs`): problem files for math and code."""

import dataclasses
import json

from marft_jax.train import config as config_lib
from marft_jax.train import loop


def _config(**task):
  return dataclasses.replace(config_lib.preset("marft_a"),
                             task=config_lib.TaskSection(**task),
                             rollout=config_lib.RolloutSection(num_envs=4))


def _code_file(path, ids):
  with open(path, "w") as f:
    for name in ids:
      f.write(json.dumps({"id": name, "prompt": f"Print {name}.",
                          "tests": [{"input": "", "output": f"{name}\n"}]}) + "\n")
  return str(path)


def test_code_task_reads_its_problem_file(tmp_path):
  path = _code_file(tmp_path / "mine.jsonl", ["alpha", "beta", "gamma"])
  config = _config(name="code", path=path)
  team, _ = loop.build_team(config)
  envs = loop.build_envs(config, team, seed=0)
  try:
    for index in range(len(envs)):
      envs.reset(index)
    seen = {env.problem.id for env in envs.envs}
    assert seen <= {"alpha", "beta", "gamma"} and seen
  finally:
    envs.close()
