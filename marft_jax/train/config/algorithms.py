"""The training algorithms, each declared once: what `--config.algorithm=X` trains.

An `Algorithm` says which advantages the trainer computes (`advantage_level`: the arrays of
`ppo.turn_chain_advantages` at one position a turn or one a token, or GRPO's normalised
returns), which policy loss it optimises (one ratio per turn or per token), whether a critic
exists (and so where it is read: at each turn's first decision, or at every decision), what
the rollout must be (team size, context mode, rollouts per task) and its defaults. The keys
it decides are filled in by `config.resolve`.

Adding an algorithm: one `Algorithm` entry below (and, if its advantages or loss are new, the
function behind them in `ppo` and the branch that calls it in `advantages.py` or
`update.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm's choices (see the module docstring)."""

  name: str
  summary: str
  advantage_level: str  # "action", "token" or "grpo" (advantages.compute_advantages)
  policy_level: str  # "action": one PPO ratio per turn; "token": one per token
  critic: bool  # a learned critic; its values are read per turn (action) or per token
  normalize: bool = True  # whiten the advantages over the batch (the default; GRPO: never)
  num_roles: Optional[int] = None  # a fixed team size; None: any (default 2)
  context_mode: Optional[str] = None  # a required context mode; None: any (default per_agent)
  min_group_size: int = 1  # rollouts of each task
  group_size: int = 1  # the default

  @property
  def value_positions(self) -> Optional[str]:
    """Where the critic is read: "turn" (the state before each turn), "token", or None."""
    if not self.critic:
      return None
    return "turn" if self.advantage_level == "action" else "token"


ALGORITHMS = {a.name: a for a in (
    Algorithm("marft_a", "action-level PPO (one ratio per agent turn), action-level critic and "
              "the agent-chain GAE (MARFT §4.1)", advantage_level="action",
              policy_level="action", critic=True),
    Algorithm("marft_t", "token-level PPO with the token/agent/env-step Bellman backup and a "
              "token-level critic (MARFT §4.2)", advantage_level="token", policy_level="token",
              critic=True),
    Algorithm("ppo", "single-agent PPO: a team of one, action level (the baseline)",
              advantage_level="action", policy_level="action", critic=True, num_roles=1),
    Algorithm("grpo", "no critic: G rollouts of each task, returns normalised per task and "
              "agent, token-level clipped loss", advantage_level="grpo", policy_level="token",
              critic=False, normalize=False, min_group_size=2, group_size=4),
    Algorithm("shared_stream_ppo", "the AReaL form: one token stream per episode, token-level "
              "PPO with a centralised token-level critic", advantage_level="token",
              policy_level="token", critic=True, context_mode="shared_stream"),
)}
DEFAULT_NUM_ROLES = 2
DEFAULT_CONTEXT_MODE = "per_agent"


def get(name: str) -> Algorithm:
  if name not in ALGORITHMS:
    raise ValueError(f"algorithm={name!r}: use one of {tuple(ALGORITHMS)}")
  return ALGORITHMS[name]
