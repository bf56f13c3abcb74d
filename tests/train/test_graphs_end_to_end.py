"""Every graph end to end: chain, DAG (a fork: two parallel branches after the planner and no
join, so each branch ends its env step) and orchestrator, with horizon 1 and 2, one rollout
plus one update of the trainer on the tiny model.

A scripted sampler stands in for `sampler.generate`: it reads who is speaking from the prompt
and writes that role's scripted reply, so the orchestrator really calls its specialists,
repeatedly and out of menu order, and then writes an unparseable route (which ends the env
step, as `envs.graph` documents). The environment rewards each role 1 for a reply containing
"good". Checked: what each turn saw (its prompt), what each agent is trained on (its row's
trained tokens are its reply), where each reward lands (the value targets are the Monte Carlo
returns along the successors read off the transcript, with γ = λ = 1 and per_step credit: a
turn hops to the earliest later turn of its env step whose prompt holds its reply, else to
the next env step), and which adapter each token was sampled with.
"""


import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import envs
from marft_jax.models import sampler, tiny
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train import loop
from marft_jax.train.advantages import AdvantageConfig
from marft_jax.train.config import (OptimizerSection, RoleSection, RolloutSection, TaskSection,
                                     TeamSection)
from tests.train.echo_config import echo_config

ROLES = ("planner", "coder", "tester")  # tester graded
# Every role rewarded: a branch that hopped to its sibling would collect the sibling's reward.
REPLIES = {"planner": "good plan", "coder": "good code", "tester": "good test"}
# The orchestrator's routes, in order: out of menu order, one role twice, then no route.
ROUTES = ("<call>tester</call>", "<call>planner</call>", "<call>tester</call>", "hmm")


class GoodWordEnv(envs.Environment):
  """Each role's reward is 1 if its reply says "good"; `horizon` env steps, then done."""

  def __init__(self, horizon):
    self.horizon = horizon

  def reset(self, seed):
    self.step_index, self.feedback = 0, ()
    return envs.Observation(task="Write something good.")

  def step(self, actions):
    self.step_index += 1
    rewards = {role: float("good" in text) for role, text in actions.items()}
    self.feedback += (f"feedback {self.step_index}",)
    done = self.step_index >= self.horizon
    return envs.Step(observation=None if done else envs.Observation(
        task="Write something good.", feedback=self.feedback), rewards=rewards, done=done,
        info={"metrics": {"accuracy": rewards.get("tester", 0.0)}})


class ScriptedSampler:
  """`sampler.generate`'s stand-in: each row's reply is its speaker's script."""

  def __init__(self, tokenizer, team):
    self.tokenizer, self.team = tokenizer, team
    self.calls = []  # (prompt text, adapter id, reply text) per sampled row

  def speaker(self, prompt):
    for p in self.team:
      if p.system_prompt and p.system_prompt in prompt:
        return p.role
    return "orchestrator"

  def __call__(self, params, tokens, config, *, max_new_tokens, prompt_lens=None,
               adapter_ids=None, eos_ids=None, pad_id=0, **unused):
    tokens, lens = np.asarray(tokens), np.asarray(prompt_lens)
    rows = tokens.shape[0]
    budget = np.broadcast_to(np.asarray(max_new_tokens), (rows,))
    out = np.full((rows, int(budget.max())), pad_id, np.int32)
    lengths = np.zeros((rows,), np.int32)
    for r in range(rows):
      if budget[r] == 0 or lens[r] == 0:
        continue
      prompt = self.tokenizer.decode(tokens[r, :lens[r]])
      role = self.speaker(prompt)
      if role == "orchestrator":  # its n-th turn of the step has n routes of it in view
        this_step = prompt.rsplit("feedback", 1)[-1]
        text = ROUTES[min(this_step.count("Orchestrator:"), len(ROUTES) - 1)]
      else:
        text = REPLIES[role]
      ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:int(budget[r]) - 1]
      ids = ids + [int(np.ravel(eos_ids)[0])]
      assert len(ids) <= budget[r] and self.tokenizer.decode(ids[:-1]) == text, text
      out[r, :len(ids)], lengths[r] = ids, len(ids)
      self.calls.append((prompt, None if adapter_ids is None else int(adapter_ids[r]), text))
    mask = np.arange(out.shape[1])[None] < lengths[:, None]
    return sampler.SampleOutput(tokens=jnp.asarray(out), logprobs=jnp.where(mask, -1.0, 0.0),
                                mask=jnp.asarray(mask), lengths=jnp.asarray(lengths),
                                cache=None)


def _team(graph):
  roles = tuple(RoleSection(name, f"You are the {name}.", f"The {name}.",
                            graded=name == "tester") for name in ROLES)
  extra = {"chain": {}, "dag": {"edges": "planner>coder, planner>tester"},
           "orchestrator": {"orchestrator_max_calls": 4, "orchestrator_max_new_tokens": 20}}[graph]
  # Budgets above the scripts' lengths (the tiny tokenizer's: 7-8 tokens a reply, 16 a
  # route), and only a little: the update's rows are as long as every reply's whole budget.
  return TeamSection(roles=roles, order=",".join(ROLES), graph=graph, max_new_tokens=16,
                     last_max_new_tokens=16, **extra)


def _mc_returns(turns):
  """Per turn (step, its reply as others see it, its prompt, own reward), in order: the Monte
  Carlo return along the successors, γ = λ = 1. A turn's successor is the earliest later
  turn of its step whose prompt holds its reply, else the next step's first turn."""
  out = [0.0] * len(turns)
  for i in reversed(range(len(turns))):
    step, said, _, reward = turns[i]
    later = range(i + 1, len(turns))
    seen_by = [j for j in later if turns[j][0] == step and said in turns[j][2]]
    next_step = [j for j in later if turns[j][0] != step]
    successor = (seen_by or next_step or [None])[0]
    out[i] = reward + (0.0 if successor is None else out[successor])
  return out


@pytest.mark.parametrize("horizon", [1, 2])
@pytest.mark.parametrize("graph", ["chain", "dag", "orchestrator"])
def test_graph_end_to_end(graph, horizon, tmp_path, monkeypatch):
  model = model_lib.Model(*tiny.tiny_model(max_position_embeddings=1024))
  config = echo_config("marft_a", num_envs=2, iterations=1, team=_team(graph),
                       rollout=RolloutSection(num_envs=2, max_context=1024),
                       # One minibatch step: what is checked is what the update is given.
                       optimizer=OptimizerSection(lr=5e-3, epochs=1, minibatches=1),
                       advantage=AdvantageConfig(gamma=1.0, lambda_=1.0, credit="per_step",
                                                 normalize=False),
                       # A multi-step task (the echo task's episodes end after one step,
                       # and it refuses a horizon); its environments are replaced below.
                       task=TaskSection(name="arithmetic", horizon=horizon))
  team, structure = team_lib.build_team(config)
  script = ScriptedSampler(model.tokenizer, team)
  monkeypatch.setattr(sampler, "generate", script)
  monkeypatch.setattr(envs_build, "build_envs", lambda config, team, seed, **kw: envs.EnvBatch(
      lambda i: GoodWordEnv(horizon), config.rollout.num_envs, seed=seed))
  captured = {}
  real = run_lib.compute_advantages

  def capture(batch, episodes, *args, **kwargs):
    captured["batch"] = real(batch, episodes, *args, **kwargs)
    captured["episodes"] = episodes
    return captured["batch"]

  monkeypatch.setattr(run_lib, "compute_advantages", capture)
  metrics = loop.train(config, str(tmp_path), model=model, progress=False)
  assert np.isfinite(metrics["loss"])
  batch, episodes = captured["batch"], captured["episodes"]
  names = [p.role for p in team] + ["orchestrator"]
  adapters = [p.adapter for p in team] + ([structure.profile.adapter]
                                          if graph == "orchestrator" else [])

  # --- who spoke, in what order, and what each turn saw -------------------------------------
  expected_order = {"chain": ["planner", "coder", "tester"],
                    "dag": ["planner", "coder", "tester"],
                    "orchestrator": ["orchestrator", "tester", "orchestrator", "planner",
                                     "orchestrator", "tester", "orchestrator"]}[graph]
  for episode in episodes:
    spoken = [names[t.agent] for t in episode.turns]
    assert spoken == expected_order * horizon
    assert len(episode.rewards) == horizon and episode.dones[-1]
    for t in episode.turns:
      seen = {r for r in ROLES if f"{r.title()}: {REPLIES[r]}" in t.prompt}
      step_turns = [u for u in episode.turns if u.env_step == t.env_step]
      earlier = {names[u.agent] for u in step_turns[:step_turns.index(t)]} - {"orchestrator"}
      if graph == "dag":  # coder and tester are parallel branches: each sees the planner only
        earlier = {"planner"} if names[t.agent] != "planner" else set()
      if t.env_step == 0:
        assert seen == earlier, (names[t.agent], t.prompt)
      else:  # the earlier step's replies and its feedback are in every later prompt
        assert "feedback 1" in t.prompt and seen >= earlier
  # The orchestrator's unparseable route ended each step: no call after "hmm".
  if graph == "orchestrator":
    assert all(e.infos[s]["orchestrator_calls"] == 3 for e in episodes for s in range(horizon))

  # --- what each row trains on, and with which adapter --------------------------------------
  row = 0
  for episode in episodes:
    for sequence, turn in zip(episode.sequences, episode.turns):
      reply = [int(x) for x in np.asarray(sequence.tokens)[np.asarray(sequence.loss_mask)]]
      trained = np.asarray(batch.tokens[row, 1:])[np.asarray(batch.act_mask[row, :-1])]
      assert list(trained) == reply
      agent = set(np.asarray(batch.act_agent[row])[np.asarray(batch.act_mask[row])].tolist())
      assert agent == {turn.agent}
      ids = np.asarray(batch.adapter_ids[row])
      token_ids = ids if ids.ndim == 0 else ids[np.asarray(batch.mask[row])]
      assert set(np.ravel(token_ids).tolist()) == {adapters[turn.agent]}
      row += 1
  sampled_adapters = [a for _, a, _ in script.calls]
  assert sorted(set(sampled_adapters)) == sorted(set(
      adapters[t.agent] for e in episodes for t in e.turns))

  # --- where each reward lands: value targets are the Monte Carlo returns ---------------
  row = 0
  for episode in episodes:
    turns = []
    for t in episode.turns:
      own = episode.rewards[t.env_step][t.agent] if t.agent < len(team) else 0.0
      # This step's part of the prompt: after the earlier steps' replies and feedback.
      this_step = t.prompt.rsplit("Feedback:", 1)[-1] if t.env_step else t.prompt
      turns.append((t.env_step, f"{names[t.agent].title()}: {t.reply.strip()}", this_step,
                    own))
    want = _mc_returns(turns)
    got = [float(batch.turn_return[row + i, 0]) for i in range(len(turns))]
    np.testing.assert_allclose(got, want, atol=1e-5)
    row += len(turns)
