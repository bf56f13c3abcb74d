"""Test-wide JAX settings: f32 on CPU, and no silent rank promotion."""

import os

# Sharding tests need several devices; the flag must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: a reference check on the real SmolLM2-135M model (seconds to load); "
      "few, and still run in CI")
