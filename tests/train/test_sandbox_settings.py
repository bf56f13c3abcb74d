"""`task.sandbox`: each key changes what it names in the code task's environments (a program
just over a limit fails under it and passes under a larger one, verdicts derived by hand from
the program), `mode='bwrap'` where bubblewrap is missing is refused before the model loads,
and every key is refused on the tasks that run no program.

Mutants these tests kill (each applied and seen failing): `envs_build.build_envs` building
`Sandbox(Limits(wall_s=5.0))` as before (wall_s, memory_mb, processes, file_mb fail), without
`mode=` (mode fails), `read_task_data` without `check_sandbox` (the bwrap refusal fails), and
`TaskSection` without its refusal (the other-task refusals fail).
"""

import dataclasses
import json
import time

import pytest

from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.train import loop
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import preflight
from marft_jax.train.build import team as team_lib
from marft_jax.train import config as config_lib
from marft_jax.train.config import SandboxSection, TaskSection
from tests.envs.test_sandbox import bwrap_works

# A valid value other than the default, per key. Generated over the section's fields below, so
# a key added later without an entry here fails `test_every_key_is_refused_on_tasks_that_run_no_program`.
CHANGED = {"mode": "plain", "wall_s": 2.0, "memory_mb": 512, "processes": 2, "file_mb": 4,
           "parallel": 4}
# key: (the value a program exceeds, one it fits in, the program, its verdict when exceeded).
# Each program prints 1, the expected output, when it runs to its end.
LIMITED = {
    "wall_s": (0.25, 3.0, "import time\ntime.sleep(0.6)\nprint(1)", "timeout"),
    "memory_mb": (100, 1024, "x = bytearray(300 << 20)\nprint(1)", "runtime_error"),
    "processes": (1, 4, "import threading, time\n"
                        "ts = [threading.Thread(target=time.sleep, args=(0.1,)) for _ in range(3)]\n"
                        "for t in ts:\n  t.start()\nfor t in ts:\n  t.join()\nprint(1)",
                  "runtime_error"),
    "file_mb": (1, 4, "open('f', 'wb').write(b'x' * (2 << 20))\nprint(1)", "runtime_error"),
}
# bwrap binds /usr and the interpreter's prefix only: /etc/passwd is not there. "plain"
# hides no file.
HIDES_HOST_FILES = "import os\nprint(int(not os.path.exists('/etc/passwd')))"


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
  """A problem file of two problems whose one test expects "1" (either may be drawn)."""
  path = tmp_path_factory.mktemp("code") / "problems.jsonl"
  path.write_text("".join(json.dumps({"id": f"one{i}", "prompt": f"Print 1 ({i}).",
                                      "tests": [{"input": "", "output": "1\n"}]}) + "\n"
                          for i in range(2)))
  return str(path)


def _config(problems, **sandbox):
  return config_lib.preset("marft_a", task=TaskSection(
      name="code", path=problems, sandbox=SandboxSection(**sandbox)))


def _verdict(config, program: str) -> str:
  """The verdict on `program` (the coder's reply) in the config's code environments."""
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0, num_envs=1)
  try:
    envs.reset(0)
    step = envs.step(0, {p.role: f"```python\n{program}\n```" for p in team})
    return step.info["verdicts"]["coder"][0]
  finally:
    envs.close()


@pytest.mark.parametrize("key", sorted(LIMITED))
def test_each_limit_is_the_one_the_program_runs_under(problems, key):
  exceeded, fits, program, verdict = LIMITED[key]
  assert _verdict(_config(problems, **{key: exceeded}), program) == verdict
  assert _verdict(_config(problems, **{key: fits}), program) == "passed"


def test_mode_is_the_isolation_the_program_runs_in(problems):
  if not bwrap_works():
    pytest.skip("bubblewrap is not installed or cannot make namespaces here")
  assert _verdict(_config(problems, mode="bwrap"), HIDES_HOST_FILES) == "passed"
  assert _verdict(_config(problems, mode="plain"), HIDES_HOST_FILES) == "wrong"


def test_bwrap_mode_without_bubblewrap_is_refused_before_the_model_loads(problems, tmp_path,
                                                                         monkeypatch):
  config = dataclasses.replace(_config(problems, mode="bwrap"),
                               model=config_lib.ModelSection(source=str(tmp_path / "none")))
  monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
  with pytest.raises(ValueError, match=r"^task\.sandbox\.mode='bwrap': bubblewrap is not "
                                       r"installed here"):
    loop.train(config, str(tmp_path / "run"), progress=False)  # the model would fail to load
  preflight.read_task_data(_config(problems, mode="auto"))  # "auto" takes what works


@pytest.mark.parametrize("parallel, together", [(2, 1), (3, 1), (4, 2), (6, 3)])
def test_parallel_is_how_many_programs_run_at_once(problems, parallel, together):
  """`parallel` programs at once: one env step's tests 2 at a time, parallel // 2 envs
  stepping together. Each of 4 envs' program sleeps 1.5 s: stepped together they take
  ceil(4 / together) rounds of it (and their start-up), one by one 6 s or more; every test
  still passes."""
  config = _config(problems, parallel=parallel)
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0, num_envs=4)
  try:
    assert envs.envs[0].sandbox.max_parallel == parallel
    assert envs.step_concurrency == together
    envs.envs[0].sandbox.plan  # pylint: disable=pointless-statement  (its probe, untimed)
    reply = {p.role: "```python\nimport time\ntime.sleep(1.5)\nprint(1)\n```" for p in team}
    for i in range(4):
      envs.reset(i)
    start = time.monotonic()
    steps = envs.step_many([(i, reply) for i in range(4)])
    took = time.monotonic() - start
  finally:
    envs.close()
  assert [s.info["verdicts"]["coder"] for s in steps] == [["passed"]] * 4, steps
  assert took >= -(-4 // together) * 1.5  # a sleep cannot end early
  if together > 1:
    assert took < 6.0, took  # one by one, the sleeps alone take 6 s


@pytest.mark.parametrize("task", [t for t in config_lib.TASKS
                                  if t not in config_lib.SANDBOX_TASKS])
def test_every_key_is_refused_on_tasks_that_run_no_program(task):
  keys = [f.name for f in dataclasses.fields(SandboxSection)]
  assert sorted(CHANGED) == sorted(keys)
  for key in keys:
    changed = SandboxSection(**{key: CHANGED[key]})
    with pytest.raises(ValueError, match=rf"^sandbox\.{key}={CHANGED[key]!r}: only the tasks "
                                         rf"\('code', 'humaneval'\) run programs in a sandbox, "
                                         rf"not name='{task}'"):
      TaskSection(name=task, sandbox=changed)
    TaskSection(name="code", sandbox=changed)  # read there
    # from a config file or flags, naming the whole key
    flat = to_config_dict(config_lib.TrainConfig(task=TaskSection(name="code", sandbox=changed)))
    flat.task.name = task
    with pytest.raises(ValueError, match=rf"config\.task: sandbox\.{key}="):
      from_config_dict(config_lib.TrainConfig, flat)
  TaskSection(name=task)  # the defaults change nothing


@pytest.mark.parametrize("key, value", [("mode", "docker"), ("wall_s", 0.0), ("memory_mb", 0),
                                        ("processes", 1.5), ("file_mb", -1), ("parallel", 0)])
def test_bad_values_are_refused_by_name(key, value):
  with pytest.raises(ValueError, match=rf"^{key}={value!r}"):
    SandboxSection(**{key: value})
