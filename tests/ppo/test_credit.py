"""Credit: the token → action frame shift, and each turn's reward under every credit rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo

ATOL = 1e-6


def np_layer_credit(team, own, step, layer, valid, credit, gamma_c):
  """The rule by layers (each layer sees every earlier one): R on the step's last layer, or
  R·γ_c^(L−1−ℓ). Loop over turns; the last layer is searched among the real turns."""
  out = np.zeros(len(step))
  for k in range(len(step)):
    if not valid[k]:
      continue
    last = max(layer[j] for j in range(len(step)) if valid[j] and step[j] == step[k])
    if credit == "equal":
      out[k] = team[k] if layer[k] == last else 0.0
    elif credit == "step_discount":
      out[k] = team[k] * gamma_c ** (last - layer[k])
    else:
      out[k] = own[k]
  return out


def np_path_credit(team, own, step, next_k, valid, credit, gamma_c):
  """From the definition on successors: walk each turn's path while it stays in its step."""
  n = len(step)
  out = np.zeros(n)
  for k in range(n):
    if not valid[k]:
      continue
    hops, at = 0, k
    while next_k[at] < n and step[next_k[at]] == step[k]:
      hops, at = hops + 1, next_k[at]
    out[k] = {"equal": team[k] if hops == 0 else 0.0,
              "step_discount": team[k] * gamma_c ** hops, "per_step": own[k]}[credit]
  return out


def random_turns(rng, n=12):
  """Env steps of 1–3 layers of 1–3 parallel turns, then padding turns with stray ids.
  Returns team, own, step, next_k (by layers: `layer_sees`), valid and the layers."""
  step, layer = [], []
  for t in range(3):
    for ell in range(int(rng.integers(1, 4))):
      width = int(rng.integers(1, 4))
      step += [t] * width
      layer += [ell] * width
  step, layer = step[:n - 2], layer[:n - 2]
  real = len(step)
  # Padding that claims a later layer of a real env step must not move that step's last layer.
  step += [int(rng.integers(0, 3)) for _ in range(n - real)]
  layer += [5] * (n - real)
  valid = np.arange(n) < real
  team = rng.normal(size=3)[np.asarray(step)]  # one team reward per env step
  own = rng.normal(size=n)
  step, layer = np.asarray(step), np.asarray(layer)
  next_k = np.asarray(ppo.turn_successors(step, ppo.layer_sees(step, layer, valid), valid))
  return (team.astype(np.float32), own.astype(np.float32), step, next_k, valid, layer)


def _layered(step, layer, valid):
  return np.asarray(ppo.turn_successors(step, ppo.layer_sees(step, layer, valid), valid))


def test_token_to_action_frame():
  # By definition: shift left by one, fill the last position.
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([5, 6, 7]), -1), [6, 7, -1])
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([1.0]), 0.0), [0.0])


def test_equal_puts_the_team_reward_on_every_turn_of_the_last_layer():
  # By hand: env step 0 is a diamond (layer 0, branches 1 and 2 in layer 1, join in layer
  # 2); env step 1 ends on two parallel turns. R lands on the join and on both last branches.
  step = np.array([0, 0, 0, 0, 1, 1, 1, 0])
  layer = np.array([0, 1, 1, 2, 0, 1, 1, 0])
  valid = np.array([1, 1, 1, 1, 1, 1, 1, 0])
  team = np.array([2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 9.0], np.float32)
  got = ppo.turn_credit(team, np.zeros(8, np.float32), step, _layered(step, layer, valid),
                        valid, "equal")
  np.testing.assert_array_equal(got, [0, 0, 0, 2.0, 0, 3.0, 3.0, 0])


@pytest.mark.parametrize("credit, want", [("equal", [0, 0, 1, 1]),
                                          ("step_discount", [0.25, 0.5, 1, 1])])
def test_a_fork_without_a_join_credits_each_sink(credit, want):
  # By hand: edges a>b, a>c, b>d in the order a, b, c, d. Who sees whom: b and c see a; d sees
  # a and b. a hops to b (its first child), b to d, c and d to nothing: two sinks, R on each;
  # step_discount by the hops along each path (a: a>b>d, 2; b: 1; c, d: 0). By layers c
  # would have hopped to d, whose prompt never saw c's reply, and got R/2.
  sees = np.zeros((4, 4), bool)
  sees[1, 0] = sees[2, 0] = sees[3, 0] = sees[3, 1] = True
  step, valid = np.zeros(4, int), np.ones(4, bool)
  next_k = ppo.turn_successors(step, sees, valid)
  np.testing.assert_array_equal(next_k, [1, 3, 4, 4])
  np.testing.assert_array_equal(ppo.hops_to_sink(step, next_k), [2, 1, 0, 0])
  got = ppo.turn_credit(np.ones(4, np.float32), np.zeros(4, np.float32), step, next_k, valid,
                        credit, 0.5)
  np.testing.assert_allclose(got, want)


def test_step_discount_matches_areal_unit_example():
  # AReaL's unit example (γ_c = 0.5, 3 steps → 0.25, 0.5, 1; docs/references.md, 'Test
  # vectors') with the steps as the three layers of one env step; both branches of layer 1
  # get R/2.
  step = np.zeros(4, int)
  layer = np.array([0, 1, 1, 2])
  got = ppo.turn_credit(np.ones(4, np.float32), np.zeros(4, np.float32), step,
                        _layered(step, layer, np.ones(4)), np.ones(4), "step_discount", 0.5)
  np.testing.assert_allclose(got, [0.25, 0.5, 0.5, 1.0])


def test_per_step_gives_each_turn_its_own_reward_and_padding_nothing():
  # By hand: the own rewards pass through; the padding turn's (9) does not.
  own = np.array([1.0, -2.0, 3.0, 9.0], np.float32)
  got = ppo.turn_credit(np.full(4, 7.0, np.float32), own, np.array([0, 0, 1, 1]),
                        np.array([1, 2, 4, 4]), np.array([1, 1, 1, 0]), "per_step")
  np.testing.assert_array_equal(got, [1.0, -2.0, 3.0, 0.0])


@pytest.mark.parametrize("credit", ppo.CREDITS)
@pytest.mark.parametrize("seed", range(4))
def test_turn_credit_matches_numpy(credit, seed):
  """On layered schedules the credit on successors is the rule by layers (a chain and a
  diamond credit as before); on any successors it is the path walk."""
  team, own, step, next_k, valid, layer = random_turns(np.random.default_rng(seed))
  got = ppo.turn_credit(team, own, step, next_k, valid, credit, 0.7)
  np.testing.assert_allclose(got, np_layer_credit(team, own, step, layer, valid, credit, 0.7),
                             atol=ATOL)
  np.testing.assert_allclose(got, np_path_credit(team, own, step, next_k, valid, credit, 0.7),
                             atol=ATOL)


def test_turn_credit_under_jit_and_vmap():
  turns = [random_turns(np.random.default_rng(seed))[:5] for seed in range(3)]
  stacked = [np.stack(column) for column in zip(*turns)]
  fn = lambda *args: ppo.turn_credit(*args, "step_discount", 0.5)
  batched = jax.jit(jax.vmap(fn))(*stacked)
  for b, args in enumerate(turns):
    np.testing.assert_allclose(batched[b], np_path_credit(*args, "step_discount", 0.5),
                               atol=ATOL)


def test_unknown_credit_is_refused_by_name():
  with pytest.raises(ValueError, match=r"^credit='team'"):
    ppo.turn_credit(np.ones(2), np.ones(2), np.zeros(2, int), np.arange(1, 3), np.ones(2),
                    "team")
