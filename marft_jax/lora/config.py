"""`LoraConfig`: rank, scaling, targets and dropout of a set of LoRA adapters.

A frozen, hashable dataclass (usable as a static jit argument). `init_adapters` reads it;
the `Adapters` it makes keep only what the forward needs: the scale and the dropout rate.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Union

from marft_jax.architecture.targets import LINEAR_TARGETS
from marft_jax.validation import check_positive_int, check_positive_number

ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Hyperparameters shared by every adapter of a stack (PEFT's `LoraConfig` subset).

  The update of a target linear layer W is `Δy = scale · dropout(x) @ a @ b` with
  `scale = alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA (Kalajdzievski 2023).
  """

  rank: int = 8  # R >= 1: each adapter's factors are a [in, R] and b [R, out]
  alpha: float = 16.0  # > 0: the update's scale is alpha / rank (alpha / √rank with rsLoRA)
  # The layers adapted: "all-linear" (q, k, v, o, gate, up, down), a tuple of target names,
  # or a regular expression that must match a whole target name (e.g. "q_proj|v_proj").
  targets: Union[str, tuple[str, ...]] = ALL_LINEAR
  # Dropout on the LoRA branch's input, in training only, in [0, 1) (PEFT's lora_dropout)
  dropout_rate: float = 0.0
  use_rslora: bool = False  # True: rsLoRA's scale alpha / √rank (Kalajdzievski 2023)

  def __post_init__(self):
    if not isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(self.targets))  # Lists would be unhashable.
    check_positive_int("rank", self.rank)
    check_positive_number("alpha", self.alpha)
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate={self.dropout_rate!r}: use a value in [0, 1)")
    self.target_names()  # Raises on unknown names or a pattern that matches nothing.

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

  def target_names(self) -> tuple[str, ...]:
    """The targets in the model's canonical order (`models.targets.LINEAR_TARGETS`)."""
    known = LINEAR_TARGETS
    if self.targets == ALL_LINEAR:
      return known
    if isinstance(self.targets, str):
      names = tuple(t for t in known if re.fullmatch(self.targets, t))
      if not names:
        raise ValueError(f"targets={self.targets!r} matches none of {known}")
      return names
    unknown = [t for t in self.targets if t not in known]
    if unknown or not self.targets:
      raise ValueError(f"targets={self.targets!r}: unknown {unknown}; choose from {known} "
                       f"or {ALL_LINEAR!r}")
    return tuple(t for t in known if t in self.targets)
