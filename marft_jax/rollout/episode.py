"""Episode records: exactly what was sampled, in the form the learner trains on (host NumPy).

A `TokenSequence` is one token sequence the learner will run a forward over: in the per-agent
view one agent turn (its prompt, then its reply); in the shared stream one whole episode
(the task, then every agent's turn, transitions in between). Per token it records:

  tokens              [T] int32
  loss_mask           [T] bool: a token sampled in this sequence (the reply tokens, stop
                      token included); prompt, transition and padding tokens are 0
  agent_ids           [T] int32: the agent that sampled the token, -1 where loss_mask is 0
  adapter_ids         [T] int32: the adapter the token was processed with when sampled (a
                      transition chunk is encoded with the adapter of the agent about to
                      speak): re-scoring with these ids reproduces the sampler's numbers
  behaviour_logprobs  [T] f32: log-prob under the distribution actually sampled from
                      (temperature, top-k, top-p applied), 0 where loss_mask is 0
  temperature         [T] f32: the sampling temperature of each sampled token (1 elsewhere)
  step_ids            [T] int32: the agent step (turn, in execution order within the
                      episode) that sampled the token, -1 elsewhere

plus `spans`, one `ActionSpan` per reply. An `Episode` groups its sequences with the
environment's rewards and done flags per env step, and a transcript of its turns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class ActionSpan:
  """One agent's reply: tokens [start, end) of its sequence."""

  agent: int
  step: int  # agent step within the episode, in execution order
  env_step: int
  start: int
  end: int


@dataclasses.dataclass(frozen=True)
class Turn:
  """One agent turn as a person reads it (for transcripts)."""

  env_step: int
  agent: int
  role: str
  prompt: str  # the text the agent was conditioned on (per-agent view: its whole prompt;
  # shared stream: the transition chunk before its reply)
  reply: str
  num_tokens: int
  stopped: bool  # ended with a stop token (False: it hit its max_new_tokens)
  # Per-agent view: the chat messages `prompt` was rendered from (`context.per_agent_messages`),
  # which another backbone's chat template re-tokenizes (a shared critic's state); () else.
  messages: tuple = ()
  # The role's own view of the problem it was shown instead of the task
  # (`Observation.role_views`); None: it saw the task (`Episode.task`).
  view: Optional[str] = None


@dataclasses.dataclass
class TokenSequence:
  """A growing token sequence (see the module docstring for the fields)."""

  tokens: list = dataclasses.field(default_factory=list)
  loss_mask: list = dataclasses.field(default_factory=list)
  agent_ids: list = dataclasses.field(default_factory=list)
  adapter_ids: list = dataclasses.field(default_factory=list)
  behaviour_logprobs: list = dataclasses.field(default_factory=list)
  temperature: list = dataclasses.field(default_factory=list)
  step_ids: list = dataclasses.field(default_factory=list)
  spans: list = dataclasses.field(default_factory=list)

  def __len__(self) -> int:
    return len(self.tokens)

  def add_context(self, tokens, adapter: int) -> None:
    """Prompt or transition tokens, processed with `adapter`, not trained."""
    n = len(tokens)
    self.tokens += [int(t) for t in tokens]
    self.loss_mask += [False] * n
    self.agent_ids += [-1] * n
    self.adapter_ids += [int(adapter)] * n
    self.behaviour_logprobs += [0.0] * n
    self.temperature += [1.0] * n
    self.step_ids += [-1] * n

  def add_reply(self, tokens, logprobs, agent: int, adapter: int, temperature: float,
                step: int, env_step: int) -> None:
    """Sampled tokens of one agent turn, with their behaviour log-probs."""
    n, start = len(tokens), len(self.tokens)
    self.tokens += [int(t) for t in tokens]
    self.loss_mask += [True] * n
    self.agent_ids += [int(agent)] * n
    self.adapter_ids += [int(adapter)] * n
    self.behaviour_logprobs += [float(x) for x in logprobs]
    self.temperature += [float(temperature)] * n
    self.step_ids += [int(step)] * n
    self.spans.append(ActionSpan(agent, step, env_step, start, start + n))

  def arrays(self) -> dict[str, np.ndarray]:
    """The per-token fields as NumPy arrays ([T] each)."""
    return {"tokens": np.asarray(self.tokens, np.int32),
            "loss_mask": np.asarray(self.loss_mask, bool),
            "agent_ids": np.asarray(self.agent_ids, np.int32),
            "adapter_ids": np.asarray(self.adapter_ids, np.int32),
            "behaviour_logprobs": np.asarray(self.behaviour_logprobs, np.float32),
            "temperature": np.asarray(self.temperature, np.float32),
            "step_ids": np.asarray(self.step_ids, np.int32)}


@dataclasses.dataclass
class Episode:
  """One environment's episode: its sequences, rewards and transcript.

  rewards: [S, N] float: reward of each of the N team agents after each of the S env steps
    (the environment's; credit assignment happens in the trainer).
  dones: [S] bool: the episode ended after env step s.
  dropped: None, or why the episode cannot be trained on ("env_error: ...",
    "context_overflow", "reward_timeout", ...); its records may be partial.
  task, role_views: the first observation's task and {role: its own view} (each turn
    records the view it was shown: `Turn.view`).
  """

  env_index: int
  seed: int
  task: str
  policy_version: int
  sequences: list = dataclasses.field(default_factory=list)
  turns: list = dataclasses.field(default_factory=list)
  rewards: list = dataclasses.field(default_factory=list)  # per env step: [N] floats
  dones: list = dataclasses.field(default_factory=list)
  infos: list = dataclasses.field(default_factory=list)
  dropped: Optional[str] = None
  role_views: dict = dataclasses.field(default_factory=dict)

  @property
  def num_env_steps(self) -> int:
    return len(self.rewards)

  @property
  def episodic_return(self) -> float:
    """The sum over env steps of the team reward (the mean over agents of each step's)."""
    return float(sum(np.mean(r) for r in self.rewards)) if self.rewards else 0.0

  def summary(self) -> dict[str, Any]:
    return {"env_index": self.env_index, "seed": self.seed, "return": self.episodic_return,
            "env_steps": self.num_env_steps, "dropped": self.dropped}
