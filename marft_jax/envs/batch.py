"""A batch of environments stepped together, with a seeded, reproducible order of tasks.

Each of the E environments runs one episode per rollout (with `group_size` G, consecutive
groups of G environments play the same task: GRPO's groups). Its k-th episode starts from the
task that `episode_seed(i, k)` selects, a pure function of the batch seed, the env's group and
k, so a
run is reproducible and a resumed run continues with exactly the tasks it would have seen
(`state_dict` is the data cursor: the number of episodes each env has started).

In a multi-process job each process owns one contiguous block of the E environments
(`owned`): it builds, resets and steps only those, and advances only their cursors; the
indices, seeds and groups stay those of the whole batch.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from marft_jax.envs.base import Environment, Observation, Step


class EnvBatch:
  """E environments made by `make_env(index)`, each auto-reset to its next task per episode.

  `owned`: the indices this process builds and steps (a `range`; default all E)."""

  def __init__(self, make_env: Callable[[int], Environment], size: int, seed: int = 0,
               group_size: int = 1, owned: Optional[range] = None):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"size={size!r}: the number of environments must be an int >= 1")
    if not isinstance(group_size, int) or group_size < 1 or size % group_size:
      raise ValueError(f"group_size={group_size!r}: must be an int >= 1 dividing size={size}")
    owned = range(size) if owned is None else owned
    if not isinstance(owned, range) or owned.step != 1 or not 0 <= owned.start < owned.stop <= size:
      raise ValueError(f"owned={owned!r}: must be a non-empty range(start, stop) within "
                       f"range({size})")
    self.owned = owned
    self.envs = [make_env(i) for i in owned]  # env `owned.start + j` is self.envs[j]
    self.seed, self.group_size = int(seed), group_size
    self.episodes = [0] * size  # episodes started by each env: the data cursor

  def __len__(self) -> int:
    """E, the environments of the whole batch (`owned` says which this process steps)."""
    return len(self.episodes)

  def _env(self, index: int) -> Environment:
    if index not in self.owned:
      raise ValueError(f"env {index} is not one of this process's environments {self.owned}")
    return self.envs[index - self.owned.start]

  def episode_seed(self, index: int, episode: int) -> int:
    """The task seed of env `index`'s `episode`-th episode: independent streams per group of
    `group_size` envs, which all play the same task (the G rollouts GRPO compares)."""
    group = index // self.group_size
    state = np.random.SeedSequence([self.seed, group, episode]).generate_state(1)
    return int(state[0])

  def group(self, index: int) -> int:
    return index // self.group_size

  def reset(self, index: int) -> tuple[int, Observation]:
    """Starts env `index`'s next episode; returns (its task seed, the first observation)."""
    seed = self.episode_seed(index, self.episodes[index])
    environment = self._env(index)
    self.episodes[index] += 1
    return seed, environment.reset(seed)

  def step(self, index: int, actions: Mapping[str, str]) -> Step:
    return self._env(index).step(actions)

  def state_dict(self) -> dict[str, Any]:
    """The data cursor (its entries outside `owned` are this process's stale copies: a
    multi-process job gathers each process's own block before saving it)."""
    return {"seed": self.seed, "episodes": list(self.episodes)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores the data cursor; ValueError if it belongs to another seed or batch size."""
    if int(state["seed"]) != self.seed or len(state["episodes"]) != len(self):
      raise ValueError(f"env batch state is for seed {state['seed']} and "
                       f"{len(state['episodes'])} envs, not seed {self.seed} and "
                       f"{len(self)} envs")
    self.episodes = [int(n) for n in state["episodes"]]

  def close(self) -> None:
    for env in self.envs:
      env.close()
