"""marft_jax.train: the MARFT trainer."""
