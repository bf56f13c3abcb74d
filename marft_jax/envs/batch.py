"""A batch of environments stepped together, with a seeded, reproducible order of tasks.

Each of the E environments runs one episode per rollout (with `group_size` G, consecutive
groups of G environments play the same task: GRPO's groups). Its k-th episode starts from the
task that `episode_seed(i, k)` selects, a pure function of the batch seed, the env's group and
k, so a
run is reproducible and a resumed run continues with exactly the tasks it would have seen
(`state_dict` is the data cursor: the number of episodes each env has started).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from marft_jax.envs.base import Environment, Observation, Step


class EnvBatch:
  """E environments made by `make_env(index)`, each auto-reset to its next task per episode."""

  def __init__(self, make_env: Callable[[int], Environment], size: int, seed: int = 0,
               group_size: int = 1):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"size={size!r}: the number of environments must be an int >= 1")
    if not isinstance(group_size, int) or group_size < 1 or size % group_size:
      raise ValueError(f"group_size={group_size!r}: must be an int >= 1 dividing size={size}")
    self.envs = [make_env(i) for i in range(size)]
    self.seed, self.group_size = int(seed), group_size
    self.episodes = [0] * size  # episodes started by each env: the data cursor

  def __len__(self) -> int:
    return len(self.envs)

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
    self.episodes[index] += 1
    return seed, self.envs[index].reset(seed)

  def step(self, index: int, actions: Mapping[str, str]) -> Step:
    return self.envs[index].step(actions)

  def state_dict(self) -> dict[str, Any]:
    return {"seed": self.seed, "episodes": list(self.episodes)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores the data cursor; ValueError if it belongs to another seed or batch size."""
    if int(state["seed"]) != self.seed or len(state["episodes"]) != len(self.envs):
      raise ValueError(f"env batch state is for seed {state['seed']} and "
                       f"{len(state['episodes'])} envs, not seed {self.seed} and "
                       f"{len(self.envs)} envs")
    self.episodes = [int(n) for n in state["episodes"]]

  def close(self) -> None:
    for env in self.envs:
      env.close()
