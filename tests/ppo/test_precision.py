"""Every ppo function computes in float32 or wider: bfloat16 inputs (log-probs, values, rewards
straight from a bf16 model) give the float32 results of the same values, never bf16 ones.

References: NumPy float64 on the bf16-rounded inputs for the two cases where bf16 arithmetic
was measured wrong (a reply's log-likelihood and k3 of a small log-ratio), and for every
public function, the function itself on the same values given as float32 (casting bf16 up is
exact, so the results must be identical).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo
from marft_jax.ppo.policy_loss import importance_weights


def _bf16(x):
  return jnp.asarray(x, jnp.bfloat16)


def _exact(x):
  """The bf16-rounded values of x, in float64."""
  return np.asarray(_bf16(x), np.float64)


def test_a_ratio_of_long_replies_from_bf16_token_log_probs():
  """200-token replies: each log-likelihood is about −119, which bf16 rounds to a multiple of
  0.5. Summed and divided in bf16, the PPO ratio of 1.147 came out as exactly 1."""
  rng = np.random.default_rng(0)
  new = rng.normal(-0.6, 0.4, 200)
  old = new + rng.normal(0.0, 0.01, 200)
  mask = np.ones(200)
  logp, old_logp = (ppo.action_log_prob(_bf16(x), _bf16(mask)) for x in (new, old))
  want_logp, want_old = _exact(new).sum(), _exact(old).sum()
  want_ratio = np.exp(want_logp - want_old)
  assert abs(want_ratio - 1.0) > 0.1  # the case discriminates: bf16 sums gave a ratio of 1
  assert logp.dtype == old_logp.dtype == jnp.float32
  np.testing.assert_allclose([logp, old_logp], [want_logp, want_old], rtol=1e-6)
  adv = jnp.ones((1,), jnp.bfloat16)
  loss = ppo.ppo_clip_loss(logp[None], old_logp[None], adv, adv, epsilon=0.2)
  np.testing.assert_allclose(loss, -min(want_ratio, 1.2), rtol=1e-5)


def test_k3_of_small_log_ratios_from_bf16_log_probs():
  """k3 = (r − 1) − log r ≈ ½ (log r)² is a difference of terms 200 times its size: in bf16,
  26 of these 64 came out 0 and the median error was 2 %."""
  rng = np.random.default_rng(1)
  logp = rng.normal(-1.0, 0.3, 64)
  ref = logp + rng.normal(0.0, 0.01, 64)
  log_r = _exact(ref) - _exact(logp)
  want = np.expm1(log_r) - log_r
  got = ppo.kl_k3(_bf16(logp), _bf16(ref))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-9)


def _cases():
  """(name, function, float arguments, other arguments), for every public function with
  float inputs."""
  rng = np.random.default_rng(2)
  n = 24
  x = lambda scale=1.0, loc=0.0: rng.normal(loc, scale, n)
  mask = (rng.random(n) < 0.8).astype(np.float32)
  logp, old, ref = x(0.5, -1.0), x(0.5, -1.0), x(0.5, -1.0)
  adv, v, old_v, ret = x(), x(), x(), x()
  groups, agents = np.arange(n) % 3, (np.arange(n) // 3) % 2
  clip = dict(epsilon=0.2)
  return [
      ("masked_sum", ppo.masked_sum, (adv,), (mask,)),
      ("masked_mean", ppo.masked_mean, (adv,), (mask,)),
      ("action_log_prob", ppo.action_log_prob, (logp,), (mask,)),
      ("action_log_prob_per_token", ppo.action_log_prob_per_token, (logp,), (mask,)),
      ("ppo_clip_loss", lambda a, b, c, m: ppo.ppo_clip_loss(a, b, c, m, **clip),
       (logp, old, adv), (mask,)),
      ("clipped_surrogate", lambda a, b: ppo.clipped_surrogate(a, b, 0.2, dual_clip=3.0),
       (np.exp(logp - old), adv), ()),
      ("decoupled_ppo_loss",
       lambda a, b, c, d, m: ppo.decoupled_ppo_loss(a, b, c, d, m, imp_weight_cap=1.5, **clip),
       (logp, old, ref, adv), (mask,)),
      ("importance_weights", lambda a, b, m: importance_weights(a, b, m, 1.5),
       (old, ref), (mask,)),
      ("clip_fraction", lambda a, b, m: ppo.clip_fraction(a, b, m, 0.2), (logp, old), (mask,)),
      ("approx_kl", ppo.approx_kl, (logp, old), (mask,)),
      ("kl_k1", ppo.kl_k1, (logp, ref), ()),
      ("kl_k2", ppo.kl_k2, (logp, ref), ()),
      ("kl_k3", ppo.kl_k3, (logp, ref), ()),
      ("kl_penalty", ppo.kl_penalty, (logp, ref), (mask,)),
      ("kl_reward", lambda a, b, m: ppo.kl_reward(a, b, m, 0.1), (logp, ref), (mask,)),
      ("huber_loss", lambda e: ppo.huber_loss(e, 0.5), (adv,), ()),
      ("clipped_value_loss", lambda a, b, c, m: ppo.clipped_value_loss(a, b, c, m, 0.2),
       (v, old_v, ret), (mask,)),
      ("clipped_huber_value_loss",
       lambda a, b, c, m: ppo.clipped_huber_value_loss(a, b, c, m, 0.5, 0.2),
       (v, old_v, ret), (mask,)),
      ("shape_rewards", lambda r: ppo.shape_rewards(r, scale=2.0, bias=0.5, clip=1.0),
       (adv,), ()),
      ("normalize", ppo.normalize, (adv,), (mask,)),
      ("agent_group_normalize",
       lambda a, m, g, b: ppo.agent_group_normalize(a, m, g, b, 3, 2, leave_one_out=True),
       (adv,), (mask, groups, agents)),
      ("masked_gae", lambda r, d, v, m: ppo.masked_gae(r, d, 0.95, v, m, 0.3),
       (ret, np.full(n, 0.99), v), (mask,)),
      ("logprobs_and_entropy", lambda z, w: ppo.logprobs_and_entropy(z, w, temperature=0.7),
       (rng.normal(0.0, 3.0, (n, 50)),), (rng.integers(0, 50, n),)),
  ]


CASES = _cases()


@pytest.mark.parametrize("name, fn, floats, others", CASES, ids=[c[0] for c in CASES])
def test_bf16_inputs_give_the_float32_results_of_their_values(name, fn, floats, others):
  got = fn(*(_bf16(a) for a in floats), *others)
  want = fn(*(jnp.asarray(_bf16(a), jnp.float32) for a in floats), *others)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
    assert w.dtype in (jnp.float32, jnp.bool_), (name, w.dtype)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
