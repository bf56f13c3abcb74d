"""Credit placement: AReaL's strategies, at the decision that emits each step's last token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo
from tests.ppo.numpy_loops import np_areal_gae


def episode_token_frame():
  """prompt(3) | step 0 (3) | transition(2) | step 1 (2) | transition(2) | step 2 (1) | pad.

  A hand-built layout; token_ends are read off it.
  """
  step_ids = np.array([-1, -1, -1, 0, 0, 0, -1, -1, 1, 1, -1, -1, 2, -1])
  token_ends = [6, 10, 13]  # e_i, exclusive, in the token frame
  return step_ids, token_ends


def np_last_positions(step_ids):
  return {int(i): int(np.nonzero(step_ids == i)[0].max()) for i in set(step_ids) if i >= 0}


def np_credit(step_ids, rewards_by_step):
  out = np.zeros(len(step_ids))
  for i, pos in np_last_positions(step_ids).items():
    out[pos] = rewards_by_step(i)
  return out


def random_step_ids(rng, T, S):
  """Segments of steps 0..S−1 in order, some empty, separated by −1 runs."""
  ids = []
  for i in range(S):
    ids += [-1] * int(rng.integers(0, 3)) + [i] * int(rng.integers(0, 4))
  ids = (ids + [-1] * T)[:T]
  return np.array(ids)


def test_token_to_action_frame():
  # By definition: shift left by one, fill the last position.
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([5, 6, 7]), -1), [6, 7, -1])
  np.testing.assert_array_equal(ppo.token_to_action_frame(jnp.array([1.0]), 0.0), [0.0])


def test_rewards_land_on_the_decision_emitting_each_last_token():
  step_ids, token_ends = episode_token_frame()
  action_ids = ppo.token_to_action_frame(jnp.asarray(step_ids), -1)
  # Distinct rewards per step; by the rule in credit.py each lands at action position e_i − 2.
  r = ppo.per_step_credit(jnp.array([1.0, 2.0, 3.0]), action_ids)
  expected = np.zeros(len(step_ids))
  expected[[e - 2 for e in token_ends]] = [1.0, 2.0, 3.0]
  np.testing.assert_array_equal(r, expected)


def test_areal_placement_is_lost_and_ours_is_not():
  # AReaL writes step i's reward at e_i − 1; in the action frame that is a mask-0 position.
  step_ids, token_ends = episode_token_frame()
  loss_mask = np.asarray(ppo.token_to_action_frame(jnp.asarray(step_ids >= 0, jnp.float32), 0))
  areal_r = np.zeros(len(step_ids))
  areal_r[[e - 1 for e in token_ends]] = 1.0
  v = np.zeros(len(step_ids))
  assert np.all(loss_mask[[e - 1 for e in token_ends]] == 0)
  assert np.all(np_areal_gae(areal_r, v, loss_mask, 0.0, 1.0, 1.0) == 0.0)

  ours = np.asarray(ppo.per_step_credit(jnp.ones(3), ppo.token_to_action_frame(
      jnp.asarray(step_ids), -1)))
  first = int(np.argmax(loss_mask))
  assert np_areal_gae(ours, v, loss_mask, 0.0, 1.0, 1.0)[first] == 3.0
  adv, _ = ppo.sequence_advantages(ours, v, loss_mask, False, 1.0, 1.0)
  assert adv[first] == 3.0


def test_step_discount_matches_areal_unit_example():
  # AReaL's unit example (γ_c = 0.5, 3 steps → 0.25, 0.5, 1; docs/references.md, 'Test
  # vectors'), each at its step's last decision in this hand-built layout.
  step_ids = jnp.array([0, 0, -1, 1, -1, 2, 2, -1])
  r = ppo.step_discount_credit(1.0, step_ids, 3, 0.5)
  np.testing.assert_allclose(r, [0, 0.25, 0, 0.5, 0, 0, 1.0, 0])


def test_equal_credit_on_last_decision_only():
  # By hand: R = 2 lands on the last non-negative id (position 4); no decision, no credit.
  np.testing.assert_array_equal(ppo.equal_credit(2.0, jnp.array([-1, 0, 0, 1, 1, -1])),
                                [0, 0, 0, 0, 2.0, 0])
  np.testing.assert_array_equal(ppo.equal_credit(2.0, -jnp.ones(4, jnp.int32)), np.zeros(4))


@pytest.mark.parametrize("seed", range(5))
def test_credit_matches_numpy(seed):
  rng = np.random.default_rng(seed)
  S, T = 4, 16
  step_ids = random_step_ids(rng, T, S)
  team_r, step_r = rng.normal(), rng.normal(size=S).astype(np.float32)
  last = max(np_last_positions(step_ids), default=None)
  ids = jnp.asarray(step_ids)
  np.testing.assert_allclose(ppo.per_step_credit(step_r, ids),
                             np_credit(step_ids, lambda i: step_r[i]), atol=1e-6)
  np.testing.assert_allclose(ppo.step_discount_credit(team_r, ids, S, 0.7),
                             np_credit(step_ids, lambda i: team_r * 0.7 ** (S - 1 - i)),
                             atol=1e-6)
  np.testing.assert_allclose(ppo.equal_credit(team_r, ids),
                             np_credit(step_ids, lambda i: team_r if i == last else 0.0),
                             atol=1e-6)
  np.testing.assert_array_equal(
      ppo.step_ends(ids), np_credit(step_ids, lambda i: 1.0).astype(bool))


def test_credit_under_jit_and_vmap():
  rng = np.random.default_rng(0)
  ids = jnp.asarray(np.stack([random_step_ids(rng, 12, 3) for _ in range(3)]))
  rewards = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
  batched = jax.jit(jax.vmap(ppo.per_step_credit))(rewards, ids)
  for b in range(3):
    np.testing.assert_allclose(batched[b], ppo.per_step_credit(rewards[b], ids[b]))
