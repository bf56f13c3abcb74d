"""Moved: the shipped teams and what a team section declares are
`marft_jax.train.config.teams`; the agents a rollout plays are built by
`marft_jax.train.build.team`. This module re-exports them for config files written against the
old path (`from marft_jax.train import teams; teams.shipped("arithmetic", 2)`)."""

from marft_jax.train.build.team import agents as build_team
from marft_jax.train.config.teams import (adapter_ids, adapter_names, declared, num_adapters,
                                          role_bases, shipped)

__all__ = ["adapter_ids", "adapter_names", "build_team", "declared", "num_adapters",
           "role_bases", "shipped"]
