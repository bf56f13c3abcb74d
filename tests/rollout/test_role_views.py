"""Each role's prompt shows its own view of the problem (`Observation.role_views`), and no
other role's; a role without one sees the task. Cases: every graph (chain, DAG, orchestrator)
× which roles have a view, over two env steps whose views differ, through the per-agent
view's rollout with the tiny model; the shared stream refuses views; the shared critic's
rows (its own backbone's and a re-tokenized one's) hold what the turn's role saw.
"""

import jax
import numpy as np
import pytest

from marft_jax import envs, rollout as rollout_lib
from marft_jax.models import layout, tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.sampling import SamplingConfig
from marft_jax.rollout import context, runner
from marft_jax.train import shared_critic

ROLES = ("a", "b", "c")
E = 2  # environments
STEPS = 2  # env steps per episode


def _view(role, seed, step):
  return f"VIEW-{role}-{seed}-{step}"


def _task(seed, step):
  return f"TASK-{seed}-{step}"


class _ViewsEnv(envs.Environment):
  """Two env steps; at each, `viewers` get a view of their own (marked with the role, the
  seed and the step), every other role the task."""

  def __init__(self, viewers):
    self.viewers = tuple(viewers)

  def _observation(self):
    return envs.Observation(
        task=_task(self.seed, self.t), feedback=("again",) * self.t,
        role_views={r: _view(r, self.seed, self.t) for r in self.viewers})

  def reset(self, seed):
    self.seed, self.t = seed, 0
    return self._observation()

  def step(self, actions):
    self.t += 1
    done = self.t >= STEPS
    return envs.Step(observation=None if done else self._observation(),
                     rewards={r: 0.0 for r in actions}, done=done)


@pytest.fixture(scope="module")
def model():
  tokenizer = tiny.tiny_tokenizer()
  base = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
  params = transformer.init_params(base, jax.random.key(0), std=0.1)
  config = base.replace(layout=layout.DECODING)
  return dict(tokenizer=tokenizer, config=config,
              fast=layout.convert_params(params, base.layout, config.layout))


def _team():
  sampling = SamplingConfig(max_new_tokens=4, temperature=1.0)
  return tuple(envs.AgentProfile(r, f"You are {r}.", f"Role {r}.", sampling, graded=r == "c")
               for r in ROLES)


_ROUTE = ("<call>a</call>", "<call>b</call>", "<call>c</call>", "<done/>")


def _structure(graph, team, monkeypatch):
  if graph == "chain":
    return None
  if graph == "dag":  # a and b in parallel (each sees only the task or its view), c joins
    return envs.AgentGraph(ROLES, (("a", "c"), ("b", "c")))
  # A random tiny model rarely writes a valid route: the orchestrator's text is scripted
  # (a, b, c, then done) where the schedule reads it; its sampled reply stays in its turn.
  record, calls = runner._Runner._record_turn, {}

  def scripted(self, i, agent, *args, **kwargs):
    text = record(self, i, agent, *args, **kwargs)
    if self.agents.profiles[agent].role != "orchestrator":
      return text
    step = self.episodes[i].turns[-1].env_step
    key = (id(self), i, step)  # per rollout, env and env step
    n = calls[key] = calls.get(key, -1) + 1
    return _ROUTE[n]

  monkeypatch.setattr(runner._Runner, "_record_turn", scripted)
  return envs.Orchestrator(envs.orchestrator_profile(team, max_new_tokens=4), max_calls=3)


def _play(model, viewers, structure, context_mode="per_agent"):
  batch = envs.EnvBatch(lambda i: _ViewsEnv(viewers), E, seed=0)
  return rollout_lib.rollout(batch, _team(), structure, model["fast"], model["config"],
                             model["tokenizer"], jax.random.key(1),
                             config=rollout_lib.RolloutConfig(context_mode=context_mode,
                                                              horizon=STEPS))


def _without_replies(text, episode):
  """`text` less every reply of the episode (a reply may quote anything it was shown)."""
  for turn in episode.turns:
    if turn.reply.strip():
      text = text.replace(turn.reply.strip(), "")
  return text


def _check_turn(turn, episode, viewers, shown):
  """The turn's `shown` text holds its own view (or the task) and no other role's view."""
  own = (_view(turn.role, episode.seed, turn.env_step) if turn.role in viewers
         else _task(episode.seed, turn.env_step))
  assert own in shown, (turn.role, own, shown)
  assert turn.view == (own if turn.role in viewers else None)
  rest = _without_replies(shown, episode)
  for other in viewers:
    if other != turn.role:
      for step in range(STEPS):
        assert _view(other, episode.seed, step) not in rest, (turn.role, other, shown)
  if turn.role in viewers:  # its view replaces the task
    assert _task(episode.seed, turn.env_step) not in rest


VIEWERS = {"every role": ROLES, "the first": ("a",), "the last": ("c",), "a and c": ("a", "c"),
           "none": ()}


@pytest.mark.parametrize("graph", ["chain", "dag", "orchestrator"])
@pytest.mark.parametrize("viewers", sorted(VIEWERS))
def test_each_role_sees_its_own_view_and_no_other(model, graph, viewers, monkeypatch):
  viewers = VIEWERS[viewers]
  team = _team()
  result = _play(model, viewers, _structure(graph, team, monkeypatch))
  for episode in result.episodes:
    assert episode.dropped is None
    assert episode.role_views == {r: _view(r, episode.seed, 0) for r in viewers}
    roles = [t.role for t in episode.turns]
    assert set(ROLES) <= set(roles) and {t.env_step for t in episode.turns} == {0, 1}
    for turn, sequence in zip(episode.turns, episode.sequences):
      _check_turn(turn, episode, viewers, turn.prompt)
      _check_turn(turn, episode, viewers, turn.messages[1]["content"])
      prompt_ids = sequence.tokens[:sequence.spans[0].start]  # what the policy conditioned on
      _check_turn(turn, episode, viewers, model["tokenizer"].decode(prompt_ids))


@pytest.mark.parametrize("graph", ["chain", "orchestrator"])
def test_the_shared_stream_refuses_views(model, graph, monkeypatch):
  structure = _structure(graph, _team(), monkeypatch)
  with pytest.raises(ValueError, match="shared_stream.*views of their own.*per_agent"):
    _play(model, ("b",), structure, context_mode="shared_stream")
  result = _play(model, (), structure, context_mode="shared_stream")  # no views: it plays
  assert all(e.role_views == {} and len(e.turns) >= len(ROLES) for e in result.episodes)


def test_the_shared_critic_reads_what_each_role_saw(model):
  """The shared critic's row of a turn: its own backbone's is the turn's sequence (checked
  above); another backbone's is the turn's messages re-tokenized (`critic_row`), which hold
  the role's own view and no other role's."""
  viewers = ("a", "c")
  result = _play(model, viewers, None)
  tokenizer = model["tokenizer"]
  for episode in result.episodes:
    for turn, sequence in zip(episode.turns, episode.sequences):
      span = sequence.spans[0]
      reply_ids = np.asarray(sequence.tokens[span.start:span.end], np.int32)
      tokens, positions, _ = shared_critic.critic_row(turn, reply_ids, tokenizer, tokenizer)
      prompt = tokenizer.decode(tokens[:int(positions[0]) + 1])
      _check_turn(turn, episode, viewers, prompt)


def test_context_falls_back_to_the_task():
  team = _team()
  observation = envs.Observation("the task", role_views={"a": "a's part"})
  messages = {p.role: context.per_agent_messages(p, team, observation, (), ())[1]["content"]
              for p in team}
  assert messages == {"a": "a's part", "b": "the task", "c": "the task"}
  assert observation.view("b") == "the task" and observation.view("a") == "a's part"
  with pytest.raises(ValueError, match="role_views"):
    envs.Observation("t", role_views={"a": 3})
