"""`TrainConfig`: everything a training run needs, as frozen dataclasses (the launch configs in
`launch/configs/` are these defaults plus their changes, overridable on the command line),
and the checks that span its sections.

Algorithms (`algorithm`) are declared once, in `config/algorithms.py`. The keys an algorithm
decides default to "auto" (or 0 / None) here and are filled in by `config.resolve`, which
refuses a value that contradicts the algorithm, naming both keys.
"""

from __future__ import annotations

import dataclasses

from marft_jax.lora.config import LoraConfig
from marft_jax.train import tasks as tasks_lib
from marft_jax.train.advantages import AdvantageConfig
from marft_jax.train.config import teams
from marft_jax.train.config.algorithms import ALGORITHMS
from marft_jax.train.config.sections import (
    BACKBONE_KEYS, MAIN_BACKBONE, TASKS, CriticSection, MeshSection, ModelSection,
    OptimizerSection, RewardSection, RolloutSection, TaskSection, TeamSection, default, one_of)
from marft_jax.train.update import LossConfig
from marft_jax.validation import check_int


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run: its algorithm, length, seed, checkpoints and held-out evaluations at
  the top level, the rest in the sections (the module docstring says more of the algorithms)."""

  # What it trains: "marft_a" (action-level PPO, MARFT §4.1), "marft_t" (token level, §4.2),
  # "ppo" (a team of one), "grpo" (no critic: returns normalised per task) or
  # "shared_stream_ppo" (AReaL's form: one token stream per episode); it fills the keys
  # left at "auto" (`config/algorithms.py`)
  algorithm: str = "marft_a"
  # Rounds of a rollout (rollout.num_envs episodes) and an update, >= 1. The defaults are the
  # first half of the recipe that beat the untuned team in docs/results.md: 16 iterations
  # of 16 episodes, about 25-95 s an iteration on 2 CPU cores.
  iterations: int = 16
  seed: int = 0  # seeds the sampling and the environments' problems, >= 0
  model: ModelSection = ModelSection()
  task: TaskSection = TaskSection()
  team: TeamSection = TeamSection()
  rollout: RolloutSection = RolloutSection()
  lora: LoraConfig = LoraConfig()  # the policy adapters (`lora.LoraConfig`: rank, alpha, ...)
  critic: CriticSection = CriticSection()
  optimizer: OptimizerSection = OptimizerSection()
  advantage: AdvantageConfig = AdvantageConfig()
  loss: LossConfig = LossConfig()
  mesh: MeshSection = MeshSection()
  reward: RewardSection = RewardSection()
  # Iterations between checkpoints, >= 1; one is also written at the end and on SIGTERM
  checkpoint_every: int = 10
  max_to_keep: int = 3  # the latest checkpoints kept in the workdir, >= 1
  # Held-out accuracy during training (greedy, eval_episodes problems of the test split, the
  # "heldout/" metrics): before the first iteration, every eval_every iterations and at the
  # end; 0: none (evaluate checkpoints with launch/eval.py). Single-process runs only.
  eval_every: int = 0
  eval_episodes: int = 64  # held-out problems of each evaluation during training, >= 1
  # The adapters' start: comma-separated PEFT folders, one per adapter, of lora's rank,
  # scale and targets; "": freshly initialised adapters
  init_from: str = ""

  def __post_init__(self):
    one_of("algorithm", self.algorithm, tuple(ALGORITHMS))
    for key in ("iterations", "checkpoint_every", "max_to_keep", "eval_episodes"):
      check_int(key, getattr(self, key), 1)
    check_int("eval_every", self.eval_every, 0)
    check_int("seed", self.seed, 0)  # NumPy seeds the environments' task order: no negatives
    _check_task_keys(self.task)
    _check_own_task_team(self)
    _check_backbone_names(self)

  @property
  def role_backbones(self) -> dict[str, str]:
    """{role name: the backbone it runs on} of the declared roles (a shipped team's roles, and
    an orchestrator, run on the main backbone)."""
    return {r.name: r.backbone or MAIN_BACKBONE for r in self.team.roles}

  @property
  def run_dtype(self) -> str:
    """"bfloat16" if a backbone the run loads is, else "float32": what the dtype-dependent
    "auto" keys (loss.behaviour_correction, loss.old_logp, model.matmul_precision) follow."""
    dtypes = {self.model.backbone(n).param_dtype for n in self.used_backbones}
    return "bfloat16" if "bfloat16" in dtypes else "float32"

  @property
  def used_backbones(self) -> tuple[str, ...]:
    """The backbones some role runs on, the main one first if used, then by name: the models
    a run loads."""
    used = set(self.role_backbones.values()) or {MAIN_BACKBONE}
    if self.team.graph == "orchestrator":
      used.add(MAIN_BACKBONE)
    return tuple(sorted(used, key=lambda n: (n != MAIN_BACKBONE, n)))

  @property
  def critic_backbone(self) -> str:
    """The backbone the shared critic lives on (`critic.backbone`, or the roles' first)."""
    return self.critic.backbone or self.used_backbones[0]

  @property
  def init_from_folders(self) -> list[str]:
    """`init_from`'s PEFT folders, in adapter order."""
    return [p.strip() for p in self.init_from.split(",") if p.strip()]

  @property
  def uses_critic(self) -> bool:
    return ALGORITHMS[self.algorithm].critic

  @property
  def num_adapters(self) -> int:
    """Policy adapters (of a resolved config: `resolve` sets team.num_roles)."""
    if not self.team.roles and not self.team.num_roles:
      raise ValueError("team.num_roles=0 ('auto'): resolve the config first "
                       "(marft_jax.train.config.resolve)")
    return teams.num_adapters(self.team, self.task.name)


# The task keys only some tasks read (each task's entry says which: train/tasks.py).
_TASK_KEYS = ("level", "echo_high", "horizon")  # echo, code: one env step


def _check_task_keys(task: TaskSection) -> None:
  """Refuses a task key set for a task that does not read it, rather than recording it."""
  for key in _TASK_KEYS:
    if getattr(task, key) != default(task, key) and not tasks_lib.reads(task.name, key):
      readers = tuple(t for t in TASKS if tasks_lib.reads(t, key))
      if tasks_lib.reads(tasks_lib.FACTORY_FORM, key):
        readers += (tasks_lib.FACTORY_FORM,)
      raise ValueError(f"task.{key}={getattr(task, key)!r} is read by the task(s) {readers} "
                       f"only, not task.name={task.name!r}")


def _check_own_task_team(config: TrainConfig) -> None:
  """A task of your own has no shipped team: its roles are declared."""
  if tasks_lib.is_factory(config.task.name) and not (config.team.roles or
                                                     config.team.profiles):
    raise ValueError(f"team.roles: task.name={config.task.name!r} (a task of your own) has no "
                     "shipped team; declare team.roles and team.order (or team.profiles)")


def _check_backbone_names(config: TrainConfig) -> None:
  """Refuses a role naming a backbone that is not declared, and a declared backbone (or the
  main one's keys, set) that no role runs on: a model loaded for nothing."""
  model, team = config.model, config.team
  declared = (MAIN_BACKBONE,) + tuple(b.name for b in model.backbones)
  if MAIN_BACKBONE in declared[1:]:
    raise ValueError(f"model.backbones.{MAIN_BACKBONE}: the name of the backbone model.source, "
                     "model.param_dtype and model.rollout_layout declare; give a further "
                     "backbone another name")
  for role in team.roles:
    if role.backbone and role.backbone not in declared:
      raise ValueError(f"team.roles.{role.name}.backbone={role.backbone!r}: no such backbone; "
                       f"declared: {list(declared)} (model.backbones.<name>, or "
                       f"{MAIN_BACKBONE!r}: model.source's)")
  used = config.used_backbones
  if config.critic.backbone and config.critic.backbone not in used:
    raise ValueError(f"critic.backbone={config.critic.backbone!r}: no role runs on it; the "
                     f"roles' backbones: {list(used)}")
  for b in model.backbones:
    if b.name not in used:
      raise ValueError(f"model.backbones.{b.name}: no role runs on it (set "
                       f"team.roles.<role>.backbone={b.name!r}, or remove it)")
  if MAIN_BACKBONE not in used:
    for key in BACKBONE_KEYS:
      if getattr(model, key) != default(model, key):
        raise ValueError(f"model.{key}={getattr(model, key)!r}: every role runs on a backbone "
                         "of model.backbones, none on the main one this key sets")
