"""Policy losses: hand-computed cases and NumPy loops written from the formulas."""

import numpy as np
import pytest

from marft_jax import ppo
from marft_jax.ppo import policy_loss

ATOL = 1e-5


def np_surrogate(ratio, adv, eps, eps_high=None, dual=None):
  eps_high = eps if eps_high is None else eps_high
  out = np.zeros(len(ratio))
  for t, (rho, a) in enumerate(zip(ratio, adv)):
    loss = max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps_high))
    if dual is not None and a < 0:
      loss = min(loss, -dual * a)
    out[t] = loss
  return out


def np_masked_mean(x, mask):
  return sum(x[t] for t in range(len(x)) if mask[t]) / max(mask.sum(), 1)


def random_case(rng, T, mask_kind):
  logp = -rng.random(T) * 2
  old = logp + rng.normal(size=T) * 0.4
  adv = rng.normal(size=T)
  mask = {"all": np.ones(T, bool), "none": np.zeros(T, bool), "one": np.eye(T, dtype=bool)[0],
          "random": rng.random(T) < 0.5}[mask_kind]
  return logp, old, adv, mask


def test_clipped_surrogate_by_hand():
  # By hand, ℓ = max(−Aρ, −A clip(ρ)): ρ = 1.5, A = 1 → −1.2 (clipped); ρ = 0.5, A = 1 → −0.5;
  # ρ = 0.5, A = −1 → 0.8 (clipped); ρ = 3, A = −1 → 3, or c·|A| = 2 with the dual clip c = 2;
  # with ε_high = 0.4 the upper clip is 1.4.
  ratio = np.array([1.5, 0.5, 0.5, 3.0, 1.5])
  adv = np.array([1.0, 1.0, -1.0, -1.0, 1.0])
  np.testing.assert_allclose(ppo.clipped_surrogate(ratio, adv, 0.2),
                             [-1.2, -0.5, 0.8, 3.0, -1.2], atol=ATOL)
  np.testing.assert_allclose(ppo.clipped_surrogate(ratio, adv, 0.2, dual_clip=2.0),
                             [-1.2, -0.5, 0.8, 2.0, -1.2], atol=ATOL)
  np.testing.assert_allclose(ppo.clipped_surrogate(ratio, adv, 0.2, epsilon_high=0.4),
                             [-1.4, -0.5, 0.8, 3.0, -1.4], atol=ATOL)


@pytest.mark.parametrize("mask_kind", ["all", "none", "one", "random"])
@pytest.mark.parametrize("eps_high,dual", [(None, None), (0.28, None), (None, 3.0)])
def test_ppo_clip_loss_matches_numpy(mask_kind, eps_high, dual):
  rng = np.random.default_rng(0)
  logp, old, adv, mask = random_case(rng, 9, mask_kind)
  expected = np_masked_mean(np_surrogate(np.exp(logp - old), adv, 0.2, eps_high, dual), mask)
  got = ppo.ppo_clip_loss(logp, old, adv, mask, 0.2, eps_high, dual)
  np.testing.assert_allclose(got, expected, atol=ATOL)


def test_ppo_clip_loss_action_level_rank_2():
  # Action level: one ratio per (sample, agent), log-probs summed over each action.
  rng = np.random.default_rng(1)
  logp, old, adv = (rng.normal(size=(4, 3)) * 0.3 for _ in range(3))
  expected = np_surrogate(np.exp(logp - old).ravel(), adv.ravel(), 0.2).mean()
  np.testing.assert_allclose(ppo.ppo_clip_loss(logp, old, adv, np.ones((4, 3)), 0.2), expected,
                             atol=ATOL)


@pytest.mark.parametrize("mask_kind", ["all", "none", "random"])
@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_ppo_loss_matches_numpy(mask_kind, cap):
  rng = np.random.default_rng(2)
  logp, prox, adv, mask = random_case(rng, 9, mask_kind)
  behav = prox + rng.normal(size=9) * 0.4
  weight = np.exp(prox - behav)
  per_token = np_surrogate(np.exp(logp - prox), adv, 0.2) * weight
  keep = mask & (weight <= cap) if cap is not None else mask
  expected = sum(per_token[t] for t in range(9) if keep[t]) / max(mask.sum(), 1)
  got = ppo.decoupled_ppo_loss(logp, prox, behav, adv, mask, 0.2, imp_weight_cap=cap)
  np.testing.assert_allclose(got, expected, atol=ATOL)


@pytest.mark.parametrize("cap", [None, 1.3])
def test_importance_weights_match_numpy(cap):
  rng = np.random.default_rng(5)
  _, prox, _, mask = random_case(rng, 9, "random")
  behav = prox + rng.normal(size=9) * 0.4
  weight, keep = ppo.importance_weights(prox, behav, mask, cap)
  want = np.where(mask, np.exp(prox - behav), 1.0)  # masked elements: w = 1
  np.testing.assert_allclose(weight, want, rtol=1e-5)
  want_keep = mask & (want <= cap) if cap is not None else mask
  np.testing.assert_array_equal(keep, want_keep)
  if cap is not None:
    assert 0 < want_keep.sum() < mask.sum()  # the cap dropped some, kept some
  with pytest.raises(ValueError, match="imp_weight_cap=0"):
    ppo.importance_weights(prox, behav, mask, 0.0)


def test_importance_weights_is_exported():
  # Public, documented, and what the trainer's update calls; it was reachable only by its module.
  assert ppo.importance_weights is policy_loss.importance_weights


def test_decoupled_ppo_is_ppo_when_behaviour_is_proximal():
  logp, old, adv, mask = random_case(np.random.default_rng(3), 9, "random")
  np.testing.assert_allclose(ppo.decoupled_ppo_loss(logp, old, old, adv, mask, 0.2, 0.3, 2.0),
                             ppo.ppo_clip_loss(logp, old, adv, mask, 0.2, 0.3, 2.0), atol=ATOL)


@pytest.mark.parametrize("mask_kind", ["all", "none", "one", "random"])
def test_action_level_ppo_on_mean_logprobs_is_gspo(mask_kind):
  # GSPO (Zheng et al. 2025): ℓ(s, A) with s = exp of the mean per-token log-ratio; the
  # trainer's action level with loss.action_logprob="mean".
  rng = np.random.default_rng(4)
  logp, old, _, mask = random_case(rng, 9, mask_kind)
  adv = -0.7
  if mask.any():
    ratio = np.exp(np.mean((logp - old)[mask]))
    expected = np_surrogate([ratio], [adv], 0.05)[0]
  else:
    expected = 0.0
  per_token_logp = ppo.action_log_prob_per_token(logp, mask)
  per_token_old = ppo.action_log_prob_per_token(old, mask)
  np.testing.assert_allclose(
      ppo.ppo_clip_loss(per_token_logp, per_token_old, np.float32(adv), np.float32(1.0), 0.05)
      * mask.any(), expected, atol=ATOL)


@pytest.mark.parametrize("eps_high", [None, 0.3])
def test_clip_fraction_matches_numpy(eps_high):
  logp, old, _, mask = random_case(np.random.default_rng(5), 20, "random")
  ratio = np.exp(logp - old)
  high = 0.2 if eps_high is None else eps_high
  outside = (ratio < 0.8) | (ratio > 1 + high)
  np.testing.assert_allclose(ppo.clip_fraction(logp, old, mask, 0.2, eps_high),
                             np_masked_mean(outside.astype(float), mask), atol=ATOL)
