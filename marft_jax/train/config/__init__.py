"""A training run's config, as plain data: what it is, what it resolves to, what it records.

  sections.py       one frozen dataclass per section (model, task, team, rollout, critic, ...),
                    each checking its own fields when built
  teams.py          the shipped teams as data, and what a team section declares (its roles in
                    order, their adapters and backbones)
  algorithms.py     the algorithm table: what each `--config.algorithm` trains
  schema.py         `TrainConfig`, the sections together, and the checks that span them
  profile_files.py  teams from the original MARFT's profile files (`team.profiles`)
  resolve.py        `resolve(config)`: every "auto" decided in one place, and the checks that
                    need only the config; `preset(algorithm, ...)`
  history.py        the compatibility history: keys added since a checkpoint was written
  saved.py          the config as a run records it, and a recorded config read back

Each module imports only those listed above it (and the maths, tasks and leaves below the
package: `tests/test_layers.py`). This package re-exports the names a config file and user
code import, so `from marft_jax.train.config import TrainConfig, TeamSection` keeps working
(`resolve` is the module; `config.resolve.resolve(config)` the function).
"""

from marft_jax.train.config.sections import (
    GRAPHS, MAIN_BACKBONE, ROLE_ADAPTERS, SANDBOX_TASKS, TASKS, BackboneSection, CriticSection,
    MeshSection, ModelSection, OptimizerSection, RewardSection, RoleSection, RolloutSection,
    SandboxSection, TaskSection, TeamSection)
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.resolve import preset

__all__ = [
    "GRAPHS", "MAIN_BACKBONE", "ROLE_ADAPTERS", "SANDBOX_TASKS", "TASKS", "BackboneSection",
    "CriticSection", "MeshSection", "ModelSection", "OptimizerSection", "RewardSection",
    "RoleSection", "RolloutSection", "SandboxSection", "TaskSection", "TeamSection",
    "TrainConfig", "preset",
]
