"""marft_jax.architecture: what a decoder is, apart from running it.

  config   ModelConfig (static shapes and numerics), tiny_config for tests.
  layout   Layout: scanned or unrolled layers, token- or feature-major; conversions.
  targets  the table of every layer weight: sizes, HF/GGUF names, sharding axes.

The layer that `models`, `lora` and `sharding` all sit on: it imports none of them, so none
of them imports another's package to read a shape (`marft_jax.models.config`, `.layout` and
`.targets` re-export these modules).
"""

from marft_jax.architecture.config import ModelConfig, RopeScaling, tiny_config
from marft_jax.architecture.layout import (DECODING, DECODING_ACCELERATOR, TRAINING, Layout,
                                           convert_cache, convert_params)
