"""`marft_jax.architecture.targets`, re-exported: existing imports keep working.

It moved below `models` and `lora` (both import it; neither imports the other to read it)."""

from marft_jax.architecture.targets import *  # noqa: F401,F403
