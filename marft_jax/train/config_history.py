"""Moved: the compatibility history is `marft_jax.train.config.history`. This module is that
module under its old name, for code written against it."""

import sys

from marft_jax.train.config import history

sys.modules[__name__] = history
