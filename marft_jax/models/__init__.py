"""marft_jax.models."""
