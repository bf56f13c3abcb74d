"""Moved: the algorithm table is `marft_jax.train.config.algorithms`, and `resolve` is
`marft_jax.train.config.resolve`. This module re-exports both for code written against the
old path (`from marft_jax.train import algorithms; algorithms.resolve(config)`)."""

from marft_jax.train.config.algorithms import (ALGORITHMS, DEFAULT_CONTEXT_MODE,
                                               DEFAULT_NUM_ROLES, Algorithm, get)
from marft_jax.train.config.resolve import READ_ONLY_WHEN, check_backbones, resolve

__all__ = ["ALGORITHMS", "DEFAULT_CONTEXT_MODE", "DEFAULT_NUM_ROLES", "Algorithm", "get",
           "READ_ONLY_WHEN", "check_backbones", "resolve"]
