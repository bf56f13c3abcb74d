"""What each agent is conditioned on: the two context modes, built with the chat template.

Per-agent view (the original MARFT): every turn is a fresh prompt of its own::

    system: <the agent's own system prompt>
    user:   <task>                     # or the agent's own view (Observation.role_views)
            Reasoner: <reply>          # earlier env steps: every reply, then the feedback
            Feedback: <env message>
            Reasoner: <reply>          # this env step: the replies the agent sees (its
                                       # ancestors in the graph; everything for a chain)
    assistant: <the agent writes here>

Shared stream (the AReaL-based MARFT, fixed): one token sequence extended turn by turn. Each
turn is a transition user message naming the agent and carrying its own system prompt (the
AReaL code never puts the later roles' prompts in the stream), then the agent's reply::

    system: <team preamble>   user: <task>\\n\\nIt is now the Reasoner's turn. <its prompt>
    assistant: <reply> <eos>  user: It is now the Actor's turn. <its prompt>
    assistant: <reply> <eos>  user: Feedback: ...\\n\\nIt is now the Reasoner's turn. ...

Generated tokens are never re-tokenised: the next transition is tokenised on its own and
appended, so the stream holds exactly the sampled tokens and agent k+1 continues agent k's
KV cache. Transitions are found by diffing the chat template (a rendered conversation with a
placeholder reply against the same plus the next user turn), so any chat template works.
Every later token attends to every earlier one, so a stream cannot keep a role's own view
(`Observation.role_views`) from the roles after it: the rollout refuses views there.
"""

from __future__ import annotations

from typing import Sequence

from marft_jax.envs.base import Observation
from marft_jax.envs.profiles import AgentProfile

TEAM_PREAMBLE = ("You are one of several agents solving a task together. The conversation "
                 "shows the task, then each agent's turn; every turn starts with that agent's "
                 "instructions.")
# The shared stream's hand-over to the next agent ({role}: its display name); a team's config
# may word it otherwise (`team.transition`).
TRANSITION = "It is now the {role}'s turn."
_PLACEHOLDER = "\u2063REPLY\u2063"  # invisible separators: never in a real reply


def display_name(role: str) -> str:
  return role.replace("_", " ").replace("-", " ").title()


def _history_lines(team: Sequence[AgentProfile], turns: Sequence[tuple[int, str]]) -> list[str]:
  return [f"{display_name(_role(team, agent))}: {text.strip()}" for agent, text in turns]


def _role(team: Sequence[AgentProfile], agent: int) -> str:
  return team[agent].role if agent < len(team) else "orchestrator"


def per_agent_prompt(tokenizer, profile: AgentProfile, team: Sequence[AgentProfile],
                     observation: Observation, earlier_steps: Sequence[Sequence[tuple[int, str]]],
                     visible: Sequence[tuple[int, str]]) -> list[int]:
  """Token ids of one agent's prompt in the per-agent view (see the module docstring):
  `per_agent_messages` through `chat_prompt`."""
  return chat_prompt(tokenizer, per_agent_messages(profile, team, observation, earlier_steps,
                                                   visible))


def per_agent_messages(profile: AgentProfile, team: Sequence[AgentProfile],
                       observation: Observation,
                       earlier_steps: Sequence[Sequence[tuple[int, str]]],
                       visible: Sequence[tuple[int, str]]) -> tuple[dict, ...]:
  """The chat messages of one agent's prompt in the per-agent view: its text, before any
  tokenizer (a turn keeps them, so another backbone can re-tokenize its state).

  Args:
    earlier_steps: per earlier env step, its replies [(agent, text)]; observation.feedback
      holds the environment's message after each of them.
    visible: this env step's earlier replies the agent sees.

  The agent is shown its own view of the problem where the observation gives it one
  (`Observation.view`), else the task; no other role's view is in its prompt.
  """
  parts = [observation.view(profile.role).strip()]
  for step, replies in enumerate(earlier_steps):
    parts += _history_lines(team, replies)
    if step < len(observation.feedback):
      parts.append(f"Feedback: {observation.feedback[step].strip()}")
  parts += _history_lines(team, visible)
  return ({"role": "system", "content": profile.system_prompt},
          {"role": "user", "content": "\n\n".join(parts)})


def chat_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
  """Token ids of `messages` in `tokenizer`'s chat template, ready for the assistant's reply."""
  text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                       tokenize=False)
  return tokenizer(text, add_special_tokens=False)["input_ids"]


def transition_text(profile: AgentProfile, feedback: str = "",
                    wording: str = TRANSITION) -> str:
  """The user message that hands the shared stream to `profile`'s agent: `wording` with
  {role} filled in, then the agent's own system prompt."""
  turn = f"{wording.format(role=display_name(profile.role))} {profile.system_prompt}".strip()
  return f"Feedback: {feedback.strip()}\n\n{turn}" if feedback else turn


def stream_start(tokenizer, task: str, profile: AgentProfile,
                 wording: str = TRANSITION) -> list[int]:
  """Token ids opening a shared stream: preamble, task, and the first agent's transition."""
  first = transition_text(profile, wording=wording)
  messages = [{"role": "system", "content": TEAM_PREAMBLE},
              {"role": "user", "content": f"{task.strip()}\n\n{first}"}]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream_transition(tokenizer, profile: AgentProfile, stopped: bool,
                      feedback: str = "", wording: str = TRANSITION) -> list[int]:
  """Token ids to append after a reply to hand the stream to `profile`'s agent.

  `stopped`: the reply ended with the tokenizer's EOS (the template's end-of-turn) token; if
  not (it hit its length limit), the end of turn is added here and not trained.
  """
  closed = [{"role": "system", "content": TEAM_PREAMBLE}, {"role": "user", "content": "task"},
            {"role": "assistant", "content": _PLACEHOLDER}]
  before = tokenizer.apply_chat_template(closed, tokenize=False)
  after = tokenizer.apply_chat_template(
      closed + [{"role": "user", "content": transition_text(profile, feedback, wording)}],
      add_generation_prompt=True, tokenize=False)
  if not after.startswith(before):
    raise ValueError("the tokenizer's chat template does not extend a conversation by "
                     "appending to it; the shared stream needs one that does")
  end_of_reply = before[before.index(_PLACEHOLDER) + len(_PLACEHOLDER):]
  eos = tokenizer.eos_token or ""
  if stopped and eos and end_of_reply.startswith(eos):
    end_of_reply = end_of_reply[len(eos):]  # the reply's own stop token closed the turn
  return tokenizer(end_of_reply + after[len(before):], add_special_tokens=False)["input_ids"]
