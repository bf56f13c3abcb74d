"""KL estimators, KL penalty and KL-in-reward, approx-KL."""

import numpy as np
import pytest

from marft_jax import ppo
from marft_jax.ppo.kl import KL_ESTIMATORS

ATOL = 1e-5


def test_kl_estimators_match_formulas():
  rng = np.random.default_rng(1)
  logp, ref = -rng.random(8) * 3, -rng.random(8) * 3
  log_r = ref - logp
  np.testing.assert_allclose(ppo.kl_k1(logp, ref), -log_r, atol=ATOL)
  np.testing.assert_allclose(ppo.kl_k2(logp, ref), 0.5 * log_r**2, atol=ATOL)
  np.testing.assert_allclose(ppo.kl_k3(logp, ref), np.exp(log_r) - 1 - log_r, atol=ATOL)
  assert np.all(np.asarray(ppo.kl_k3(logp, ref)) >= 0)


def test_estimators_by_name():
  assert KL_ESTIMATORS == {"k1": ppo.kl_k1, "k2": ppo.kl_k2, "k3": ppo.kl_k3}


def test_kl_estimators_are_unbiased_on_a_categorical():
  # Two arbitrary distributions; KL(p ‖ q) is computed exactly from them below.
  p = np.array([0.5, 0.3, 0.2])
  q = np.array([0.2, 0.2, 0.6])
  kl = np.sum(p * np.log(p / q))
  logp, ref = np.log(p).astype(np.float32), np.log(q).astype(np.float32)
  for estimator in (ppo.kl_k1, ppo.kl_k3):  # exact expectations, summed over the support
    np.testing.assert_allclose(np.sum(p * np.asarray(estimator(logp, ref))), kl, atol=ATOL)


@pytest.mark.parametrize("estimator", [ppo.kl_k1, ppo.kl_k2, ppo.kl_k3])
def test_kl_penalty_and_reward_are_masked(estimator):
  rng = np.random.default_rng(2)
  logp, ref = -rng.random(8), -rng.random(8)
  mask = rng.random(8) < 0.5
  mask[0] = True
  logp_garbage = np.where(mask, logp, 1e4)
  per_token = np.asarray(estimator(logp, ref))
  np.testing.assert_allclose(ppo.kl_penalty(logp_garbage, ref, mask, estimator),
                             per_token[mask].mean(), atol=ATOL)
  np.testing.assert_allclose(ppo.kl_reward(logp_garbage, ref, mask, 0.1, estimator),
                             np.where(mask, -0.1 * per_token, 0.0), atol=ATOL)
  assert ppo.kl_penalty(logp, ref, np.zeros(8), estimator) == 0.0


def test_approx_kl_is_the_original_formula():
  rng = np.random.default_rng(3)
  logp, old = -rng.random(8), -rng.random(8)
  ratio = np.exp(logp - old)
  np.testing.assert_allclose(ppo.approx_kl(logp, old, np.ones(8)),
                             np.mean((ratio - 1) - np.log(ratio)), atol=ATOL)
