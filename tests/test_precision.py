"""Matmul precision: the setting's meaning, and that it reaches the compiled program.

Reference: the StableHLO text of a lowered matmul, which names the precision XLA is asked
for (on CPU every precision computes exact f32, so the numbers cannot tell them apart)."""

import jax
import jax.numpy as jnp
import pytest

from marft_jax.architecture import precision
from marft_jax.train.config import ModelSection


def _dot_precision() -> str:
  x = jnp.ones((4, 4), jnp.float32)
  text = jax.jit(lambda a, b: a @ b).lower(x, x).as_text()
  line = next(line for line in text.splitlines() if "dot_general" in line)
  return line.split("precision = [")[1].split(",")[0]


@pytest.mark.parametrize("setting, dtype, expected", [
    ("auto", "float32", "HIGHEST"), ("auto", "bfloat16", "DEFAULT"),
    ("default", "float32", "DEFAULT"), ("high", "float32", "HIGH"),
    ("highest", "bfloat16", "HIGHEST")])
def test_the_scope_sets_the_precision_of_every_traced_matmul(setting, dtype, expected):
  outside = _dot_precision()
  with precision.scope(setting, dtype):
    assert _dot_precision() == expected
  assert _dot_precision() == outside == "DEFAULT"  # left as it was


def test_an_unknown_precision_is_refused_naming_the_key():
  with pytest.raises(ValueError, match="matmul_precision='tf32'"):
    precision.resolve("tf32", "float32")
  with pytest.raises(ValueError, match="matmul_precision='tf32'"):
    ModelSection(matmul_precision="tf32")
