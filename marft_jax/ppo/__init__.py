"""marft_jax.ppo."""
