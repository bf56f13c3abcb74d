"""Agent profiles: who each agent is, how it samples, which adapter it runs, whether it is graded.

A team is a tuple of profiles; its order is the default speaking order (a sequential chain)
and an agent's index in it is its agent id. Shipped teams, in our own words:

  math_team(2): reasoner → actor                 (the actor's answer is graded)
  math_team(3): reasoner → actor → verifier      (the verifier restates or fixes it; graded)
  math_team(4): analyst → planner → solver → verifier
  code_team(2): planner → coder                  (the coder's program is graded)
  code_team(3): planner → coder → reviewer       (the reviewer returns the final program)
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


# --- shipped teams ---------------------------------------------------------------------------

_BOXED = "Put the final answer, a number, in \\boxed{}."
_MATH_ROLES = {
    # Both short and with a worked form: SmolLM2-135M follows "answer in one line, e.g. ..."
    # but ignores "step by step" requests, rambling past its token cap (untuned reasoner →
    # actor, level-1 arithmetic, greedy: 2 % with "step by step", 12.5 % with these; 32
    # held-out problems; docs/results.md).
    "reasoner": ("You are the Reasoner of a small math team. You are good at arithmetic. "
                 "Answer in one line: the calculation and the result, e.g. 7 + 5 = 12.",
                 "Writes the calculation and its result."),
    # Short on purpose: the actor states the answer, so its turn stays cheap.
    "actor": ("You are the Actor of a small math team. Reply with only the result of the "
              "Reasoner's calculation, in \\boxed{}, e.g. \\boxed{12}.",
              "States the final answer."),
    "verifier": ("You are the Verifier of a small math team. Check the work written before you "
                 "step by step. If it is right, restate the answer; if not, correct it. "
                 f"{_BOXED}", "Checks the answer and gives the corrected final answer."),
    "analyst": ("You are the Analyst of a math team. Restate the problem in your own words and "
                "list every number it gives with what it means. Do not solve it.",
                "Restates the problem and lists its quantities."),
    "planner": ("You are the Planner of a math team. From the analysis before you, write a "
                "short numbered plan of calculations. Do not carry them out.",
                "Writes a numbered plan of calculations."),
    "solver": ("You are the Solver of a math team. Carry out the plan before you step by step. "
               f"{_BOXED}", "Carries out the plan and computes the answer."),
}
_MATH_TEAMS = {2: ("reasoner", "actor"), 3: ("reasoner", "actor", "verifier"),
               4: ("analyst", "planner", "solver", "verifier")}
_FENCE = "Write the whole program in one ```python fenced block; it reads stdin, prints stdout."
_CODE_ROLES = {
    "planner": ("You are the Planner of a programming team. Read the task, note the input and "
                "output formats and the edge cases, and write a step-by-step algorithm. Write "
                "no code.", "Writes an algorithm plan, without code."),
    "coder": (f"You are the Coder of a programming team. Implement the plan before you in "
              f"Python. {_FENCE}", "Implements the plan as a Python program."),
    "reviewer": ("You are the Reviewer of a programming team. Read the program before you, "
                 "look for bugs and missed edge cases, and give the final program, corrected "
                 f"if needed. {_FENCE}", "Reviews the program and gives the final version."),
}
_CODE_TEAMS = {2: ("planner", "coder"), 3: ("planner", "coder", "reviewer")}


def math_team(num_roles: int = 2, max_new_tokens: int = 256,
              temperature: float = 1.0) -> tuple[AgentProfile, ...]:
  """A math team of 2, 3 or 4 roles; the last role is graded."""
  return _team(_MATH_ROLES, _MATH_TEAMS, num_roles, max_new_tokens, temperature, "math")


def code_team(num_roles: int = 2, max_new_tokens: int = 512,
              temperature: float = 1.0) -> tuple[AgentProfile, ...]:
  """A coding team of 2 or 3 roles; the last role's program is graded."""
  return _team(_CODE_ROLES, _CODE_TEAMS, num_roles, max_new_tokens, temperature, "code")


def _team(roles, teams, num_roles, max_new_tokens, temperature, kind):
  if num_roles not in teams:
    raise ValueError(f"num_roles={num_roles}: {kind} teams have {sorted(teams)} roles")
  names = teams[num_roles]
  sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
  return tuple(AgentProfile(role=name, system_prompt=roles[name][0], description=roles[name][1],
                            sampling=sampling, graded=i == len(names) - 1)
               for i, name in enumerate(names))
