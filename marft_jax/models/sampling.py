"""`SamplingConfig`: how one agent (or the chat demo) samples, and the rules its values obey.

The rules live here once: `SamplingConfig.__post_init__` and `sampler.generate` both call
`check_sampling_args`, so a config file and a direct call refuse the same values with the same
messages.

Conventions (as in transformers): temperature 0 is greedy; `top_k=0` (or None) and `top_p=1`
(or None) switch the filter off; a `top_k` at least the vocabulary size keeps everything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from marft_jax.validation import check_int, check_range


def check_sampling_args(temperature: Any = 1.0, top_p: Any = None,
                        top_k: Optional[int] = None, prefix: str = "") -> None:
  """Raises ValueError naming the argument for a value the sampler cannot honour.

  Args:
    temperature: number or per-row array, finite and ≥ 0 (NaN, inf and negative values are
      refused: they would give NaN tokens, noise, or silently greedy rows).
    top_p: None, or number / per-row array in (0, 1] (0 would keep nothing, > 1 and NaN are
      ambiguous).
    top_k: None or an int ≥ 0 (0 = off).
    prefix: prepended to argument names in messages, e.g. "sampling.".
  """
  check_range(f"{prefix}temperature", temperature, 0.0, math.inf, high_open=True)
  if top_p is not None:
    check_range(f"{prefix}top_p", top_p, 0.0, 1.0, low_open=True)
  if top_k is not None:
    check_int(f"{prefix}top_k", top_k, low=0)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Generation settings of one agent (or of a chat demo)."""

  max_new_tokens: int = 96  # tokens to generate at most (≥ 1).
  temperature: float = 0.7  # the sampling temperature, ≥ 0; 0 = greedy.
  top_k: int = 0  # keep the k most probable tokens; 0 = off.
  top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off.

  def __post_init__(self):
    check_int("max_new_tokens", self.max_new_tokens, low=1)
    check_sampling_args(self.temperature, self.top_p, self.top_k)

  def generate_kwargs(self) -> dict:
    """The keyword arguments of `sampler.generate` these settings stand for."""
    return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                top_k=self.top_k or None, top_p=None if self.top_p >= 1 else self.top_p)
