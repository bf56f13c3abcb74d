"""marft_jax.lora."""
