"""The team a rollout plays, built from the config: the agents' profiles (prompt, adapter,
sampling) in order and the schedule structure (a chain, an `AgentGraph`, an `Orchestrator`).
"""

from __future__ import annotations

import dataclasses

from marft_jax import envs as envs_lib
from marft_jax.envs.profiles import AgentProfile
from marft_jax.models.sampling import SamplingConfig
from marft_jax.rollout import check_reply_budgets
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.sections import RoleSection, TeamSection
from marft_jax.train.config.teams import adapter_ids, declared


def build_team(config: TrainConfig):
  """(team profiles, schedule structure) from the config's team section (`agents`:
  the declared roles, or the task's shipped team), checked against `rollout.max_context` when
  the config sets it (the model's positions are checked when the rollout knows them)."""
  team, structure = agents(config.team, config.task.name)
  if config.rollout.context_mode == "shared_stream" and \
      isinstance(structure, envs_lib.AgentGraph) and not structure.is_sequential():
    # The rollout would refuse it too, but only after the model has loaded.
    raise ValueError(f"rollout.context_mode='shared_stream' (algorithm={config.algorithm!r}) "
                     f"with team.graph='dag' and team.edges={config.team.edges!r}: parallel "
                     "branches each see only their ancestors, which one stream cannot show; "
                     "use rollout.context_mode='per_agent' (an algorithm that allows it) or "
                     "edges that order every role")
  if config.rollout.context_mode == "shared_stream" and \
      config.task.name in envs_lib.team_tasks.PRIVATE_VIEWS:
    raise ValueError(f"rollout.context_mode='shared_stream' (algorithm={config.algorithm!r}) "
                     f"with task.name={config.task.name!r}: each role sees a view of its own, "
                     "which one stream would show to every later role; use "
                     "rollout.context_mode='per_agent' (an algorithm that allows it)")
  if config.rollout.max_context:
    check_reply_budgets(team, structure, config.rollout.max_context)
  return team, structure


def num_agents(team, structure) -> int:
  """The agents that act in `build_team`'s team, as the rollout numbers them
  (`envs.acting_profiles`): its roles, and the orchestrator when the graph has one (it routes
  with an adapter and a value of its own). A DAG adds no agent."""
  return len(envs_lib.acting_profiles(team, structure))


def agents(team: TeamSection, task: str):
  """(agent profiles in order, schedule structure: None for a chain, an `AgentGraph` for a
  DAG, an `Orchestrator`) from the config's team section."""
  roles, order = declared(team, task)
  try:
    team.check_graph(order)  # a shipped team's roles are known only now
  except ValueError as e:
    raise ValueError(f"team.{e}") from None
  names = list(order)
  if team.anonymous:  # neutral names, no system prompts: the roles' contribution's baseline
    names = [f"agent{i + 1}" for i in range(len(roles))]
    roles = tuple(dataclasses.replace(r, name=n, system_prompt="", description=f"Agent {i + 1}.")
                  for i, (r, n) in enumerate(zip(roles, names)))
  ids, orchestrator, _ = adapter_ids(team, roles)
  profiles = tuple(AgentProfile(role=r.name, system_prompt=r.system_prompt,
                                description=r.description, graded=r.graded, adapter=i,
                                sampling=_sampling(team, r, last=k == len(roles) - 1))
                   for k, (r, i) in enumerate(zip(roles, ids)))
  envs_lib.check_team(profiles)
  if team.graph == "chain":
    return profiles, None
  rename = dict(zip(order, names))
  if team.graph == "dag":
    edges = tuple((rename[a], rename[b]) for a, b in team.edge_pairs)
    return profiles, envs_lib.AgentGraph(tuple(names), edges)
  menu = tuple(rename[m] for m in team.menu_roles) or tuple(names)
  profile = envs_lib.orchestrator_profile(
      [p for p in profiles if p.role in menu], adapter=orchestrator,
      temperature=team.temperature, top_p=team.top_p,
      max_new_tokens=team.orchestrator_max_new_tokens)
  return profiles, envs_lib.Orchestrator(profile, max_calls=team.orchestrator_max_calls,
                                         menu=menu)


def _sampling(team: TeamSection, role: RoleSection, last: bool) -> SamplingConfig:
  default_tokens = team.last_max_new_tokens if last else team.max_new_tokens
  return SamplingConfig(max_new_tokens=role.max_new_tokens or default_tokens,
                        temperature=team.temperature if role.temperature < 0 else role.temperature,
                        top_p=role.top_p or team.top_p)
