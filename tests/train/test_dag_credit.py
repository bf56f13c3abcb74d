"""DAG credit from what each turn's reply reaches, over the graphs a user can write.

The reference (`reference_advantages`) is written from the prompt-visibility relation alone:
given the DAG's edges, who sees whom is the transitive closure (a role's prompt holds its
ancestors' replies); per env step a turn hops to the earliest later turn of the step that sees
it, a turn no later turn sees (a sink) to the next step's first turn; "equal" credits R at
every sink, "step_discount" R·γ_c^hops along the turn's own path to its sink; then a plain GAE
loop runs along those pointers, one position a turn or one a token. Nothing in it reads layers
or the library.

Checked against `ppo.turn_chain_advantages` on every labelled DAG of up to 4 roles and a
seeded sample of 5-role ones (one vmapped program a level, the three credits in it), and
against the trainer's `compute_advantages` (episodes → `make_batch` → advantages, the graph's
table from `envs.agent_sees`) on a seeded sample of 4- and 5-role DAGs plus the named shapes
(a fork without a join, several roots, several sinks), horizons 1–3, every credit mode,
action and token level, done flags before the last step. Mutant (the rule by layers put
back) at the end.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import envs, ppo
from marft_jax.train import advantages as advantages_lib
from marft_jax.train.advantages import AdvantageConfig, compute_advantages
from tests.train.test_advantages import (TurnSpec, batch_with_values, per_agent_episode,
                                         turn_values)

HOPS = dict(gamma=0.9, lambda_=0.8, gamma_agent=0.95, lambda_agent=0.7, gamma_token=0.97,
            lambda_token=0.9, credit_discount=0.5)
ROLES = "abcde"


# --- the graph space ---------------------------------------------------------------------------


def acyclic(m, edges):
  parents = {b: {a for a, c in edges if c == b} for b in range(m)}
  done = set()
  while len(done) < m:
    ready = [r for r in range(m) if r not in done and parents[r] <= done]
    if not ready:
      return False
    done.update(ready)
  return True


def all_dags(m):
  """Every labelled DAG on roles 0 … m−1: each subset of the ordered pairs without a cycle."""
  pairs = [(a, b) for a in range(m) for b in range(m) if a != b]
  return [edges for r in range(len(pairs) + 1) for edges in itertools.combinations(pairs, r)
          if acyclic(m, edges)]


def random_dag(rng, m):
  """Edges along a random order of the roles, each pair with one probability for the graph."""
  order, p = rng.permutation(m), rng.choice([0.25, 0.5, 0.75])
  return tuple((int(order[i]), int(order[j])) for i in range(m) for j in range(i + 1, m)
               if rng.random() < p)


def closure(m, edges):
  """sees[a][b]: b's reply is in a's prompt (b is one of a's ancestors), by a DFS."""
  sees = np.zeros((m, m), bool)
  for a in range(m):
    todo = [x for x, y in edges if y == a]
    while todo:
      b = todo.pop()
      if not sees[a, b]:
        sees[a, b] = True
        todo += [x for x, y in edges if y == b]
  return sees


def execution_order(m, edges, rng=None):
  """Kahn's layers in role order (what the rollout plays), or with `rng` a random linear
  extension (any order a scheduler may pick)."""
  order, left = [], list(range(m))
  while left:
    ready = [r for r in left if all(x in order for x, y in edges if y == r)]
    pick = ready if rng is None else [ready[int(rng.integers(len(ready)))]]
    order += pick
    left = [r for r in left if r not in pick]
  return order


def shape_of(m, edges):
  """(fork without a join, several roots, several sinks) of a DAG."""
  sees = closure(m, edges)
  children = [{b for a, b in edges if a == r} for r in range(m)]
  # A fork whose branches no role joins: two children that no common descendant sees.
  fork = any(not any(sees[d, x] and sees[d, y] for d in range(m))
             for r in range(m) for x in children[r] for y in children[r] if x < y)
  roots = sum(1 for r in range(m) if not sees[r].any())
  sinks = sum(1 for r in range(m) if not sees[:, r].any())
  return fork, roots > 1, sinks > 1


def random_episode(rng, order, num_roles, horizon, token):
  """Turns of `horizon` env steps in `order`, random values and rewards, random done flags
  (a done before the last step cuts the hop out of its step); 1–3 tokens a turn."""
  turns = []
  for step in range(horizon):
    for agent in order:
      length = int(rng.integers(1, 4)) if token else 1
      turns.append(TurnSpec(step, agent, length, list(rng.normal(0, 1, length))))
  rewards = [list(rng.normal(0, 1, num_roles)) for _ in range(horizon)]
  dones = list(rng.random(horizon) < 0.3)
  return turns, rewards, dones


# --- the reference, from who sees whom ---------------------------------------------------------


def reference_successors(turns, sees):
  """Per turn its successor (None: the episode ends) and whether it is a sink of its step."""
  out = []
  for k, turn in enumerate(turns):
    later = [j for j in range(k + 1, len(turns))]
    seen_by = [j for j in later if turns[j].step == turn.step and sees[turns[j].agent,
                                                                       turn.agent]]
    next_steps = [j for j in later if turns[j].step != turn.step]
    out.append((seen_by[0], False) if seen_by else
               (next_steps[0] if next_steps else None, True))
  return out


def reference_advantages(turns, sees, rewards, dones, credit, level, hops=HOPS):
  """Per turn, its [length] advantages (action level: [1])."""
  g, lam = hops["gamma"], hops["lambda_"]
  g_a, lam_a = hops["gamma_agent"], hops["lambda_agent"]
  g_t, lam_t = hops["gamma_token"], hops["lambda_token"]
  successors = reference_successors(turns, sees)
  n = len(turns)

  def hops_to_sink(k):
    hops = 0
    while not successors[k][1]:
      k, hops = successors[k][0], hops + 1
    return hops

  adv = [None] * n
  for k in reversed(range(n)):
    turn = turns[k]
    team = float(np.mean(rewards[turn.step]))
    r = {"equal": team if successors[k][1] else 0.0,
         "step_discount": team * hops["credit_discount"] ** hops_to_sink(k),
         "per_step": float(rewards[turn.step][turn.agent])}[credit]
    s, sink = successors[k]
    hop_g, hop_l = (g * (not dones[turn.step]), lam) if sink else (g_a, lam_a)
    v_next = 0.0 if s is None else turns[s].values[0]
    a_next = 0.0 if s is None else adv[s][0]
    length = turn.length if level == "token" else 1
    out = np.zeros(length)
    for j in reversed(range(length)):
      if j == length - 1:
        out[j] = r + hop_g * v_next - turn.values[j] + hop_g * hop_l * a_next
      else:
        out[j] = g_t * turn.values[j + 1] - turn.values[j] + g_t * lam_t * out[j + 1]
    adv[k] = out
  return adv


def test_the_reference_by_hand():
  """a>b, a>c, b>d, one step, γ = λ = 1 inside it: a hops to b, b to d; c and d are sinks
  and get R = 1 under "equal"; values .1 .2 .3 .4."""
  turns = [TurnSpec(0, i, 1, [v]) for i, v in enumerate([0.1, 0.2, 0.3, 0.4])]
  sees = closure(4, ((0, 1), (0, 2), (1, 3)))
  assert reference_successors(turns, sees) == [(1, False), (3, False), (None, True),
                                               (None, True)]
  adv = reference_advantages(turns, sees, [[1.0] * 4], [True], "equal", "action",
                             dict(HOPS, gamma_agent=1.0, lambda_agent=1.0))
  # d: 1 − .4; c: 1 − .3; b: .4 − .2 + .6; a: .2 − .1 + .8.
  np.testing.assert_allclose(np.concatenate(adv), [0.9, 0.8, 0.7, 0.6], atol=1e-12)


# --- against ppo.turn_chain_advantages, one vmapped call per mode ------------------------------


def _ppo_case(rng, m, edges, order):
  """(who sees whom, (turns, rewards, dones)); the action level reads 1 position a turn."""
  return closure(m, edges), random_episode(rng, order, m, int(rng.integers(1, 4)), token=True)


@functools.lru_cache(maxsize=None)
def _ppo_cases():
  rng = np.random.default_rng(39)
  cases = [_ppo_case(rng, m, edges, execution_order(m, edges))
           for m in range(1, 5) for edges in all_dags(m)]
  for _ in range(300):
    edges = random_dag(rng, 5)
    cases.append(_ppo_case(rng, 5, edges, execution_order(5, edges, rng)))
  return cases


@functools.lru_cache(maxsize=None)
def _ppo_arrays(token, count, n=16, width=48):
  rows = []
  for sees, (turns, rewards, dones) in _ppo_cases()[:count]:
    length = [t.length if token else 1 for t in turns]
    pad = n - len(turns)
    sees_kk = np.zeros((n, n), bool)
    for j, tj in enumerate(turns):
      for k, tk in enumerate(turns[:j]):
        sees_kk[j, k] = tj.step == tk.step and sees[tj.agent, tk.agent]
    values = np.concatenate([t.values[:l] for t, l in zip(turns, length)])
    rows.append((
        np.asarray([t.step for t in turns] + [0] * pad), sees_kk,
        np.arange(n) < len(turns), np.asarray(length + [0] * pad),
        np.asarray([np.mean(rewards[t.step]) for t in turns] + [0.0] * pad, np.float32),
        np.asarray([rewards[t.step][t.agent] for t in turns] + [0.0] * pad, np.float32),
        np.asarray([dones[t.step] for t in turns] + [False] * pad),
        np.pad(values, (0, width - len(values))).astype(np.float32)))
  return [np.stack(column) for column in zip(*rows)]


def _check_ppo(level, count=None):
  """The first `count` cases (all: None), every credit mode in one compiled program."""
  cases = _ppo_cases()[:count]
  every_credit = lambda *xs: [ppo.turn_chain_advantages(*xs, credit=credit, **HOPS)[0]
                              for credit in ppo.CREDITS]
  got = jax.jit(jax.vmap(every_credit))(*_ppo_arrays(level == "token", len(cases)))
  for credit, adv in zip(ppo.CREDITS, map(np.asarray, got)):
    for e, (sees, (turns, rewards, dones)) in enumerate(cases):
      want = np.concatenate(reference_advantages(turns, sees, rewards, dones, credit, level))
      np.testing.assert_allclose(adv[e, :len(want)], want, atol=1e-4,
                                 err_msg=f"case {e}, {credit}")


@pytest.mark.parametrize("level", ["action", "token"])
def test_ppo_matches_the_reference_on_every_small_dag(level):
  cases = _ppo_cases()
  assert len(cases) == 1 + 3 + 25 + 543 + 300  # every labelled DAG of 1–4 roles
  assert {len(dones) for _, (_, _, dones) in cases} == {1, 2, 3}  # the horizons
  assert any(any(dones[:-1]) for _, (_, _, dones) in cases)  # a done before the last step
  _check_ppo(level)


# --- through the trainer's compute_advantages --------------------------------------------------

NAMED = {  # (roles, edges): the shapes the issue names, and the shipped DAG's
    "fork_without_join": (4, ((0, 1), (0, 2), (1, 3))),
    "two_roots_one_unjoined": (4, ((0, 2), (1, 3), (0, 3))),
    "diamond": (4, ((0, 1), (0, 2), (1, 3), (2, 3))),
    "shipped_dag_3agents": (3, ((0, 2), (1, 2))),
    "isolated_role": (3, ((0, 2),)),
}


def _trainer_dags():
  rng = np.random.default_rng(40)
  return list(NAMED.values()) + [(m, random_dag(rng, m)) for m in (4, 5) * 8]


def _team(m):
  return tuple(envs.AgentProfile(ROLES[r], f"You are {ROLES[r]}.", ROLES[r]) for r in range(m))


def _trainer_case(m, edges, rng, level):
  graph = envs.AgentGraph(tuple(ROLES[:m]), tuple((ROLES[a], ROLES[b]) for a, b in edges))
  table = envs.agent_sees(graph, _team(m))
  order = execution_order(m, edges, None if rng.random() < 0.5 else rng)
  # Three episodes a call, one as long as any (horizon 3, 33–48 tokens), so that the padded
  # shapes, and with them the compiles, are one a level: 16 turns, 16 or 48 positions.
  episodes = [random_episode(rng, order, m, h, level == "token") for h in
              (3, int(rng.integers(1, 4)), int(rng.integers(1, 4)))]
  for turn in episodes[0][0]:
    turn.length = 4 if m == 3 else 3
    turn.values = list(rng.normal(0, 1, turn.length))
  return table, episodes


def _check_trainer(level, dags, credits=ppo.CREDITS):
  rng = np.random.default_rng(42)
  for m, edges in dags:
    table, cases = _trainer_case(m, edges, rng, level)
    # The trainer's table is the reference's closure, from the graph's own ancestors.
    np.testing.assert_array_equal(np.asarray(table), closure(m, edges))
    episodes = [per_agent_episode(t, r, d, index=i, rng=rng) for i, (t, r, d) in
                enumerate(cases)]
    batch = batch_with_values(episodes, [t for t, _, _ in cases])
    for credit in credits:
      config = AdvantageConfig(level=level, credit=credit, normalize=False, **HOPS)
      out = compute_advantages(batch, episodes, config, m, agent_sees=table)
      got, _ = turn_values(out, [t for t, _, _ in cases], token=level == "token")
      for (turns, rewards, dones), got_episode in zip(cases, got):
        want = reference_advantages(turns, closure(m, edges), rewards, dones, credit, level)
        np.testing.assert_allclose(np.concatenate(got_episode), np.concatenate(want),
                                   atol=1e-4, err_msg=f"{edges} {credit}")


@pytest.mark.parametrize("level", ["action", "token"])
def test_the_trainer_matches_the_reference(level):
  dags = _trainer_dags()
  shapes = [shape_of(m, edges) for m, edges in dags]
  # The sample holds every shape the rule has to get right.
  for i, name in enumerate(("a fork without a join", "several roots", "several sinks")):
    assert any(s[i] for s in shapes), name
  _check_trainer(level, dags)


def _layer_successors(step_k, sees_kk, valid_k):
  """The rule this replaced: every turn hops to the first turn of the next Kahn layer of its
  env step (layers rebuilt from the relation: a turn's layer is 1 + the deepest layer it
  sees)."""
  n = step_k.shape[0]
  layer = jnp.zeros((n,), jnp.int32)
  for k in range(n):
    deepest = jnp.max(jnp.where(sees_kk[k, :] & (jnp.arange(n) < k), layer, -1))
    layer = layer.at[k].set(deepest + 1)
  index = jnp.arange(n)
  same_group = (step_k[:, None] == step_k[None, :]) & (layer[:, None] == layer[None, :])
  later_group = (index[:, None] > index[None, :]) & ~same_group & (valid_k[:, None] != 0)
  successor = jnp.min(jnp.where(later_group, index[:, None], n), axis=0)
  return jnp.where(valid_k != 0, successor, n).astype(jnp.int32)


def test_the_rule_by_layers_is_caught(monkeypatch):
  """Mutant: successors by layers (the next layer's first turn) instead of by descendants.
  Both the ppo-level and the trainer-level comparisons fail on it."""
  monkeypatch.setattr(ppo.chains, "turn_successors", _layer_successors)
  advantages_lib._vmapped_chains.clear_cache()  # traced with the real rule
  try:
    with pytest.raises(AssertionError):
      _check_ppo("action", count=100)  # the 3-role DAGs are among the first 29
    with pytest.raises(AssertionError):
      _check_trainer("action", [NAMED["fork_without_join"]], credits=("equal",))
  finally:
    monkeypatch.undo()
    advantages_lib._vmapped_chains.clear_cache()
