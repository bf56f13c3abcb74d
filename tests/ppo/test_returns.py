"""Advantages: reference test vectors, NumPy loops from the formulas, rlax."""

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rlax

from marft_jax import ppo
from tests.ppo.numpy_loops import (
    np_action_level,
    np_action_level_original,
    np_masked_gae,
    np_token_level,
)

ATOL = 1e-5


# --- Test vectors from the original code (docs/references.md, 'Test vectors') -----------

def test_action_level_vector():
  # The original ActionBuffer's output on these inputs; derived by hand in docs/references.md.
  r = jnp.array([[0.0, 0.0], [0.0, 1.0]])
  v = jnp.array([[0.2, 0.4], [0.5, 0.6]])
  adv, ret = ppo.action_level_advantages(r, v, jnp.array([0, 1]), 0.7, 0.9, 0.5)
  np.testing.assert_allclose(adv, [[0.22705, 0.149], [0.22, 0.4]], atol=ATOL)
  np.testing.assert_allclose(ret, [[0.42705, 0.549], [0.72, 1.0]], atol=ATOL)


def token_vector_inputs():
  """Action lengths (2, 3) at step 0 and (1, 2) at step 1; values 0.1 … 0.8 in order."""
  v = np.zeros((2, 2, 3), np.float32)
  mask = np.zeros((2, 2, 3), bool)
  for (t, i), values in {(0, 0): [.1, .2], (0, 1): [.3, .4, .5], (1, 0): [.6],
                         (1, 1): [.7, .8]}.items():
    v[t, i, :len(values)] = values
    mask[t, i, :len(values)] = True
  return np.array([[0.0, 0.0], [0.0, 1.0]], np.float32), v, mask


def test_token_level_vector():
  # The original TokenBuffer's A are known to 3-4 digits only, from values not recorded;
  # the values 0.1 … 0.8 reproduce every digit, and the exact A below follow from them by
  # hand (δ's of .02 … .08 plus traces; derivation in docs/references.md, 'Test vectors').
  r, v, mask = token_vector_inputs()
  adv, ret = ppo.token_level_advantages(r, v, mask, jnp.array([0, 1]), 0.9, 0.9, 0.5)
  expected = np.zeros((2, 2, 3))
  expected[1, 1, :2] = [0.11, 0.2]
  expected[1, 0, :1] = [0.0795]
  expected[0, 1, :3] = [0.0978444, 0.08409875, 0.075775]
  expected[0, 0, :2] = [0.1313135, 0.11403]
  np.testing.assert_allclose(adv, expected, atol=ATOL)
  published = {(1, 1): [.11, .2], (1, 0): [.0795], (0, 1): [.0978, .0841, .0758],
               (0, 0): [.1313, .114]}
  for (t, i), digits in published.items():
    np.testing.assert_allclose(adv[t, i, :len(digits)], digits, atol=5e-5)
  np.testing.assert_allclose(ret, np.where(mask, v + expected, 0.0), atol=ATOL)


# --- Plain GAE against rlax -----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_masked_gae_unmasked_equals_rlax(seed):
  rng = np.random.default_rng(seed)
  T = 7
  r, v = rng.normal(size=T).astype(np.float32), rng.normal(size=T + 1).astype(np.float32)
  discount = (0.9 * (rng.random(T) > 0.2)).astype(np.float32)
  lam = rng.random(T).astype(np.float32)
  expected = rlax.truncated_generalized_advantage_estimation(r, discount, lam, v)
  got = ppo.masked_gae(r, discount, lam, v[:-1], np.ones(T), v[-1])
  np.testing.assert_allclose(got, expected, atol=ATOL)


# --- Against the NumPy loops on random inputs -----------------------------------------------

@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    r=hnp.arrays(np.float32, 6, elements=st.floats(-2, 2, width=32)),
    discount=hnp.arrays(np.float32, 6, elements=st.sampled_from([0.0, 0.5, 0.9, 1.0])),
    lam=hnp.arrays(np.float32, 6, elements=st.floats(0, 1, width=32)),
    v=hnp.arrays(np.float32, 7, elements=st.floats(-2, 2, width=32)),
    mask=hnp.arrays(bool, 6))
def test_masked_gae_matches_numpy(r, discount, lam, v, mask):
  got = ppo.masked_gae(r, discount, lam, v[:-1], mask, v[-1])
  np.testing.assert_allclose(got, np_masked_gae(r, discount, lam, v[:-1], mask, v[-1]),
                             atol=1e-4)


def test_masked_gae_all_masked_and_empty():
  np.testing.assert_array_equal(ppo.masked_gae(*[jnp.ones(4)] * 4, jnp.zeros(4), 1.0),
                                np.zeros(4))
  assert ppo.masked_gae(*[jnp.zeros(0)] * 5, 1.0).shape == (0,)


@pytest.mark.parametrize("T,N", [(1, 1), (3, 2), (4, 3)])
def test_action_level_matches_numpy(T, N):
  rng = np.random.default_rng(T * 10 + N)
  for _ in range(3):
    r, v = rng.normal(size=(T, N)), rng.normal(size=(T, N))
    done = rng.random(T) < 0.4
    v_boot = rng.normal()
    args = (0.95, 0.8, 0.9, 0.7)
    adv, ret = ppo.action_level_advantages(
        r.astype(np.float32), v.astype(np.float32), done, v_boot, *args)
    np.testing.assert_allclose(adv, np_action_level(r, v, done, v_boot, *args), atol=ATOL)
    np.testing.assert_allclose(ret, v + adv, atol=ATOL)


def test_action_level_done_does_not_cut_the_agent_chain():
  # Episode ends after step 0; step 1 is a new episode whose agents must stay chained
  # (reference defect D4, docs/references.md).
  r = np.array([[0.0, 1.0], [0.0, 1.0]])
  v = np.array([[0.1, 0.2], [0.3, 0.4]])
  done = np.array([1, 0])
  adv, _ = ppo.action_level_advantages(r, v, done, 0.5, 0.9, 0.5)
  np.testing.assert_allclose(adv, np_action_level(r, v, done, 0.5, 0.9, 0.5, 0.9, 0.5),
                             atol=ATOL)
  original = np_action_level_original(r, v, done, 0.5, 0.9, 0.5)
  assert abs(original[1, 0] - adv[1, 0]) > 0.1  # the original zeroed V[1,1] and the trace
  # By hand: step 0 ends the episode, so A[0,1] = r − v = 1 − 0.2 = 0.8 and
  # A[0,0] = δ + γλ A[0,1] = (0.9·0.2 − 0.1) + 0.45·0.8.
  np.testing.assert_allclose(adv[0], [0.9 * 0.2 - 0.1 + 0.45 * 0.8, 0.8], atol=ATOL)


def test_action_level_with_unit_agent_hops_is_joint_action_gae():
  rng = np.random.default_rng(7)
  r, v = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
  done = np.array([0, 0, 1, 0, 0])
  adv, _ = ppo.action_level_advantages(r, v, done, 0.4, 0.9, 0.8, 1.0, 1.0)
  joint = rlax.truncated_generalized_advantage_estimation(
      r.sum(1), 0.9 * (1 - done), 0.8, np.append(v[:, 0], 0.4).astype(np.float32))
  np.testing.assert_allclose(adv[:, 0], joint, atol=ATOL)


def random_token_inputs(rng, T, N, K):
  lengths = rng.integers(0, K + 1, size=(T, N))
  mask = np.arange(K) < lengths[..., None]
  holes = rng.random((T, N, K)) < 0.15  # also non-prefix masks and leading padding
  mask = mask ^ (holes & (rng.random() < 0.5))
  # Padding holds garbage: the result must not read it (defect D6, docs/references.md).
  v = np.where(mask, rng.normal(size=(T, N, K)), rng.normal(size=(T, N, K)) * 1e3)
  return rng.normal(size=(T, N)), v, mask, rng.random(T) < 0.4, rng.normal()


@pytest.mark.parametrize("T,N,K", [(1, 1, 1), (2, 3, 4), (3, 2, 5)])
def test_token_level_matches_numpy(T, N, K):
  rng = np.random.default_rng(T * 100 + N * 10 + K)
  for _ in range(4):
    r, v, mask, done, v_boot = random_token_inputs(rng, T, N, K)
    hops = (0.95, 0.8, 1.0, 0.9, 0.9, 0.7)
    adv, ret = ppo.token_level_advantages(
        r.astype(np.float32), v.astype(np.float32), mask, done, v_boot, *hops)
    expected = np_token_level(r, v, mask, done, v_boot, *hops)
    np.testing.assert_allclose(adv, expected, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(ret)[~mask], 0.0)
    np.testing.assert_allclose(np.asarray(ret)[mask], (v + expected)[mask], atol=1e-4)


def test_token_level_ignores_padding_values():
  r, v, mask = token_vector_inputs()
  garbage = np.where(mask, v, 123.0)
  a1, r1 = ppo.token_level_advantages(r, v, mask, np.array([0, 1]), 0.9, 0.9, 0.5)
  a2, r2 = ppo.token_level_advantages(r, garbage, mask, np.array([0, 1]), 0.9, 0.9, 0.5)
  np.testing.assert_array_equal(a1, a2)
  np.testing.assert_array_equal(r1, r2)


def test_token_level_unit_token_discount_telescopes_to_action_level():
  rng = np.random.default_rng(0)
  T, N, K = 3, 3, 4
  v = rng.normal(size=(T, N, K)).astype(np.float32)
  mask = np.arange(K) < rng.integers(1, K + 1, size=(T, N))[..., None]
  r, done = rng.normal(size=(T, N)).astype(np.float32), np.array([0, 1, 0])
  adv_tok, _ = ppo.token_level_advantages(r, v, mask, done, 0.3, 0.9, 0.8, gamma_token=1.0,
                                          lambda_token=1.0)
  adv_act, _ = ppo.action_level_advantages(r, v[..., 0], done, 0.3, 0.9, 0.8)
  np.testing.assert_allclose(adv_tok[..., 0], adv_act, atol=ATOL)


def test_token_level_empty_action_keeps_its_reward():
  # Agent 1 emits nothing; its reward reaches agent 0's last token through one agent hop.
  r = np.array([[0.0, 1.0, 0.0]])
  v = np.zeros((1, 3, 2))
  mask = np.array([[[1, 1], [0, 0], [1, 0]]], bool)
  adv, _ = ppo.token_level_advantages(r, v, mask, np.array([1]), 0.0, 0.9, 1.0)
  # By hand (v = 0, γ = 0.9, λ = 1): agent 0's last token gets γ·r = 0.9, its first token
  # one more token hop, 0.9·0.9.
  np.testing.assert_allclose(adv[0, 0], [0.9 * 0.9, 0.9], atol=ATOL)
  np.testing.assert_array_equal(adv[0, 1], 0.0)


def test_returns_are_jittable_and_vmappable():
  r, v, mask = token_vector_inputs()
  fn = jax.jit(lambda r, v, m: ppo.token_level_advantages(r, v, m, jnp.array([0, 1]), 0.9,
                                                          0.9, 0.5))
  batched = jax.vmap(fn)(np.stack([r, r]), np.stack([v, v]), np.stack([mask, mask]))
  np.testing.assert_allclose(batched[0][1], fn(r, v, mask)[0], atol=ATOL)


@pytest.mark.parametrize("seed", range(4))
def test_token_level_form_equals_the_trainers_turn_chain(seed):
  """`token_level_advantages` (the paper's regular [T, N, K] form, which also takes holes and
  empty actions) and the trainer's `turn_chain_advantages` agree on what both express: every
  action's tokens a prefix of its K slots, at least one each."""
  rng = np.random.default_rng(seed)
  T, N, K = 3, 2, 4
  lengths = rng.integers(1, K + 1, (T, N))
  mask = np.arange(K)[None, None] < lengths[..., None]
  v = rng.normal(0, 1, (T, N, K)).astype(np.float32)
  r = rng.normal(0, 1, (T, N)).astype(np.float32)
  done = np.zeros(T, bool)
  done[-1] = True
  hops = dict(gamma=0.9, lambda_=0.8, gamma_agent=0.95, lambda_agent=0.7)
  adv, _ = ppo.token_level_advantages(r, v, mask, done, 0.0, gamma_token=0.97,
                                      lambda_token=0.9, **hops)
  W = int(lengths.sum())
  step = np.repeat(np.arange(T), N)
  chain_adv, _ = ppo.turn_chain_advantages(
      step, ppo.layer_sees(step, np.tile(np.arange(N), T), np.ones(T * N)), np.ones(T * N, int),
      lengths.reshape(-1), np.zeros(T * N, np.float32), r.reshape(-1), np.repeat(done, N),
      v[mask], credit="per_step", gamma_token=0.97, lambda_token=0.9, **hops)
  np.testing.assert_allclose(np.asarray(chain_adv)[:W], np.asarray(adv)[mask], atol=1e-5)
