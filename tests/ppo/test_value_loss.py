"""Critic losses against NumPy loops, and Huber's missing branch (reference defect D12,
docs/references.md)."""

import numpy as np
import pytest

from marft_jax import ppo

ATOL = 1e-5


def np_huber(e, delta):
  return 0.5 * e * e if abs(e) <= delta else delta * (abs(e) - 0.5 * delta)


def np_value_loss(v, old_v, ret, mask, clip_eps, error):
  total, count = 0.0, 0
  for t in range(len(v)):
    if not mask[t]:
      continue
    loss = error(ret[t] - v[t])
    if clip_eps is not None:
      v_clipped = old_v[t] + min(max(v[t] - old_v[t], -clip_eps), clip_eps)
      loss = max(loss, error(ret[t] - v_clipped))
    total, count = total + loss, count + 1
  return total / max(count, 1)


def test_huber_handles_both_signs():
  # Errors on both sides of ±δ and at it; h(−25) = 10·(25 − 5) = 200 by hand.
  e = np.array([-25.0, -10.0, -3.0, 0.0, 3.0, 10.0, 25.0])
  expected = [np_huber(x, 10.0) for x in e]
  np.testing.assert_allclose(ppo.huber_loss(e, 10.0), expected, atol=ATOL)
  assert ppo.huber_loss(np.float32(-25.0), 10.0) == 200.0  # the original returned 0 here


@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("mask_kind", ["all", "none", "random"])
def test_value_losses_match_numpy(clip_eps, mask_kind):
  rng = np.random.default_rng(0)
  T = 11
  v, old_v = rng.normal(size=T), rng.normal(size=T)
  ret = rng.normal(size=T) * 15  # errors beyond δ in both directions
  mask = {"all": np.ones(T, bool), "none": np.zeros(T, bool),
          "random": rng.random(T) < 0.5}[mask_kind]
  np.testing.assert_allclose(
      ppo.clipped_value_loss(v, old_v, ret, mask, clip_eps),
      np_value_loss(v, old_v, ret, mask, clip_eps, lambda e: 0.5 * e * e), rtol=1e-5, atol=ATOL)
  np.testing.assert_allclose(
      ppo.clipped_huber_value_loss(v, old_v, ret, mask, 10.0, clip_eps),
      np_value_loss(v, old_v, ret, mask, clip_eps, lambda e: np_huber(e, 10.0)), rtol=1e-5,
      atol=ATOL)
