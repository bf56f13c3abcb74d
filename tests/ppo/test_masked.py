"""Masked reductions: garbage in padding never leaks, an all-masked input gives 0."""

import numpy as np
import pytest

from marft_jax import ppo


@pytest.mark.parametrize("seed", range(3))
def test_masked_reductions_match_numpy(seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(4, 5)).astype(np.float32)
  mask = rng.random((4, 5)) < 0.5
  total = sum(x[i, j] for i in range(4) for j in range(5) if mask[i, j])
  count = int(mask.sum())
  np.testing.assert_allclose(ppo.masked_sum(x, mask), total, atol=1e-5)
  np.testing.assert_allclose(ppo.masked_count(mask), count)
  np.testing.assert_allclose(ppo.masked_mean(x, mask), total / max(count, 1), atol=1e-5)


def test_padding_with_nan_and_all_masked():
  # By hand: the valid elements are 1 and 3, mean 2; an all-masked mean is 0 by definition.
  x = np.array([1.0, np.nan, np.inf, 3.0], np.float32)
  mask = np.array([1, 0, 0, 1])
  assert ppo.masked_mean(x, mask) == 2.0
  assert ppo.masked_mean(x, np.zeros(4)) == 0.0
  assert ppo.masked_sum(np.zeros(0), np.zeros(0)) == 0.0
