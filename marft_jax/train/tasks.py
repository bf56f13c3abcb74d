"""The task table: every task a run can play, as one `Task` entry each, saying how its
environments are built and what it needs (problem files, a sandbox, the task keys it reads,
how its held-out split keeps training problems out, what a checkpoint records of its
problems). `build.envs.build_envs`, the config's checks and `trained_problems` read the entry
(`lookup`), never the task's name.

A task of your own is one more entry: `task.name="package.module:factory"` (or
`train(config, workdir, task=factory)`) names a function, importable from the run's Python
path, whose contract is this:

    factory(task, split, seed) -> marft_jax.envs.Environment

  task:  the config's task section (`config.TaskSection`): `task.options` is the free-form
         mapping the config file declares (JSON values, passed through as given;
         `--config.task.options.<key>=` overrides a declared one), `task.horizon` the env
         steps an episode may take (> 1: the rollout shows each step's feedback to the next),
         `task.eval_problems` the problems an evaluation plays.
  split: "train" (training episodes) or "test" (held-out: `launch.eval`, `eval_every`).
  seed:  the batch's seed (`config.seed`; an evaluation's own). Each episode's problem comes
         from `reset(episode_seed)`: the same seed, the same problem.
  returns a fresh `Environment` (`envs/base.py`: `reset(seed)` and `step(actions)`, every role's
         reward in each `Step`); it is called once for each of the batch's environments.

  Held-out problems: the problems its "test" split gives should be ones "train" never gives.
  Where they may overlap, the environment declares a `problem_id(seed) -> str` method: the id
  of the problem `reset(seed)` plays. Checkpoints then record the ids the run trained on, and
  an evaluation plays, for a test seed whose problem was trained on, the next seed of that
  seed's stream whose problem was not (`launch.eval` prints how many as
  training_problems_dropped). Without `problem_id` nothing is recorded or left out.
  Threads: `step` is called from one thread at a time unless the environment's
  `step_concurrency` says how many of its kind may step at once (`Environment`).

  Checked before the model loads (`check`): an unknown module, a missing attribute, a factory
  that raises for either split, one that returns something other than an `Environment`, or a
  `problem_id` that gives no string is a ValueError of one line naming task.name and the
  module. A task of your own has no shipped team: declare `team.roles` (or `team.profiles`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
from typing import Any, Callable, Collection, Optional

from marft_jax.envs import arithmetic, code_env, sandbox, splits, team_tasks
from marft_jax.envs import problems as problems_lib
from marft_jax.envs.base import Environment
from marft_jax.envs.math_env import MathEnv
from marft_jax.envs.math_grading import Grader
from marft_jax.envs.toy import EchoEnv
from marft_jax.train import heldout

# What a checkpoint records of the problems its run trained on (`trained_problems.record`).
RECORDS = ("file", "stream", "ids", "none")
# How the "test" split keeps training problems out: "file" (a file's held-out part, less the
# problems a checkpoint trained on: `heldout.heldout_problems`), "disjoint" (generated
# in hash buckets of their own: none to leave out), "replaced" (disjoint from the generated
# training stream, a file's trained problems replaced by the next draws: `heldout.Unseen`), "ids" (a factory's `problem_id`: trained seeds skipped), "none" (no problems).
HELDOUT = ("file", "disjoint", "replaced", "ids", "none")


@dataclasses.dataclass(frozen=True)
class Built:
  """A task's environments for one batch: `make(i)` builds environment i."""

  make: Callable[[int], Any]
  num_tasks: Optional[int] = None  # a finite set's size (each test problem once); None: endless
  shared: tuple = ()  # a grader or sandbox its environments share, closed with the batch


@dataclasses.dataclass(frozen=True)
class Task:
  """One entry of the table.

  build(task, team, split, seed, trained) -> `Built`: `task` the config's task section, `team`
  the agent profiles, `split` "train" or "test", `seed` the batch's, `trained` fingerprints a
  checkpoint trained on (left out of "test", as `heldout` says).
  """

  name: str
  build: Callable[..., Built]
  reads: tuple[str, ...] = ()  # task keys it reads besides name and eval_problems
  problem_file: bool = False  # its problems come from `envs.splits.task_problems`
  sandbox: bool = False  # its programs run in `task.sandbox`
  record: str = "none"  # one of RECORDS
  heldout: str = "none"  # one of HELDOUT
  trains: bool = True  # False: a benchmark, evaluated only
  # "stream" tasks: (task level, split) -> the `ProblemSource` its seeds draw from
  stream: Optional[Callable[[int, str], Any]] = None
  factory: Optional[Callable] = None  # a task of your own: the function task.name names


# --- the shipped tasks ------------------------------------------------------------------------


def _graded(team) -> list:
  return [p.role for p in team if p.graded]


def _echo(task, team, split, seed, trained) -> Built:
  return Built(lambda i: EchoEnv(graded=_graded(team), high=task.echo_high))


def _team_task(task, team, split, seed, trained) -> Built:
  source, roles = team_tasks.problems(task.name, split), [p.role for p in team]
  team_tasks.module(task.name).check_roles(roles)
  return Built(lambda i: team_tasks.make_env(task.name, source, roles, _graded(team)))


def _code(task, team, split, seed, trained) -> Built:
  problems = _file_problems(task, split, trained)
  box = build_sandbox(task.sandbox)
  wall_s = task.sandbox.wall_s
  return Built(lambda i: code_env.CodeEnv(
      problems, graded_roles=_graded(team), sandbox=box, test_timeout_s=wall_s,
      budget_s=BUDGET_TESTS * wall_s, shuffle=False,
      test_parallel=TEST_PARALLEL), num_tasks=len(problems), shared=(box,))


# A code env step's tests share a budget of this many tests' wall-clock limits (a step runs
# up to 10 tests per graded role, `TEST_PARALLEL` at a time).
BUDGET_TESTS = 12
TEST_PARALLEL = 2


def build_sandbox(settings) -> sandbox.Sandbox:
  """The code task's `envs.sandbox.Sandbox` in `settings`' mode and limits (`task.sandbox`,
  a `config.SandboxSection`); its environments share it."""
  limits = sandbox.Limits(wall_s=settings.wall_s, memory_mb=settings.memory_mb,
                          processes=settings.processes, file_mb=settings.file_mb)
  return sandbox.Sandbox(limits, mode=settings.mode, max_parallel=settings.parallel)


def _math(source, task, team, num_tasks=None) -> Built:
  grader = Grader()
  return Built(lambda i: MathEnv(source, graded_roles=_graded(team), horizon=task.horizon,
                                 grader=grader), num_tasks=num_tasks, shared=(grader,))


def _arithmetic(task, team, split, seed, trained) -> Built:
  source = _arithmetic_stream(task.level, split)
  if split == "test" and trained:
    source = heldout.Unseen(source, trained)
  return _math(source, task, team)


def _math_jsonl(task, team, split, seed, trained) -> Built:
  source = problems_lib.ProblemSet(_file_problems(task, split, trained), name=split,
                                   shuffle=False)
  return _math(source, task, team, num_tasks=len(source))


def _file_problems(task, split: str, trained: Collection[str]) -> tuple:
  if split == "test":
    return heldout.heldout_problems(task.name, task.path, task.test_path, trained)[0]
  return splits.task_problems(task.name, task.path, task.test_path)[0]


def _arithmetic_stream(level: int, split: str):
  return arithmetic.ArithmeticProblems(levels=(level,), split=split)


def _team_stream(name: str) -> Callable[[int, str], Any]:
  def stream(level: int, split: str):
    return team_tasks.problems(name, split)
  return stream


_TEAM_TASKS = ("split_facts", "verify_correct", "grid_path")  # envs/team_tasks.py
SHIPPED: tuple[Task, ...] = (
    Task("arithmetic", _arithmetic, reads=("level", "horizon"), record="stream",
         heldout="replaced", stream=_arithmetic_stream),
    Task("math_jsonl", _math_jsonl, reads=("path", "test_path", "horizon"), problem_file=True,
         record="file", heldout="file"),
    Task("code", _code, reads=("path", "test_path"), problem_file=True, sandbox=True,
         record="file", heldout="file"),
    Task("echo", _echo, reads=("echo_high",)),
    Task("humaneval", _code, problem_file=True, sandbox=True, record="file", heldout="file",
         trains=False),
) + tuple(Task(name, _team_task, record="stream", heldout="disjoint", stream=_team_stream(name))
          for name in _TEAM_TASKS)
_BY_NAME = {t.name: t for t in SHIPPED}
NAMES = tuple(_BY_NAME)
SANDBOX = tuple(t.name for t in SHIPPED if t.sandbox)
FACTORY_FORM = "package.module:factory"


# --- tasks of your own ------------------------------------------------------------------------


def is_factory(name: str) -> bool:
  """Whether task.name names a function of your own ("package.module:factory")."""
  return ":" in name


def check_name(name: str) -> None:
  """A shipped task's name or a well-formed "package.module:factory"; else a ValueError
  naming `name` (the function is imported later, by `lookup`: no import in a config check)."""
  if name in _BY_NAME:
    return
  module, _, attr = name.partition(":")
  if is_factory(name) and attr.isidentifier() and all(
      part.isidentifier() for part in module.split(".")):
    return
  raise ValueError(f"name={name!r}: use one of {NAMES}, or your own factory as "
                   f"'{FACTORY_FORM}'")


def lookup(name: str) -> Task:
  """The entry of task `name`: a shipped one, or the entry of the factory it names (imported
  now; a ValueError naming task.name and the module where that fails)."""
  if name in _BY_NAME:
    return _BY_NAME[name]
  check_name(name)
  return Task(name, _factory_build, reads=("horizon", "options"), record="ids", heldout="ids",
              factory=_import(name))


def reads(name: str, key: str) -> bool:
  """Whether task `name` reads task key `key` (without importing a factory)."""
  return key in (("horizon", "options") if is_factory(name) else _BY_NAME[name].reads)


def _import(name: str) -> Callable:
  module_name, _, attr = name.partition(":")
  where = f"task.name={name!r}"
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 (a module that fails to import, however it fails)
    raise ValueError(f"{where}: module {module_name!r} does not import "
                     f"({type(e).__name__}: {_one_line(e)})") from None
  factory = getattr(module, attr, None)
  if factory is None:
    raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
  if not callable(factory):
    raise ValueError(f"{where}: {module_name}.{attr} is a {type(factory).__name__}, not a "
                     f"function (task, split, seed) -> Environment")
  return factory


def name_of(factory: Callable) -> str:
  """The task.name of `factory` ("module:qualname"), checked to import as that same function
  (so that a resumed run and `launch.eval` find it again); a ValueError otherwise."""
  name = f"{getattr(factory, '__module__', '')}:{getattr(factory, '__qualname__', '')}"
  try:
    check_name(name)
    found = _import(name)
  except ValueError:
    found = None
  if found is not factory:
    raise ValueError(f"task={factory!r}: not importable as {name!r}; define the factory at "
                     f"the top level of a module on the Python path")
  return name


def with_factory(config, factory: Optional[Callable]):
  """`config` whose task.name names `factory` (`train(config, workdir, task=factory)`); a
  ValueError when config.task.name names another task than the default or `factory`."""
  if factory is None:
    return config
  name = name_of(factory)
  default = type(config.task)().name
  if config.task.name not in (default, name):
    raise ValueError(f"task={name!r} and config.task.name={config.task.name!r}: two tasks; "
                     "give one")
  return dataclasses.replace(config, task=dataclasses.replace(config.task, name=name))


def check(task) -> None:
  """A task of your own, as `launch.train`, `train` and `launch.eval` check it before the
  model loads: built for each split with seed 0, an `Environment` whose `problem_id`, if it
  has one, gives a string; a ValueError of one line naming task.name and the module."""
  entry = lookup(task.name)
  if entry.factory is None:
    return
  where = f"task.name={task.name!r}: {task.name.replace(':', '.')}"
  for split in ("train", "test"):
    call = f"{where}(task, split={split!r}, seed=0)"
    try:
      env = entry.factory(task, split, 0)
    except Exception as e:  # noqa: BLE001 (whatever your factory raises stops the launch)
      raise ValueError(f"{call} raised {type(e).__name__}: {_one_line(e)}") from None
    if not isinstance(env, Environment):
      raise ValueError(f"{call} returned {type(env).__name__}, not a "
                       "marft_jax.envs.Environment")
    try:
      if hasattr(env, "problem_id") and not isinstance(env.problem_id(0), str):
        raise ValueError(f"{call}: its problem_id(0) is {env.problem_id(0)!r}, not a str")
    finally:
      env.close()


def _factory_build(task, team, split, seed, trained) -> Built:
  factory = lookup(task.name).factory
  if split == "test" and trained:
    return Built(lambda i: unplayed(factory(task, split, seed), trained))
  return Built(lambda i: factory(task, split, seed))


def _one_line(e: BaseException) -> str:
  return " ".join(str(e).split())[:300]


# --- held-out problems of a factory's task ----------------------------------------------------


def id_fingerprint(problem_id: str) -> str:
  """The fingerprint (16 hex digits) a factory's problem id is recorded under."""
  return hashlib.sha256(f"problem_id\x00{problem_id}".encode("utf-8")).hexdigest()[:16]


def unplayed_seed(env, seed: int, trained: Collection[str], tries: int = 1000) -> int:
  """`seed`, or the first of its stream (`seed`, then seeds drawn from it) whose
  `env.problem_id` is not in `trained`; a ValueError after `tries`."""
  for k in itertools.count():
    candidate = seed if k == 0 else int.from_bytes(
        hashlib.sha256(f"{seed}:{k}".encode()).digest()[:4], "little")
    if id_fingerprint(env.problem_id(candidate)) not in trained:
      return candidate
    if k == tries:
      raise ValueError(f"seed {seed}: its first {tries} held-out problems were all trained on")


def unplayed(env, trained: Collection[str]):
  """A factory's test environment `env` less the problems a checkpoint trained on
  (`trained`: fingerprints): `reset(seed)` plays `unplayed_seed(seed)`'s problem. `env` itself
  when it gives no `problem_id` (nothing to leave out)."""
  return _Unplayed(env, trained) if hasattr(env, "problem_id") else env


class _Unplayed(Environment):

  def __init__(self, env, trained: Collection[str]):
    self.env, self.trained = env, trained

  def reset(self, seed: int):
    return self.env.reset(unplayed_seed(self.env, seed, self.trained))

  def step(self, actions):
    return self.env.step(actions)

  def problem_id(self, seed: int) -> str:
    return self.env.problem_id(unplayed_seed(self.env, seed, self.trained))

  @property
  def step_concurrency(self) -> int:
    return self.env.step_concurrency

  def close(self) -> None:
    self.env.close()
