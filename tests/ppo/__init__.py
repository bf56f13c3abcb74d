"""Tests of marft_jax.ppo."""
