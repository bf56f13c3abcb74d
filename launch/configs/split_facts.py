"""MARFT-A, reporter → answerer on split information (envs/split_facts.py): the reporter sees the
facts, the answerer the question asked of them, so the graded answer needs both.
The untuned SmolLM2-135M team's held-out accuracy: docs/team_tasks.md."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_a", task=TaskSection(name="split_facts"),
                                    team=TeamSection(**teams.shipped("split_facts", 2))))
