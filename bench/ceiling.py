"""The rates an update's passes reach with no padding and no work around them: the ceiling of
`bench.iteration`'s `update_useful_fraction` on the machine (its `--ceiling`).

A bare jitted loss, the sum of the log-probs of the next token at P positions a row, over
`rows` rows of T real tokens (no padding column, random tokens: the time does not depend on
them), its gradient taken w.r.t. the LoRA adapters only (the base an argument, as in the
trainer's update; each row routed to one adapter, as the per-agent view routes them); and the
base's forward alone (the frozen critic's hidden states). Nothing else: no critic head, no
PPO terms, no optimizer step, no minibatch gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import best_time
from bench.flops import matmul_params
from marft_jax.lora.routing import Adapters
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig


def next_token_logp(policy: Adapters, params, tokens: jax.Array, positions: jax.Array,
                    adapter_ids: jax.Array, model_config: ModelConfig) -> jax.Array:
  """[] Σ_b Σ_p log π(tokens[b, at + 1] | tokens[b, :at + 1]), at = positions[b, p].

  tokens [B, T] all real; positions [B, P] in [0, T − 1); adapter_ids [B]."""
  h, _ = transformer.hidden_states(params, tokens, model_config, lora=policy,
                                   adapter_ids=adapter_ids)
  h = jnp.take_along_axis(h, positions[..., None], axis=1)  # [B, P, D]
  logits = transformer.logits_from_hidden(params, h, model_config)  # [B, P, V]
  taken = jnp.take_along_axis(tokens, positions + 1, axis=1)
  logp = jax.nn.log_softmax(logits)
  return jnp.sum(jnp.take_along_axis(logp, taken[..., None], axis=-1))


def dense_rates(params, model_config: ModelConfig, policy: Adapters, rows: int, T: int, P: int,
                repeats: int, seed: int = 0) -> tuple[float, float]:
  """(FLOP/s of the bare forward + backward, FLOP/s of the base's forward) over `rows` dense
  rows of T tokens with P scored positions each (P < T), best of `repeats` timings.

  FLOPs counted as `bench.flops.useful_flops` counts them: 4·N_L·tokens + 4·N_H·decisions for
  the forward + backward, 2·N_L·tokens for the forward (its output is the hidden states)."""
  if not 0 < P < T:
    raise ValueError(f"P={P}: scored positions must be in (0, T={T}) (each scores its next "
                     "token)")
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, model_config.vocab_size, (rows, T)), jnp.int32)
  positions = jnp.asarray(np.sort(np.stack([rng.choice(T - 1, P, replace=False)
                                            for _ in range(rows)]), axis=1), jnp.int32)
  adapter_ids = jnp.arange(rows, dtype=jnp.int32) % policy.num_adapters
  grad = jax.jit(jax.grad(next_token_logp), static_argnames="model_config")
  forward = jax.jit(lambda params, tokens: transformer.hidden_states(
      params, tokens, model_config)[0])
  n_layers, n_head = matmul_params(params, model_config)
  run_grad = lambda: grad(policy, params, tokens, positions, adapter_ids,
                          model_config=model_config)
  run_forward = lambda: forward(params, tokens)
  jax.block_until_ready((run_grad(), run_forward()))  # compiles
  fwd_bwd = (4 * n_layers * rows * T + 4 * n_head * rows * P) / best_time(run_grad, repeats)
  fwd = 2 * n_layers * rows * T / best_time(run_forward, repeats)
  return fwd_bwd, fwd
