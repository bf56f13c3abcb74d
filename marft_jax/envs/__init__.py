"""marft_jax.envs."""
