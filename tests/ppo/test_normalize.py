"""Reward shaping and masked normalisation (batch, group, agent within group) vs NumPy loops."""

import numpy as np
import pytest

from marft_jax import ppo

ATOL = 1e-5


def np_pool_normalize(x, mask, pool, *, center=True, scale=True, leave_one_out=False,
                      unbiased=False, eps=1e-5):
  """Loop over pools; each element is normalised against the valid members of its pool."""
  x, mask, pool = x.ravel(), mask.ravel().astype(bool), pool.ravel()
  out = np.zeros_like(x, dtype=np.float64)
  for p in set(pool[mask].tolist()):
    members = [j for j in range(len(x)) if mask[j] and pool[j] == p]
    vals = np.array([x[j] for j in members], np.float64)
    n, mean = len(vals), vals.mean()
    std = np.sqrt(((vals - mean) ** 2).sum() / max(n - int(unbiased), 1))
    for j in members:
      if not center:
        base = 0.0
      elif leave_one_out:
        base = (vals.sum() - x[j]) / (n - 1) if n > 1 else x[j]
      else:
        base = mean
      out[j] = (x[j] - base) / (std + eps) if scale else x[j] - base
  return out


def test_shape_rewards():
  # By hand: (r − 0.5)·10 = [−35, −5, 5, 295], clipped to ±20.
  r = np.array([-3.0, 0.0, 1.0, 30.0])
  np.testing.assert_allclose(ppo.shape_rewards(r, 10.0, -0.5), (r - 0.5) * 10.0)
  np.testing.assert_allclose(ppo.shape_rewards(r, 10.0, -0.5, clip=20.0), [-20, -5, 5, 20])


def test_normalize_counts_genuine_zeros_and_ignores_padding():
  # Hand-chosen: two genuine zeros and two padding slots; expected from the formula.
  x = np.array([0.0, 0.0, 1.0, 3.0, 99.0, -7.0], np.float32)
  mask = np.array([1, 1, 1, 1, 0, 0], bool)  # two genuine zeros, two padding slots
  got = np.asarray(ppo.normalize(x, mask))
  genuine = x[:4]
  np.testing.assert_allclose(got[:4], (genuine - genuine.mean()) / (genuine.std() + 1e-5),
                             atol=ATOL)
  np.testing.assert_array_equal(got[4:], 0.0)
  # The original's rule (drop exact zeros) pools only {1, 3} and so gives other values
  # (reference defect D7, docs/references.md).
  nonzero = x[(x != 0) & mask]
  assert not np.allclose(got[2:4], (nonzero - nonzero.mean()) / (nonzero.std() + 1e-8))


@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("mask_kind", ["all", "none", "one", "random"])
def test_normalize_matches_numpy(unbiased, mask_kind):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5)).astype(np.float32)
  mask = {"all": np.ones((3, 5)), "none": np.zeros((3, 5)), "one": np.eye(1, 15).reshape(3, 5),
          "random": rng.random((3, 5)) < 0.5}[mask_kind].astype(bool)
  expected = np_pool_normalize(x, mask, np.zeros((3, 5), int), unbiased=unbiased)
  np.testing.assert_allclose(np.asarray(ppo.normalize(x, mask, unbiased=unbiased)).ravel(),
                             expected, atol=1e-4)


@pytest.mark.parametrize("options", [
    {}, {"leave_one_out": True}, {"scale": False}, {"center": False}, {"unbiased": True},
    {"leave_one_out": True, "scale": False}])
def test_one_agent_pools_by_group_and_matches_numpy(options):
  rng = np.random.default_rng(1)
  B, G = 24, 5  # group 4 gets no member, some groups a single valid one
  x = rng.normal(size=B).astype(np.float32)
  groups = rng.integers(0, G - 1, size=B)
  mask = rng.random(B) < 0.7
  got = ppo.agent_group_normalize(x, mask, groups, np.zeros(B, int), G, 1, **options)
  np.testing.assert_allclose(got, np_pool_normalize(x, mask, groups, **options), atol=1e-4)


def test_grpo_groups_of_rollouts():
  # 2 prompts x 4 rollouts; the last rollout of prompt 1 is padding.
  x = np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 5.0]], np.float32)
  mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
  groups, agents = np.array([[0] * 4, [1] * 4]), np.zeros((2, 4), int)
  got = np.asarray(ppo.agent_group_normalize(x, mask, groups, agents, 2, 1))
  # By hand: group 0 = {1, 0, 0, 1} has mean 0.5 and std 0.5, so ±1; group 1 by the formula.
  np.testing.assert_allclose(got[0], [1, -1, -1, 1], atol=1e-4)
  np.testing.assert_allclose(got[1, :3], (np.array([0, 0, 1]) - 1 / 3) / np.std([0, 0, 1]),
                             atol=1e-4)
  assert got[1, 3] == 0.0
  loo = np.asarray(ppo.agent_group_normalize(x, mask, groups, agents, 2, 1,
                                             leave_one_out=True, scale=False))
  # By hand: each element minus the mean of the other three (1/3 for a 1, 2/3 for a 0).
  np.testing.assert_allclose(loo[0], [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], atol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_agent_group_normalize_matches_numpy(seed):
  # Per-token rewards [B, T] with agent ids per token (−1 on prompt tokens).
  rng = np.random.default_rng(seed)
  B, T, G, A = 6, 8, 3, 3
  x = rng.normal(size=(B, T)).astype(np.float32) + np.arange(T)  # agents on different scales
  agents = rng.integers(-1, A, size=(B, T))
  groups = np.repeat(np.arange(G), B // G)[:, None].repeat(T, 1)
  mask = (agents >= 0) & (rng.random((B, T)) < 0.8)
  got = ppo.agent_group_normalize(x, mask, groups, agents, G, A, leave_one_out=bool(seed % 2))
  expected = np_pool_normalize(x, mask, groups * A + agents, leave_one_out=bool(seed % 2))
  np.testing.assert_allclose(np.asarray(got).ravel(), expected, atol=1e-4)
