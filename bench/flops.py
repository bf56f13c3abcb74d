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
  epochs = config.optimizer.epochs
  flops = epochs * (4 * n_layers * tokens + 4 * n_head * decisions)
  if config.uses_critic:
    lora = config.critic.lora_rank > 0
    flops += (4 * epochs + 2 if lora else 2) * n_layers * tokens
  if config.loss.kl_coef > 0 or config.advantage.kl_reward_coef > 0:
    flops += 2 * (n_layers * tokens + n_head * decisions)
  return flops


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
