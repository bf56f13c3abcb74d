"""The FLOPs an update needs, and the prompt prefixes its rows share (`bench.iteration`'s
counts, without its command-line flags, so that tests can import them beside other benchmarks'
absl flags). The formula is in `bench/iteration.py`'s docstring."""

from __future__ import annotations

import numpy as np

from marft_jax.train.config import TrainConfig


def matmul_params(params, model_config) -> tuple[int, int]:
  """(N_L: parameters of the layers' matmuls, N_H: of the output projection)."""
  layers = params["layers"]
  kernels = [p["kernel"] for p in layers.values() if isinstance(p, dict) and "kernel" in p]
  head = params["embed"] if model_config.tie_word_embeddings else params["lm_head"]
  return sum(k.size for k in kernels), head.size


def useful_flops(config: TrainConfig, n_layers: int, n_head: int, tokens: float,
                 decisions: float) -> float:
  """The update's FLOPs the algorithm needs (the module docstring's formula)."""
  return sum(useful_flops_by_pass(config, n_layers, n_head, tokens, decisions))


def useful_flops_by_pass(config: TrainConfig, n_layers: int, n_head: int, tokens: float,
                         decisions: float) -> tuple[float, float]:
  """`useful_flops` split by the kind of pass that does them: (FLOPs in passes with a
  backward: the policy's epochs, a critic LoRA's training steps; FLOPs in forward-only
  passes: the frozen critic's hidden states, a critic LoRA's values at rollout time, the
  base's log-probs for a KL term). The two run at different rates (`update_ceiling`)."""
  epochs = config.optimizer.epochs
  trained = epochs * (4 * n_layers * tokens + 4 * n_head * decisions)
  forward = 0.0
  if config.uses_critic:
    if config.critic.lora_rank > 0:
      trained += 4 * epochs * n_layers * tokens
    forward += 2 * n_layers * tokens
  if config.loss.kl_coef > 0 or config.advantage.kl_reward_coef > 0:
    forward += 2 * (n_layers * tokens + n_head * decisions)
  return trained, forward


def update_ceiling(trained_flops: float, forward_flops: float, fwd_bwd_rate: float,
                   fwd_rate: float) -> float:
  """The seconds an update needs at the dense rates: its trained FLOPs at `fwd_bwd_rate`
  (FLOP/s of a bare forward + backward over rows with no padding) and its forward-only
  FLOPs at `fwd_rate` (of a bare forward). Useful FLOPs ÷ (this × the matmul peak) is the
  highest `update_useful_fraction` a trainer with no padding and no work but these passes
  reaches on the machine."""
  return trained_flops / fwd_bwd_rate + forward_flops / fwd_rate


def shared_prefix_tokens(batch) -> tuple[int, int]:
  """(tokens that start a row as another row of its episode starts, real tokens): per row,
  the longest prefix it shares with an earlier row of the same episode."""
  tokens, mask = np.asarray(batch.tokens), np.asarray(batch.mask)
  episode = np.asarray(batch.row_episode)
  shared = 0
  for r in range(tokens.shape[0]):
    n = int(mask[r].sum())
    best = 0
    for q in range(r):
      if not n or episode[q] != episode[r] or not mask[q].any():
        continue
      m = min(n, int(mask[q].sum()))
      same = np.flatnonzero(tokens[r, :m] != tokens[q, :m])
      best = max(best, m if same.size == 0 else int(same[0]))
    shared += best
  return shared, int(mask.sum())
