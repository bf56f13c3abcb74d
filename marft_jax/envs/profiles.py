"""Agent profiles: who each agent is, how it samples, which adapter it runs, whether it is graded.

A team is a tuple of profiles; its order is the default speaking order (a sequential chain)
and an agent's index in it is its agent id. The shipped teams are config data
(`marft_jax/train/config/teams.py`), turned into profiles by `build.team.agents`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from marft_jax.models.sampling import SamplingConfig

NO_ADAPTER = -1


@dataclasses.dataclass(frozen=True)
class AgentProfile:
  """One agent of a team.

  role: its name (unique in the team), e.g. "reasoner"; shown to the other agents.
  system_prompt: its instructions.
  description: one line saying what it does (transition turns, the orchestrator's menu).
  sampling: its generation settings (temperature, top-p, top-k, max new tokens).
  adapter: the LoRA adapter it runs (an index into the stacked adapters; -1 = the base
    model); None = its own index in the team (one adapter per agent).
  graded: its reply is what the environment scores.
  """

  role: str
  system_prompt: str
  description: str
  sampling: SamplingConfig = SamplingConfig(max_new_tokens=256, temperature=1.0)
  adapter: Optional[int] = None
  graded: bool = False

  def __post_init__(self):
    if not self.role or not self.role.replace("_", "").replace("-", "").isalnum():
      raise ValueError(f"role={self.role!r}: use letters, digits, '-' or '_'")
    if self.adapter is not None and (isinstance(self.adapter, bool) or
                                     not isinstance(self.adapter, int) or self.adapter < -1):
      raise ValueError(f"{self.role}: adapter={self.adapter!r}: use an adapter index, -1 (the "
                       "base model) or None (one adapter per agent)")


def check_team(team: Sequence[AgentProfile], num_adapters: Optional[int] = None) -> None:
  """Refuses an empty team, repeated roles, no graded role, or an adapter index out of range."""
  if not team:
    raise ValueError("a team needs at least one agent profile")
  roles = [p.role for p in team]
  if len(set(roles)) != len(roles):
    raise ValueError(f"roles must be unique, got {roles}")
  if not any(p.graded for p in team):
    raise ValueError(f"no role of {roles} is graded: mark the one(s) whose answer counts")
  if num_adapters is not None:
    for i, p in enumerate(team):
      adapter = adapter_index(team, i)
      if not -1 <= adapter < num_adapters:
        raise ValueError(f"{p.role}: adapter {adapter} out of range for {num_adapters} adapters")


def adapter_index(team: Sequence[AgentProfile], agent: int) -> int:
  """The adapter agent `agent` runs: its profile's, or its own index by default."""
  adapter = team[agent].adapter
  return agent if adapter is None else adapter


def shared_adapter(team: Sequence[AgentProfile]) -> tuple[AgentProfile, ...]:
  """The team with every agent on adapter 0 (one adapter shared by all roles)."""
  return tuple(dataclasses.replace(p, adapter=0) for p in team)


def with_sampling(team: Sequence[AgentProfile], **changes) -> tuple[AgentProfile, ...]:
  """The team with the same sampling changes for every agent (e.g. temperature=0 for eval)."""
  return tuple(dataclasses.replace(p, sampling=dataclasses.replace(p.sampling, **changes))
               for p in team)
