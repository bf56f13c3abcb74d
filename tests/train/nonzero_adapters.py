"""Adapters for update tests: LoRA starts with B = 0 (every adapter then computes the base),
so tests that tell adapters apart perturb every factor."""

import jax

from marft_jax import lora as lora_lib


def nonzero_adapters(model_config, count: int = 2):
  """`count` rank-4 adapters with nonzero factors that differ per adapter: every route then
  changes the outputs."""
  policy = lora_lib.init_adapters(lora_lib.LoraConfig(rank=4, alpha=8.0), model_config,
                                  jax.random.key(1), count)
  return policy.replace(layers=jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), policy.layers))
