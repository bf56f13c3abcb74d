"""Who speaks when, and who sees whom: the dependency structure of one env step (Flex-POMDP D).

Two kinds, both producing a `Schedule` per episode and env step:

* `AgentGraph`: a static DAG over the team's roles, edge (a, b) meaning b sees a's reply.
  A sequential chain (`AgentGraph.chain`) is the default. Roles run in Kahn layers; the roles
  of one layer run in parallel (one batched sampler call) and each sees only its ancestors.
  The trainer bootstraps each turn from the first later turn that sees it (`agent_sees`,
  `ppo.turn_successors`), so its credit follows the same relation as the prompts.
* `Orchestrator`: dynamic routing. An orchestrator agent (its own profile and adapter; its
  routing tokens are trained like any agent's) writes brief reasoning and then
  `<call>role</call>` to hand the turn to a role, or `<done/>` to end the env step; after each
  call the turn comes back to it, up to `max_calls` calls. Output it cannot parse ends the step.

Agents are referred to by index: the team's roles are 0 … N−1 and an orchestrator is N.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from marft_jax.envs.profiles import AgentProfile
from marft_jax.models.sampling import SamplingConfig

_CALL = re.compile(r"<call>\s*([\w-]+)\s*</call>", re.IGNORECASE)
_DONE = re.compile(r"<done\s*/?>", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class AgentGraph:
  """A static DAG over roles; edge (a, b): b runs after a and sees a's reply."""

  roles: tuple[str, ...]
  edges: tuple[tuple[str, str], ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "roles", tuple(self.roles))
    object.__setattr__(self, "edges", tuple(tuple(e) for e in self.edges))
    if not self.roles:
      raise ValueError("graph: no roles")
    repeated = sorted({r for r in self.roles if self.roles.count(r) > 1})
    if repeated:  # the layers would miss them and report a cycle among no roles
      raise ValueError(f"graph: roles {repeated} appear more than once in {list(self.roles)}")
    for a, b in self.edges:
      for end in (a, b):
        if end not in self.roles:
          raise ValueError(f"graph edge ({a!r}, {b!r}): unknown role {end!r}; roles: "
                           f"{list(self.roles)}")
    self.layers()  # raises on a cycle

  @classmethod
  def chain(cls, roles: Sequence[str]) -> "AgentGraph":
    """The sequential chain roles[0] → roles[1] → …: each sees every earlier reply."""
    roles = tuple(roles)
    return cls(roles, tuple(zip(roles[:-1], roles[1:])))

  def layers(self) -> tuple[tuple[str, ...], ...]:
    """Kahn's layers, in `roles` order within a layer; ValueError naming a cycle's roles."""
    indegree = {r: 0 for r in self.roles}
    for _, b in self.edges:
      indegree[b] += 1
    layers, done = [], set()
    while len(done) < len(self.roles):
      layer = tuple(r for r in self.roles if r not in done and indegree[r] == 0)
      if not layer:
        raise ValueError(f"graph has a cycle among {sorted(set(self.roles) - done)}")
      layers.append(layer)
      done.update(layer)
      for a, b in self.edges:
        if a in layer:
          indegree[b] -= 1
    return tuple(layers)

  def ancestors(self, role: str) -> frozenset[str]:
    """Every role whose reply `role` sees (transitively upstream)."""
    parents = {r: {a for a, b in self.edges if b == r} for r in self.roles}
    seen, todo = set(), list(parents[role])
    while todo:
      r = todo.pop()
      if r not in seen:
        seen.add(r)
        todo.extend(parents[r])
    return frozenset(seen)

  def is_sequential(self) -> bool:
    return all(len(layer) == 1 for layer in self.layers())


@dataclasses.dataclass(frozen=True)
class Orchestrator:
  """Dynamic routing by an orchestrator agent (see the module docstring)."""

  profile: AgentProfile
  max_calls: int = 5
  menu: tuple[str, ...] = ()  # the roles it may call; () every role of the team

  def __post_init__(self):
    if not isinstance(self.max_calls, int) or self.max_calls < 1:
      raise ValueError(f"orchestrator max_calls={self.max_calls!r}: use an int >= 1")
    object.__setattr__(self, "menu", tuple(self.menu))


def orchestrator_profile(team: Sequence[AgentProfile], adapter: Optional[int] = None,
                         **sampling) -> AgentProfile:
  """An orchestrator for `team`: its system prompt lists the roles and the routing protocol."""
  menu = "\n".join(f"- {p.role}: {p.description}" for p in team)
  prompt = ("You coordinate a team of agents that solve a task together. The agents are:\n"
            f"{menu}\nEach time it is your turn, think briefly about what the team still needs, "
            "then either hand the turn to one agent by writing <call>name</call>, or, when the "
            "task is solved, write <done/>. You may call agents in any order, and more than "
            "once.")
  sampling = SamplingConfig(**{"max_new_tokens": 64, "temperature": 1.0, **sampling})
  return AgentProfile(role="orchestrator", system_prompt=prompt,
                      description="Decides which agent acts next.", sampling=sampling,
                      adapter=adapter)


def parse_route(text: str, roles: Sequence[str]) -> Optional[str]:
  """"done" for `<done/>`, a role for `<call>role</call>` naming one, else None (unparseable).

  `<done/>` is checked first; the first `<call>` naming a known role (case-insensitive) wins.
  """
  if _DONE.search(text):
    return "done"
  by_name = {r.lower(): r for r in roles}
  for name in _CALL.findall(text):
    if name.lower() in by_name:
      return by_name[name.lower()]
  return None


class Schedule:
  """The turns of one env step of one episode: `next_turn()` gives the agents to run now (in
  parallel), `record(agent, text)` stores a reply; `visible(agent)` says whose replies of this
  env step an agent sees."""

  def __init__(self, structure, team: Sequence[AgentProfile]):
    self._team = tuple(team)
    self._roles = tuple(p.role for p in team)
    self._structure = structure
    self._replies: list[tuple[int, str]] = []  # (agent, text), in order
    if isinstance(structure, Orchestrator):
      self._calls, self._pending, self._over = 0, [len(team)], False
    else:
      self._layers = [[self._roles.index(r) for r in layer] for layer in structure.layers()]

  @property
  def orchestrated(self) -> bool:
    return isinstance(self._structure, Orchestrator)

  def next_turn(self) -> tuple[int, ...]:
    """Agent indices to run now (one batched turn), or () when the env step is over."""
    if not self.orchestrated:
      return tuple(self._layers.pop(0)) if self._layers else ()
    return () if self._over or not self._pending else (self._pending.pop(),)

  def record(self, agent: int, text: str) -> None:
    """Stores `agent`'s reply; for the orchestrator, decides the next turn from it."""
    self._replies.append((agent, text))
    if not self.orchestrated:
      return
    orchestrator = len(self._team)
    if agent != orchestrator:
      self._pending = [orchestrator]
      return
    route = parse_route(text, self._structure.menu or self._roles)
    if route is None or route == "done" or self._calls >= self._structure.max_calls:
      self._over = True
      return
    self._calls += 1
    self._pending = [self._roles.index(route)]

  def visible(self, agent: int) -> list[tuple[int, str]]:
    """This env step's earlier replies that `agent` sees, in order."""
    if self.orchestrated or agent >= len(self._team):
      return list(self._replies)
    seen = self._structure.ancestors(self._roles[agent])
    return [(a, t) for a, t in self._replies if a < len(self._team) and self._roles[a] in seen]

  @property
  def replies(self) -> list[tuple[int, str]]:
    return list(self._replies)

  @property
  def calls(self) -> int:
    return self._calls if self.orchestrated else 0


def acting_profiles(team: Sequence[AgentProfile], structure) -> tuple[AgentProfile, ...]:
  """Every agent that acts, indexed by agent id: the team, then the orchestrator's routing
  profile when `structure` is an `Orchestrator` (a chain or DAG adds none)."""
  return tuple(team) + ((structure.profile,) if isinstance(structure, Orchestrator) else ())


def agent_sees(structure, team: Sequence[AgentProfile]
               ) -> Optional[tuple[tuple[bool, ...], ...]]:
  """Who sees whom within an env step, for the trainer's advantages (`ppo.turn_successors`):
  `sees[a][b]` is True when team agent a's prompt holds agent b's reply of the same env step
  (b runs earlier: one of a's ancestors in the DAG, the replies `Schedule.visible` shows a).
  None for an orchestrator (or no structure), where every turn sees every earlier one."""
  if not isinstance(structure, AgentGraph):
    return None
  roles = [p.role for p in team]
  ancestors = [structure.ancestors(role) for role in roles]
  return tuple(tuple(b in ancestors[a] for b in roles) for a in range(len(roles)))
