"""bench.iteration --ceiling's arithmetic and its bare loss (bench/flops.py, bench/ceiling.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import ceiling, flops
from marft_jax import lora as lora_lib
from marft_jax.lora.config import LoraConfig
from marft_jax.models import tiny
from marft_jax.models import transformer
from marft_jax.train.config import preset


def _with(config, **sections):
  return dataclasses.replace(config, **{name: dataclasses.replace(getattr(config, name), **kw)
                                        for name, kw in sections.items()})


def test_useful_flops_split_by_pass_by_hand():
  """N_L 1000, N_H 100, 300 tokens, 30 decisions: trained passes (policy epochs, a critic
  LoRA's steps) apart from forward-only ones (the frozen critic's hidden states, a KL
  term's base log-probs); the two sum to useful_flops."""
  policy = 4 * 1000 * 300 + 4 * 100 * 30
  frozen = preset("marft_a")  # 1 epoch, the frozen-base critic, no KL
  lora_kl = _with(frozen, optimizer=dict(epochs=2), critic=dict(lora_rank=4),
                  loss=dict(kl_coef=0.1))
  cases = [(frozen, (policy, 2 * 1000 * 300)),
           (lora_kl, (2 * policy + 4 * 2 * 1000 * 300,
                      2 * 1000 * 300 + 2 * (1000 * 300 + 100 * 30)))]
  for config, want in cases:
    got = flops.useful_flops_by_pass(config, 1000, 100, 300, 30)
    assert got == want
    assert flops.useful_flops(config, 1000, 100, 300, 30) == sum(want)


def test_update_ceiling_divides_each_part_by_its_rate():
  # 6 TFLOP trained at 2 TFLOP/s and 3 TFLOP forward at 3 TFLOP/s: 3 s + 1 s.
  assert flops.update_ceiling(6e12, 3e12, 2e12, 3e12) == pytest.approx(4.0)


def test_bare_loss_is_the_sum_of_next_token_log_probs():
  """ceiling.next_token_logp against log-softmax of the full forward's logits in NumPy,
  with each row through its own adapter (b made nonzero: the routing matters)."""
  params, config, _ = tiny.tiny_model()
  policy = lora_lib.init_adapters(LoraConfig(rank=2), config, jax.random.key(1), 2)
  policy = policy.replace(layers=jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), policy.layers))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 12)), jnp.int32)
  positions = jnp.asarray([[0, 4, 10], [2, 3, 5], [1, 7, 9]], jnp.int32)
  ids = jnp.asarray([0, 1, 0], jnp.int32)
  got = ceiling.next_token_logp(policy, params, tokens, positions, ids, config)
  want = 0.0
  for b in range(3):
    logits, _ = transformer.forward(params, tokens[b:b + 1], config, lora=policy,
                                    adapter_ids=ids[b:b + 1])
    z = np.asarray(logits[0], np.float64)
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(
        -1, keepdims=True)
    want += sum(logp[t, int(tokens[b, t + 1])] for t in np.asarray(positions[b]))
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_dense_rates_refuse_positions_without_a_next_token():
  params, config, _ = tiny.tiny_model()
  policy = lora_lib.init_adapters(LoraConfig(rank=2), config, jax.random.key(1), 1)
  with pytest.raises(ValueError, match="P=8"):
    ceiling.dense_rates(params, config, policy, rows=2, T=8, P=8, repeats=1)


def test_ceiling_command_prints_its_fractions(capsys):
  """`python -m bench.ceiling --tiny`: each figure printed, rates positive."""
  ceiling.main(["--tiny", "--rounds=1", "--rows=2", "--length=16", "--positions=4"])
  figures = dict(line.split("=") for line in capsys.readouterr().out.split())
  for name in ("machine_matmul_2048_gflop_s", "dense_fwd_bwd_s", "dense_fwd_bwd_fraction",
               "dense_fwd_s", "dense_fwd_fraction"):
    assert float(figures[name]) > 0, (name, figures)
