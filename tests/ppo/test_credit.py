"""Credit: the token → action frame shift, and each turn's reward under every credit rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo

ATOL = 1e-6


def np_turn_credit(team, own, step, layer, valid, credit, gamma_c):
  """Loop over turns; the last layer of a turn's env step is searched among the real turns."""
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


def random_turns(rng, n=12):
  """Env steps of 1–3 layers of 1–3 parallel turns, then padding turns with stray ids."""
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
  return (team.astype(np.float32), own.astype(np.float32), np.asarray(step), np.asarray(layer),
          valid)


def test_token_to_action_frame():
  # By definition: shift left by one, fill the last position.
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([5, 6, 7]), -1), [6, 7, -1])
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([1.0]), 0.0), [0.0])


def test_equal_puts_the_team_reward_on_every_turn_of_the_last_layer():
  # By hand: env step 0 is a DAG (layer 0, branches 1 and 2 in layer 1, join in layer 2); env
  # step 1 ends on two parallel turns. R lands on the join and on both last branches.
  step = np.array([0, 0, 0, 0, 1, 1, 1, 0])
  layer = np.array([0, 1, 1, 2, 0, 1, 1, 0])
  valid = np.array([1, 1, 1, 1, 1, 1, 1, 0])
  team = np.array([2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 9.0], np.float32)
  got = ppo.turn_credit(team, np.zeros(8, np.float32), step, layer, valid, "equal")
  np.testing.assert_array_equal(got, [0, 0, 0, 2.0, 0, 3.0, 3.0, 0])


def test_step_discount_matches_areal_unit_example():
  # AReaL's unit example (γ_c = 0.5, 3 steps → 0.25, 0.5, 1; docs/references.md, 'Test
  # vectors') with the steps as the three layers of one env step; both branches of layer 1
  # get R/2.
  step = np.zeros(4, int)
  layer = np.array([0, 1, 1, 2])
  got = ppo.turn_credit(np.ones(4, np.float32), np.zeros(4, np.float32), step, layer,
                        np.ones(4), "step_discount", 0.5)
  np.testing.assert_allclose(got, [0.25, 0.5, 0.5, 1.0])


def test_per_step_gives_each_turn_its_own_reward_and_padding_nothing():
  # By hand: the own rewards pass through; the padding turn's (9) does not.
  own = np.array([1.0, -2.0, 3.0, 9.0], np.float32)
  got = ppo.turn_credit(np.full(4, 7.0, np.float32), own, np.array([0, 0, 1, 1]),
                        np.array([0, 1, 0, 1]), np.array([1, 1, 1, 0]), "per_step")
  np.testing.assert_array_equal(got, [1.0, -2.0, 3.0, 0.0])


@pytest.mark.parametrize("credit", ppo.CREDITS)
@pytest.mark.parametrize("seed", range(4))
def test_turn_credit_matches_numpy(credit, seed):
  team, own, step, layer, valid = random_turns(np.random.default_rng(seed))
  got = ppo.turn_credit(team, own, step, layer, valid, credit, 0.7)
  np.testing.assert_allclose(got, np_turn_credit(team, own, step, layer, valid, credit, 0.7),
                             atol=ATOL)


def test_turn_credit_under_jit_and_vmap():
  turns = [random_turns(np.random.default_rng(seed)) for seed in range(3)]
  stacked = [np.stack(column) for column in zip(*turns)]
  fn = lambda *args: ppo.turn_credit(*args, "step_discount", 0.5)
  batched = jax.jit(jax.vmap(fn))(*stacked)
  for b, args in enumerate(turns):
    np.testing.assert_allclose(batched[b], np_turn_credit(*args, "step_discount", 0.5),
                               atol=ATOL)


def test_unknown_credit_is_refused_by_name():
  with pytest.raises(ValueError, match=r"^credit='team'"):
    ppo.turn_credit(np.ones(2), np.ones(2), np.zeros(2, int), np.arange(2), np.ones(2), "team")
