"""A heterogeneous team (issue 41): a planner on a small backbone of its own, a solver on
SmolLM2-135M, trained together on generated arithmetic.

Each role runs on the backbone it names (`team.roles.<role>.backbone`; the main one,
`model.source`, by default) with its own adapter and its own critic head; replies pass between
the backbones as text, each prompt tokenized with its own backbone's tokenizer and chat
template. The small backbone here is "tiny", the random tiny test model (no file): a stand-in
that shows the mechanics. Point it at a real small model, a .gguf file or a Hugging Face
folder: --config.model.backbones.small.source=/path/to/model.
"""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import (BackboneSection, CriticSection, ModelSection, RoleSection,
                                    TeamSection, TrainConfig)


def get_config():
  roles = (
      RoleSection("planner", "You are the Planner of a small math team. Write the calculation "
                  "that solves the problem, e.g. 7 + 5. Do not compute it.",
                  "Writes the calculation to do.", backbone="small"),
      RoleSection("solver", "You are the Solver of a small math team. Carry out the "
                  "calculation before you and give the result in \\boxed{}, e.g. \\boxed{12}.",
                  "Computes the answer.", graded=True),
  )
  team = TeamSection(roles=roles, order="planner,solver", max_new_tokens=24)
  model = ModelSection(backbones=(BackboneSection("small", source="tiny"),))
  # A critic per role, each on its role's backbone (critic.mode='shared' puts one critic on
  # critic.backbone, reading every role's turns re-tokenized in its own vocabulary).
  critic = CriticSection(mode="per_agent_head")
  return to_config_dict(TrainConfig(algorithm="marft_a", model=model, team=team, critic=critic))
