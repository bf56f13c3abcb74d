"""The environment API: host-side Python that agents act in, one env step at a time.

An environment holds one task at a time. `reset(seed)` picks a task (deterministically from
the seed) and returns what the agents see; `step(actions)` takes every agent's text reply for
this env step and returns the next observation, a reward per agent, whether the episode is
over, and an info dict. Writing a new environment is one small class::

    class EchoNumber(Environment):
      '''The team must repeat the number shown; the graded role's reply is checked.'''

      def __init__(self, graded=("actor",)):
        self.graded = tuple(graded)

      def reset(self, seed):
        self.number = int(np.random.default_rng(seed).integers(100))
        return Observation(task=f"Repeat this number: {self.number}")

      def step(self, actions):
        score = float(np.mean([actions[r].strip() == str(self.number) for r in self.graded]))
        return Step(observation=None, rewards={r: score for r in actions}, done=True)

Rewards are the team's: every role receives the same score unless an environment documents
otherwise (credit across agents is the trainer's job, `marft_jax.ppo.credit`). `info` may hold
anything a person wants in the transcript or the metrics; numbers under `info["metrics"]` are
averaged into the training metrics.

An environment whose agents see different things gives each role its own view beside the
shared task: `Observation(task="Answer the question together.", role_views={"reporter":
"Box A holds 7 marbles.", "answerer": "How many marbles are in box A?"})` (`split_facts.py`).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Optional


@dataclasses.dataclass(frozen=True)
class Observation:
  """What the agents are shown at the start of an env step.

  task: the problem statement, the same for the whole episode: what every role without a
    view of its own is shown.
  feedback: the environment's messages after each earlier env step of this episode (e.g.
    "The answer is incorrect." in a multi-turn math episode), oldest first.
  role_views: {role: text} shown to that role instead of `task`, and to no other role's
    prompt (the Flex-POMDP's per-agent observation: each agent sees its part of the
    problem). A role missing from it sees `task`. The others read a role's view only as far
    as its replies repeat it. Only the per-agent view can keep a view to its role (one shared
    stream shows every earlier token to the later roles: the rollout refuses it there).
  """

  task: str
  feedback: tuple[str, ...] = ()
  role_views: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)

  def __post_init__(self):
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.role_views.items()):
      raise ValueError(f"role_views={dict(self.role_views)!r}: a mapping of role name to text")

  def view(self, role: str) -> str:
    """What `role` is shown of the problem: its own view, else `task`."""
    return self.role_views.get(role, self.task)


@dataclasses.dataclass(frozen=True)
class Step:
  """What `Environment.step` returns.

  observation: the next env step's observation (None once `done`).
  rewards: {role: reward} for every role that acted.
  done: the episode is over (no further env step).
  info: free-form details for transcripts and metrics (see the module docstring).
  """

  observation: Optional[Observation]
  rewards: Mapping[str, float]
  done: bool
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
  """A task the agents act in. Implementations are plain Python and may be slow or fail: the
  rollout counts an exception as a dropped episode and goes on."""

  @abc.abstractmethod
  def reset(self, seed: int) -> Observation:
    """Starts an episode on the task `seed` selects (the same seed, the same task)."""

  @abc.abstractmethod
  def step(self, actions: Mapping[str, str]) -> Step:
    """Takes {role: reply text} for this env step."""

  @property
  def step_concurrency(self) -> int:
    """How many environments of its kind may run `step` at once from several threads (they
    share a grader or sandbox that bounds them): 1, one at a time, unless a subclass that is
    thread-safe says more (`code_env.CodeEnv`: its sandbox's programs ÷ one step's)."""
    return 1

  def close(self) -> None:
    """Frees worker processes or files; the default has none."""
