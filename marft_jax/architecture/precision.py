"""Matmul precision: what "float32" means on each platform.

On CPU an f32 matmul is f32. On NVIDIA GPUs (Ampere and later) XLA runs f32 matmuls as TF32
by default (10-bit mantissa): measured on an H200, SmolLM2-shaped logits in "f32" were
3.4e-3 from torch's f32 (4.8e-7 on CPU). TPUs likewise default to bf16 passes for f32. A run
therefore names its precision (`ModelSection.matmul_precision`), and "auto" keeps f32 exact:

  auto     "highest" for a float32 model, JAX's "default" for a bfloat16 one (its matmuls
           are bf16 already; the products accumulate in f32 either way).
  default  the platform's fastest (TF32 on NVIDIA, bf16 passes on TPU; exact f32 on CPU).
  high     TF32 on NVIDIA, 3 bf16 passes on TPU.
  highest  full f32 everywhere (slowest on accelerators).

The setting applies to everything traced inside `scope(...)` (JAX's
`jax.default_matmul_precision`); the trainer, evaluation and `launch.generate` enter it.
"""

import jax

PRECISIONS = ("auto", "default", "high", "highest")


def resolve(setting: str, param_dtype: str) -> str:
  """JAX's precision name for `setting` (one of PRECISIONS) and the model's dtype."""
  if setting not in PRECISIONS:
    raise ValueError(f"matmul_precision={setting!r}: use one of {PRECISIONS}")
  if setting != "auto":
    return setting
  return "highest" if param_dtype == "float32" else "default"


def scope(setting: str, param_dtype: str):
  """A context in which every traced matmul uses the resolved precision."""
  return jax.default_matmul_precision(resolve(setting, param_dtype))
