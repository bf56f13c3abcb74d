"""End to end, from the transcript: each trained turn hops to the earliest later turn of its
env step whose prompt contains its reply, and a turn whose reply no later turn of its step
shows hops to the next env step's first turn (or ends the episode).

For every DAG config shipped in launch/configs and a seeded sample of DAGs (a fork without a
join, several roots, several sinks among them), a rollout with a scripted sampler (each reply
is unique: "reply <i>.") writes the prompts; the trainer (`make_batch` → `compute_advantages`
with the graph's `envs.agent_sees`, as `loop.train` calls it) then reveals the successor it
bootstraps each turn from: with γ = 1, λ = 0, zero rewards and distinct values, a turn's value
target is its successor's value. The rule is read off the transcript alone (which prompt
holds which reply), not from the graph.
"""

import glob
import os

import jax
import numpy as np
import pytest

from launch.cli import CONFIG_DIR, _load_config_file
from marft_jax import envs, ppo, rollout as rollout_lib
from marft_jax.configs import from_config_dict
from marft_jax.models import sampler, tiny
from marft_jax.models.config import tiny_config
from marft_jax.models.sampling import SamplingConfig
from marft_jax.train import advantages as advantages_lib, algorithms
from marft_jax.train.build import team as team_lib
from marft_jax.train.advantages import AdvantageConfig, compute_advantages
from marft_jax.train.batching import make_batch
from marft_jax.train.config import TrainConfig
from tests.train.test_dag_credit import ROLES, _layer_successors, random_dag, shape_of

HORIZON = 2
PROBE = AdvantageConfig(level="action", gamma=1.0, lambda_=0.0, gamma_agent=1.0,
                        lambda_agent=0.0, credit="per_step", normalize=False)


class QuietEnv(envs.Environment):
  """Every role's reward 0; `HORIZON` env steps."""

  def reset(self, seed):
    self.steps = 0
    return envs.Observation(task="Say something.")

  def step(self, actions):
    self.steps += 1
    done = self.steps >= HORIZON
    return envs.Step(observation=None if done else envs.Observation(task="Say more."),
                     rewards={role: 0.0 for role in actions}, done=done, info={})


class UniqueReplies:
  """`sampler.generate`'s stand-in: row after row, "reply 0.", "reply 1.", …"""

  def __init__(self, tokenizer):
    self.tokenizer, self.count = tokenizer, 0

  def __call__(self, params, tokens, config, *, max_new_tokens, prompt_lens=None, eos_ids=None,
               pad_id=0, **unused):
    lens = np.asarray(prompt_lens)
    budget = np.broadcast_to(np.asarray(max_new_tokens), lens.shape)
    out = np.full((len(lens), int(budget.max())), pad_id, np.int32)
    lengths = np.zeros(len(lens), np.int32)
    for r in np.flatnonzero((budget > 0) & (lens > 0)):
      ids = self.tokenizer(f"reply {self.count}.", add_special_tokens=False)["input_ids"]
      ids = ids + [int(np.ravel(eos_ids)[0])]
      assert len(ids) <= budget[r]
      out[r, :len(ids)], lengths[r] = ids, len(ids)
      self.count += 1
    mask = np.arange(out.shape[1])[None] < lengths[:, None]
    return sampler.SampleOutput(tokens=out, logprobs=np.where(mask, -1.0, 0.0), mask=mask,
                                lengths=lengths, cache=None)


@pytest.fixture(scope="module")
def tokenizer():
  return tiny.tiny_tokenizer()


def _shipped_dags():
  out = []
  for path in sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py"))):
    with open(path) as f:
      if "dag" not in f.read():
        continue
    config = algorithms.resolve(from_config_dict(TrainConfig, _load_config_file(path)))
    if config.team.graph == "dag":
      out.append((os.path.basename(path), *team_lib.build_team(config)))
  return out


def _sampled_dags():
  rng = np.random.default_rng(41)
  graphs = [(4, ((0, 1), (0, 2), (1, 3)))]  # a fork without a join
  graphs += [(m, random_dag(rng, m)) for m in (3, 4, 5, 5, 4, 5, 3, 5)]
  out = []
  for m, edges in graphs:
    team = tuple(envs.AgentProfile(ROLES[r], f"You are {ROLES[r]}.", ROLES[r],
                                   SamplingConfig(max_new_tokens=16), graded=r == m - 1)
                 for r in range(m))
    graph = envs.AgentGraph(tuple(ROLES[:m]), tuple((ROLES[a], ROLES[b]) for a, b in edges))
    out.append((f"{m} roles {edges}", team, graph, shape_of(m, edges)))
  return out


def trainer_successors(episodes, team, graph):
  """Per episode, per turn (in `episode.turns` order): the index of the turn the trainer's
  backup hops to, None where it ends, read off the value targets."""
  batch = make_batch(episodes, pad_id=0)
  values = np.zeros(batch.tokens.shape, np.float32)
  rows = [(e, i) for e, episode in enumerate(episodes) for i in range(len(episode.sequences))]
  for row, (e, i) in enumerate(rows):
    values[row, int(batch.turn_value_pos[row, 0])] = 1000 * (e + 1) + i + 1
  out = compute_advantages(batch.replace(act_old_value=values), episodes, PROBE, len(team),
                           agent_sees=envs.agent_sees(graph, team))
  found = [[None] * len(episode.turns) for episode in episodes]
  for row, (e, i) in enumerate(rows):
    target = int(round(float(out.turn_return[row, 0])))
    assert target == 0 or target // 1000 == e + 1, target  # never another episode's turn
    found[e][i] = target % 1000 - 1 if target else None
  return found


def transcript_successors(episode):
  """The rule, from what each prompt shows: the earliest later turn of the step whose prompt
  holds the reply; else the next env step's first turn; else None."""
  turns = episode.turns
  out = []
  for i, turn in enumerate(turns):
    later = list(range(i + 1, len(turns)))
    seen_by = [j for j in later if turns[j].env_step == turn.env_step and
               turn.reply.strip() in turns[j].prompt]
    next_step = [j for j in later if turns[j].env_step != turn.env_step]
    out.append(seen_by[0] if seen_by else next_step[0] if next_step else None)
  return out


def _check(team, graph, tokenizer, monkeypatch):
  script = UniqueReplies(tokenizer)
  monkeypatch.setattr(sampler, "generate", script)
  model_config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
  result = rollout_lib.rollout(envs.EnvBatch(lambda i: QuietEnv(), 2, seed=0), team, graph,
                               None, model_config, tokenizer, jax.random.key(0),
                               config=rollout_lib.RolloutConfig(horizon=HORIZON))
  episodes = result.episodes
  assert all(e.dropped is None and len(e.turns) == HORIZON * len(team) for e in episodes)
  replies = [t.reply.strip() for e in episodes for t in e.turns]
  assert len(set(replies)) == len(replies) and all(r.startswith("reply ") for r in replies)
  for episode, got in zip(episodes, trainer_successors(episodes, team, graph)):
    want = transcript_successors(episode)
    assert got == want, [(t.role, t.env_step) for t in episode.turns]
    for turn, successor in zip(episode.turns, got):  # the wording of the property
      if successor is not None and episode.turns[successor].env_step == turn.env_step:
        assert turn.reply.strip() in episode.turns[successor].prompt


SHIPPED = _shipped_dags()


@pytest.mark.parametrize("name", [name for name, _, _ in SHIPPED])
def test_shipped_dags_hop_to_what_saw_the_reply(name, tokenizer, monkeypatch):
  _, team, graph = next(dag for dag in SHIPPED if dag[0] == name)
  _check(team, graph, tokenizer, monkeypatch)


def test_sampled_dags_hop_to_what_saw_the_reply(tokenizer, monkeypatch):
  dags = _sampled_dags()
  for i, name in enumerate(("a fork without a join", "several roots", "several sinks")):
    assert any(shape[i] for *_, shape in dags), name
  for name, team, graph, _ in dags:
    _check(team, graph, tokenizer, monkeypatch)


def test_the_rule_by_layers_is_caught(tokenizer, monkeypatch):
  """Mutant: successors by layers (the next layer's first turn, `_layer_successors`): the
  fork without a join's unseen branch then hops to a turn whose prompt lacks its reply."""
  name, team, graph, _ = _sampled_dags()[0]
  monkeypatch.setattr(ppo.chains, "turn_successors", _layer_successors)
  advantages_lib._vmapped_chains.clear_cache()  # traced with the real rule
  try:
    with pytest.raises(AssertionError):
      _check(team, graph, tokenizer, monkeypatch)
  finally:
    monkeypatch.undo()
    advantages_lib._vmapped_chains.clear_cache()
