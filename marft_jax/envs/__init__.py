"""marft_jax.envs: host-side environments, agent profiles and agent graphs.

  base      Environment (reset(seed) / step(actions)), Observation, Step.
  batch     EnvBatch: E environments with a seeded, reproducible task order.
  profiles  AgentProfile (the shipped teams are config data: marft_jax/train/config/teams.py).
  graph     AgentGraph (chain, DAG) and Orchestrator (dynamic routing); Schedule.
  toy       EchoEnv: repeat the number shown (a task whose best answer is known).
  team_tasks  the generated tasks a team has a reason to solve together: split_facts,
            verify_correct, grid_path (one module each).
"""

from marft_jax.envs.base import Environment, Observation, Step
from marft_jax.envs.batch import EnvBatch
from marft_jax.envs.graph import (AgentGraph, Orchestrator, Schedule, acting_profiles,
                                  agent_sees, orchestrator_profile, parse_route)
from marft_jax.envs.profiles import (AgentProfile, adapter_index, check_team, shared_adapter,
                                     with_sampling)
from marft_jax.envs.toy import EchoEnv
from marft_jax.envs import team_tasks
