"""Cost of routing several agents' adapters through one forward + backward.

MARFT on AReaL runs one full forward + backward per adapter (N passes for N agents). marft_jax
routes every token through its own agent's adapter inside one pass. This measures, in one run,
the gradient step (w.r.t. the adapters only, base frozen) of:

  single    one adapter, every token through it (per-sequence ids): the reference;
  routed2   2 adapters, each row switching agent mid-way (per-token ids);
  routed4   4 adapters, each row holding 4 agents' turns (per-token ids);

on the same tokens, and prints `name=value` lines with the ratios routed/single, among them
`multi_adapter_cost_ratio_2_agents=` and `multi_adapter_cost_ratio_4_agents=` (median
over the repeats; target ≤ 1.3).

The model is shaped like SmolLM2-135M (D 576, 9 heads, 3 kv heads, F 1536, vocab 49152, tied)
with random weights and, to keep the run short, fewer layers than its 30. `--head` picks what
the loss sees: "none" (the decoder's hidden states; the LoRA share of the work is then that of
an arbitrarily deep model, the stricter case) or "lm" (next-token NLL through the vocab
projection, whose share of the work grows as layers are dropped). Timings on a shared CPU are
noisy: the configurations run interleaved and the minimum and the median over repeats are
reported.

    python -m bench.lora --layers 4 --batch 4 --time 128 --rank 32 --repeats 7
    python -m bench.lora --tiny    # seconds-long smoke run on the tiny test model
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import SMOLLM2_SHAPE
from marft_jax import lora
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig, tiny_config

SMOLLM2_LAYERS = 30


def smollm2_shaped(num_layers: int) -> ModelConfig:
  return SMOLLM2_SHAPE.replace(num_layers=num_layers)


def agent_turns(batch: int, time_: int, num_agents: int) -> np.ndarray:
  """[B, T] per-token ids: each row is cut into `num_agents` turns, rotated from row to row, so
  every row switches agents mid-way and every agent appears in every position range."""
  turn = np.minimum(np.arange(time_) * num_agents // time_, num_agents - 1)
  return np.stack([(turn + row) % num_agents for row in range(batch)]).astype(np.int32)


def loss_fn(adapters, params, tokens, ids, config: ModelConfig, head: str):
  if head == "lm":
    logits, _ = transformer.forward(params, tokens, config, lora=adapters, adapter_ids=ids)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  h, _ = transformer.hidden_states(params, tokens, config, lora=adapters, adapter_ids=ids)
  return jnp.mean(jnp.square(h.astype(jnp.float32)))


def trained_adapters(config: ModelConfig, rank: int, num_adapters: int, rng) -> lora.Adapters:
  """Adapters with B ≠ 0 (as after some training), so no branch is trivially zero."""
  adapters = lora.init_adapters(lora.LoraConfig(rank=rank, alpha=16.0), config, rng,
                                num_adapters)
  return adapters.replace(layers={
      name: dict(w, b=jnp.full_like(w["b"], 1e-3)) for name, w in adapters.layers.items()})


def time_interleaved(steps: dict, repeats: int) -> dict[str, list[float]]:
  """Runs every step once to compile, then `repeats` rounds of each, interleaved."""
  for step in steps.values():
    jax.block_until_ready(step())
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      start = time.perf_counter()
      jax.block_until_ready(step())
      times[name].append(time.perf_counter() - start)
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--time", type=int, default=128)
  parser.add_argument("--rank", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--head", choices=["none", "lm"], default="none")
  parser.add_argument("--tiny", action="store_true",
                      help="smoke run on the tiny test model (the figures mean nothing)")
  args = parser.parse_args()
  if args.tiny:
    args.layers, args.batch, args.time, args.rank, args.repeats = 2, 2, 16, 4, 1

  config = tiny_config() if args.tiny else smollm2_shaped(args.layers)
  # RngBitGenerator keys: threefry would take longer to compile than the benchmark to run.
  rng = jax.random.key(0, impl="rbg")
  params = jax.jit(transformer.init_params, static_argnums=0)(config, rng)
  tokens = jax.random.randint(jax.random.fold_in(rng, 1), (args.batch, args.time), 0,
                              config.vocab_size)
  grad = jax.jit(lora.trainable_value_and_grad(
      functools.partial(loss_fn, config=config, head=args.head)))
  cases = {"single": (1, np.zeros((args.batch,), np.int32)),
           "routed2": (2, agent_turns(args.batch, args.time, 2)),
           "routed4": (4, agent_turns(args.batch, args.time, 4))}
  steps = {}
  for name, (num_adapters, ids) in cases.items():
    adapters = trained_adapters(config, args.rank, num_adapters, jax.random.fold_in(rng, 2))
    steps[name] = functools.partial(grad, adapters, params, tokens, jnp.asarray(ids))
  times = time_interleaved(steps, args.repeats)

  if args.tiny:
    print("model=tiny test model (smoke run: the figures mean nothing)")
  else:
    print(f"model=SmolLM2-135M-shaped random weights, {args.layers} of {SMOLLM2_LAYERS} "
          "layers (fewer to keep the run short)")
  print(f"setup=batch {args.batch}x{args.time} tokens, rank {args.rank}, all-linear targets, "
        f"loss head {args.head}, grads w.r.t. adapters only, {args.repeats} interleaved repeats")
  for name, ts in times.items():
    print(f"{name}_min_s={min(ts):.4f}")
    print(f"{name}_median_s={statistics.median(ts):.4f}")
  for agents in (2, 4):
    name = f"routed{agents}"
    median_ratio = statistics.median(times[name]) / statistics.median(times["single"])
    print(f"ratio_{name}_vs_single_min={min(times[name]) / min(times['single']):.3f}")
    print(f"ratio_{name}_vs_single_median={median_ratio:.3f}")
    print(f"multi_adapter_cost_ratio_{agents}_agents={median_ratio:.3f}")


if __name__ == "__main__":
  main()
