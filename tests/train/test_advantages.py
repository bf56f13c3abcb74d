"""The trainer's own advantage path (episodes → `make_batch` → `compute_advantages`) against
the original MARFT's test vectors and a NumPy loop written from the formulas, for every
credit mode, horizon > 1 with done flags, an orchestrator's calls and a diamond DAG (whose
layers each see every earlier layer: there the rule by layers below is the trainer's rule by
descendants, tests/train/test_dag_credit.py has every other DAG); and mutants of the path (a
discount, a reward position) that these checks catch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo
from marft_jax.rollout.episode import Episode, TokenSequence
from marft_jax.train import advantages as advantages_lib
from marft_jax.train.advantages import AdvantageConfig, compute_advantages
from marft_jax.train.batching import make_batch

ATOL = 1e-5
# Who sees whom in the diamond 0>1, 0>2, 1>3, 2>3 (`envs.agent_sees`): sees[a][b].
DIAMOND_SEES = ((False,) * 4, (True, False, False, False), (True, False, False, False),
                (True, True, True, False))


# --- building episodes as the rollout records them --------------------------------------------


@dataclasses.dataclass
class TurnSpec:
  step: int
  agent: int
  length: int  # reply tokens
  values: list  # the critic's value at each of the turn's decisions (first: its state)


def per_agent_episode(turns, rewards, dones, index=0, rng=None):
  """One row per turn (the per-agent view): a 3-token prompt, then the reply."""
  rng = rng or np.random.default_rng(index)
  episode = Episode(env_index=index, seed=index, task="t", policy_version=0,
                    rewards=[list(map(float, r)) for r in rewards], dones=list(dones))
  for n, turn in enumerate(turns):
    sequence = TokenSequence()
    sequence.add_context(rng.integers(3, 50, 3), adapter=turn.agent)
    sequence.add_reply(rng.integers(3, 50, turn.length), np.zeros(turn.length), turn.agent,
                       turn.agent, 1.0, n, turn.step)
    episode.sequences.append(sequence)
  return episode


def batch_with_values(episodes, turn_lists):
  """The batch of `episodes` with the critic's values written at each turn's decisions."""
  batch = make_batch(episodes, pad_id=0)
  values = np.zeros(batch.tokens.shape, np.float32)
  row = 0
  for turns in turn_lists:
    for turn in turns:
      start = int(batch.turn_value_pos[row, 0])
      values[row, start:start + len(turn.values)] = turn.values
      row += 1
  return batch.replace(act_old_value=values)


def turn_values(out, turn_lists, token):
  """Per episode, per turn: the advantages ([length] at the token level, [1] at the action
  level) and returns the trainer wrote into the batch."""
  adv, ret, row = [], [], 0
  for turns in turn_lists:
    a, r = [], []
    for turn in turns:
      start = int(out.turn_value_pos[row, 0])
      if token:
        a.append(np.asarray(out.act_advantage[row, start:start + turn.length]))
        r.append(np.asarray(out.act_return[row, start:start + turn.length]))
      else:
        a.append(np.asarray([out.turn_advantage[row, 0]]))
        r.append(np.asarray([out.turn_return[row, 0]]))
      row += 1
    adv.append(a)
    ret.append(r)
  return adv, ret


# --- the original MARFT's vectors (reference/marft-original.md §3.3, §4.2) ---------------------


def test_action_level_vector_through_the_trainer():
  """γ=.9, λ=.5, N=2, T=2, V=[[.2,.4],[.5,.6]], r[1]=[0,1], done after step 1."""
  V = [[0.2, 0.4], [0.5, 0.6]]
  turns = [TurnSpec(t, i, 2, [V[t][i]]) for t in range(2) for i in range(2)]
  for credit, rewards in (("per_step", [[0, 0], [0, 1]]), ("equal", [[0, 0], [1, 1]])):
    episode = per_agent_episode(turns, rewards, [False, True])
    config = AdvantageConfig(level="action", gamma=0.9, lambda_=0.5, credit=credit,
                             normalize=False)
    out = compute_advantages(batch_with_values([episode], [turns]), [episode], config, 2)
    adv, ret = turn_values(out, [turns], token=False)
    np.testing.assert_allclose(np.concatenate(adv[0]), [0.22705, 0.149, 0.22, 0.4], atol=ATOL)
    np.testing.assert_allclose(np.concatenate(ret[0]), [0.42705, 0.549, 0.72, 1.0], atol=ATOL)


def test_token_level_vector_through_the_trainer():
  """Action lengths (2, 3) / (1, 2), values .1 … .8, r[1] = [0, 1], done after step 1."""
  spec = {(0, 0): [.1, .2], (0, 1): [.3, .4, .5], (1, 0): [.6], (1, 1): [.7, .8]}
  turns = [TurnSpec(t, i, len(v), v) for (t, i), v in spec.items()]
  episode = per_agent_episode(turns, [[0, 0], [0, 1]], [False, True])
  config = AdvantageConfig(level="token", gamma=0.9, lambda_=0.5, gamma_token=0.9,
                           lambda_token=0.5, credit="per_step", normalize=False)
  out = compute_advantages(batch_with_values([episode], [turns]), [episode], config, 2)
  adv, ret = turn_values(out, [turns], token=True)
  expected = [[0.1313135, 0.11403], [0.0978444, 0.08409875, 0.075775], [0.0795], [0.11, 0.2]]
  for got, want, turn in zip(adv[0], expected, turns):
    np.testing.assert_allclose(got, want, atol=ATOL)
  for got, want, turn in zip(ret[0], expected, turns):
    np.testing.assert_allclose(got, np.asarray(turn.values) + want, atol=ATOL)


# --- a NumPy loop from the formulas ------------------------------------------------------------


def numpy_advantages(turns, layers, rewards, dones, config, num_team, kl=None):
  """Per turn, [length] advantages: positions one a turn (action) or one a token, each turn's
  last position hopping to the first position of the first turn of the next layer."""
  gamma_a = config.gamma if config.gamma_agent is None else config.gamma_agent
  lambda_a = config.lambda_ if config.lambda_agent is None else config.lambda_agent
  token = config.level == "token"
  groups = [(t.step, layer) for t, layer in zip(turns, layers)]
  n = len(turns)
  successor = []
  for k in range(n):
    later = [j for j in range(k + 1, n) if groups[j] != groups[k]]
    successor.append(later[0] if later else None)
  def shape(r):  # AReaL's order: bias, scale, clip
    r = (r + config.reward_bias) * config.reward_scale
    return r if config.reward_clip is None else float(np.clip(r, -config.reward_clip,
                                                              config.reward_clip))

  reward = []
  for k, turn in enumerate(turns):
    step_layers = [layers[j] for j in range(n) if turns[j].step == turn.step]
    team = shape(float(np.mean(rewards[turn.step])))
    if config.credit == "equal":
      reward.append(team if layers[k] == max(step_layers) else 0.0)
    elif config.credit == "step_discount":
      reward.append(team * config.credit_discount ** (max(step_layers) - layers[k]))
    else:
      reward.append(shape(float(rewards[turn.step][turn.agent])) if turn.agent < num_team
                    else 0.0)
  adv = [None] * n
  for k in reversed(range(n)):
    turn = turns[k]
    length = turn.length if token else 1
    values = turn.values[:length]
    # KL-in-reward: on each token's own hop (token level), the reply's sum on its turn's.
    extra = np.zeros(length) if kl is None else (
        np.asarray(kl[k]) if token else np.asarray([np.sum(kl[k])]))
    s = successor[k]
    same_step = s is not None and turns[s].step == turn.step
    if same_step:
      g, lam = gamma_a, lambda_a
    else:
      g, lam = config.gamma * (0.0 if dones[turn.step] else 1.0), config.lambda_
    v_next = turns[s].values[0] if s is not None else 0.0
    a_next = adv[s][0] if s is not None else 0.0
    out = np.zeros(length)
    for j in reversed(range(length)):
      if j == length - 1:
        delta = reward[k] + extra[j] + g * v_next - values[j]
        out[j] = delta + g * lam * a_next
      else:
        delta = extra[j] + config.gamma_token * values[j + 1] - values[j]
        out[j] = delta + config.gamma_token * config.lambda_token * out[j + 1]
    adv[k] = out
  return adv


def random_episode(kind, horizon, rng, num_team=3):
  """Turns of a chain, a DAG (roles 1 and 2 parallel after 0, then 3 joins) or an
  orchestrator (agent num_team: routing turns between calls of the roles, in any order)."""
  dones = [False] * horizon
  end = int(rng.integers(horizon)) if rng.random() < 0.5 else horizon - 1
  dones[end] = True
  turns, layers = [], []
  for step in range(end + 1):
    if kind == "chain":
      plan = [(a, a) for a in range(num_team)]
    elif kind == "dag":
      plan = [(0, 0), (1, 1), (2, 1), (3, 2)]
    else:
      calls = [int(c) for c in rng.integers(0, num_team, int(rng.integers(1, 4)))]
      plan = []
      for c in calls:
        plan += [(num_team, None), (c, None)]
      plan.append((num_team, None))
    for i, (agent, layer) in enumerate(plan):
      length = int(rng.integers(1, 5))
      turns.append(TurnSpec(step, agent, length, list(rng.normal(0, 1, length))))
      layers.append(i if layer is None else layer)
  team = 4 if kind == "dag" else num_team
  rewards = [list(rng.normal(0, 1, team)) for _ in range(end + 1)]
  return turns, layers, rewards, dones[:end + 1]


CONFIGS = {
    "action_equal": AdvantageConfig(level="action", gamma=0.95, lambda_=0.8, credit="equal",
                                    normalize=False),
    "action_step_discount": AdvantageConfig(level="action", gamma=0.9, lambda_=0.7,
                                            gamma_agent=0.97, lambda_agent=0.9,
                                            credit="step_discount", credit_discount=0.5,
                                            normalize=False),
    "action_per_step": AdvantageConfig(level="action", gamma=0.8, lambda_=0.95,
                                       credit="per_step", normalize=False),
    "action_shaped": AdvantageConfig(level="action", gamma=0.9, lambda_=0.9, credit="equal",
                                     reward_scale=10.0, reward_bias=-0.5, reward_clip=3.0,
                                     normalize=False),
    "token_per_step_shaped": AdvantageConfig(level="token", gamma=0.9, lambda_=0.9,
                                             credit="per_step", reward_scale=2.0,
                                             reward_bias=0.25, normalize=False),
    "token_equal": AdvantageConfig(level="token", gamma=0.9, lambda_=0.9, gamma_token=0.95,
                                   lambda_token=0.85, credit="equal", normalize=False),
    "token_per_step": AdvantageConfig(level="token", gamma=1.0, lambda_=0.95,
                                      gamma_agent=0.9, credit="per_step", normalize=False),
}


def _check_against_numpy(kind, config, seed, horizon=3):
  rng = np.random.default_rng(seed)
  episodes, turn_lists, expected = [], [], []
  num_team = 4 if kind == "dag" else 3
  agent_sees = DIAMOND_SEES if kind == "dag" else None
  for e in range(4):
    turns, layers, rewards, dones = random_episode(kind, horizon, rng)
    episodes.append(per_agent_episode(turns, rewards, dones, index=e, rng=rng))
    turn_lists.append(turns)
    expected.append(numpy_advantages(turns, layers, rewards, dones, config, num_team))
  out = compute_advantages(batch_with_values(episodes, turn_lists), episodes, config, num_team,
                           agent_sees=agent_sees)
  adv, _ = turn_values(out, turn_lists, token=config.level == "token")
  for got_episode, want_episode in zip(adv, expected):
    for got, want in zip(got_episode, want_episode):
      np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["chain", "dag", "orchestrator"])
def test_trainer_matches_numpy_loop(kind, name):
  # A fixed seed per case (hash() changes with every process: a failure would not reproduce).
  seed = 10 * sorted(CONFIGS).index(name) + ["chain", "dag", "orchestrator"].index(kind)
  _check_against_numpy(kind, CONFIGS[name], seed=seed)


def test_dag_branches_hop_to_the_join_never_to_a_sibling():
  """Roles 1 and 2 run in parallel after role 0; role 3 joins them. Hand-computed with γ = 1,
  λ = .5 and equal credit R = 1 on the join."""
  turns = [TurnSpec(0, 0, 2, [0.1]), TurnSpec(0, 1, 2, [0.3]), TurnSpec(0, 2, 2, [0.7]),
           TurnSpec(0, 3, 2, [0.5])]
  episode = per_agent_episode(turns, [[1, 1, 1, 1]], [True])
  config = AdvantageConfig(level="action", gamma=1.0, lambda_=0.5, normalize=False)
  out = compute_advantages(batch_with_values([episode], [turns]), [episode], config, 4,
                           agent_sees=DIAMOND_SEES)
  adv, _ = turn_values(out, [turns], token=False)
  # join: 1 − .5 = .5; each branch hops to the join: δ = .5 − v, A = δ + .5 · .5;
  # role 0 hops to the next layer's first turn (branch 1): δ = .3 − .1, A = .2 + .5 · .45.
  np.testing.assert_allclose(np.concatenate(adv[0]), [0.425, 0.45, 0.05, 0.5], atol=ATOL)
  # Laid out as a chain (the old trainer), branch 1 bootstrapped from its sibling, whose
  # prompt never saw its reply: δ = .7 − .3, A = .4 + .5 · .05.
  chained = compute_advantages(batch_with_values([episode], [turns]), [episode], config, 4)
  np.testing.assert_allclose(turn_values(chained, [turns], token=False)[0][0][1], [0.425],
                             atol=ATOL)


def test_grpo_returns_are_the_reward_to_go_along_the_successors():
  turns = [TurnSpec(0, 0, 1, [0.0]), TurnSpec(0, 1, 1, [0.0]), TurnSpec(1, 0, 1, [0.0]),
           TurnSpec(1, 1, 1, [0.0])]
  episodes = [per_agent_episode(turns, [[0, 2], [1, 3]], [False, True], index=0),
              per_agent_episode(turns, [[0, 0], [0, 1]], [False, True], index=1)]
  config = AdvantageConfig(level="grpo", gamma=0.5, credit="per_step", normalize=False)
  out = compute_advantages(batch_with_values(episodes, [turns, turns]), episodes, config, 2,
                           groups=[0, 0])
  # Episode 0: rewards 0, 2, 1, 3 → to-go 0 + .5·(2 + .5·(1 + .5·3))... per agent hop γ = .5.
  to_go = lambda r: [r[0] + .5 * (r[1] + .5 * (r[2] + .5 * r[3])),
                     r[1] + .5 * (r[2] + .5 * r[3]), r[2] + .5 * r[3], r[3]]
  np.testing.assert_allclose(out.turn_return[:4, 0], to_go([0, 2, 1, 3]), atol=ATOL)
  np.testing.assert_allclose(out.turn_return[4:8, 0], to_go([0, 0, 0, 1]), atol=ATOL)
  # Normalised within the group (both episodes) and agent: agent i's four turns pooled.
  returns = np.asarray(out.turn_return[:8, 0])
  agents = np.asarray([0, 1, 0, 1, 0, 1, 0, 1])
  for agent in (0, 1):
    pool = returns[agents == agent]
    want = (pool - pool.mean()) / (pool.std() + 1e-5)
    np.testing.assert_allclose(out.turn_advantage[:8, 0][agents == agent], want, atol=1e-4)


# --- mutants: a wrong discount or a misplaced reward is caught ----------------------------------


def test_mutants_of_the_trainer_path_are_caught(monkeypatch):
  """Each mutant of the path the trainer runs makes the NumPy comparison fail."""
  config = CONFIGS["action_step_discount"]
  _check_against_numpy("dag", config, seed=3)  # the unmutated path passes
  modules = {"turn_hops": ppo.chains, "turn_credit": ppo.credit,
             "turn_successors": ppo.chains}
  real = {name: getattr(module, name) for name, module in modules.items()}
  mutants = {
      # One discount changed: the hop out of an env step discounts by γ_agent.
      "turn_hops": lambda step, nxt, done, gamma, lambda_, gamma_agent=None, lambda_agent=None:
          real["turn_hops"](step, nxt, done, gamma_agent or gamma, lambda_, gamma_agent,
                            lambda_agent),
      # One reward position moved: each turn's credit lands on the next turn.
      "turn_credit": lambda *args, **kwargs: jnp.roll(real["turn_credit"](*args, **kwargs), 1),
      # The old layout of a DAG: every turn sees every earlier one, so a branch hops to its
      # sibling.
      "turn_successors": lambda step, sees, valid: real["turn_successors"](
          step, jnp.tril(jnp.ones_like(sees), -1), valid),
  }
  for name, mutant in mutants.items():
    monkeypatch.setattr(modules[name], name, mutant)
    jax.clear_caches()  # the jitted advantages were traced with the real function
    with pytest.raises(AssertionError):
      _check_against_numpy("dag", config, seed=4)
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("level", ["action", "token"])
def test_kl_in_reward_through_the_trainer(level):
  """−β k3(log π_old, log π_ref) on each trained token (the turn's sum at the action level)."""
  rng = np.random.default_rng(7)
  config = AdvantageConfig(level=level, gamma=0.9, lambda_=0.8, credit="equal",
                           kl_reward_coef=0.1, normalize=False)
  episodes, turn_lists, expected = [], [], []
  for e in range(3):
    turns, layers, rewards, dones = random_episode("chain", 2, rng)
    episodes.append(per_agent_episode(turns, rewards, dones, index=e, rng=rng))
    turn_lists.append((turns, layers, rewards, dones))
  batch = batch_with_values(episodes, [t[0] for t in turn_lists])
  old = rng.normal(-1, 0.5, batch.tokens.shape).astype(np.float32)
  ref = rng.normal(-1, 0.5, batch.tokens.shape).astype(np.float32)
  kl = advantages_lib.kl_rewards(old, ref, np.asarray(batch.act_mask), config)
  # k3(logp, ref) = exp(ref − logp) − (ref − logp) − 1, by hand.
  by_hand = -0.1 * (np.exp(ref - old) - (ref - old) - 1)
  np.testing.assert_allclose(kl, np.where(batch.act_mask, by_hand, 0.0), rtol=1e-5, atol=1e-6)
  row = 0
  for turns, layers, rewards, dones in turn_lists:
    per_turn = []
    for turn in turns:
      start = int(batch.turn_value_pos[row, 0])
      per_turn.append(kl[row, start:start + turn.length])
      row += 1
    expected.append(numpy_advantages(turns, layers, rewards, dones, config, 3, kl=per_turn))
  out = compute_advantages(batch, episodes, config, 3, kl_reward=kl)
  adv, _ = turn_values(out, [t[0] for t in turn_lists], token=level == "token")
  for got_episode, want_episode in zip(adv, expected):
    for got, want in zip(got_episode, want_episode):
      np.testing.assert_allclose(got, want, atol=1e-4)
  off = compute_advantages(batch, episodes, dataclasses.replace(config, kl_reward_coef=0.0), 3)
  assert not np.allclose(off.turn_advantage, out.turn_advantage)


@pytest.mark.parametrize("key, value, words", [
    ("reward_scale", 0.0, "reward_scale=0.0: every shaped reward would be 0"),
    ("reward_scale", float("inf"), "reward_scale=inf: must be finite"),
    ("reward_clip", -1.0, "reward_clip=-1.0: must be > 0"),
    ("credit_discount", 2.0, r"credit_discount=2.0: must be in \[0, 1\]"),
])
def test_bad_values_are_refused_by_name(key, value, words):
  with pytest.raises(ValueError, match=words):
    AdvantageConfig(**{key: value})
  AdvantageConfig(reward_scale=-1.0)  # a cost to minimise
