"""A batch of environments stepped together, with a seeded, reproducible order of tasks.

Each of the E environments runs one episode per rollout (with `group_size` G, consecutive
groups of G environments play the same task: GRPO's groups). Its k-th episode starts from the
task that `episode_seed(i, k)` selects, a pure function of the batch seed, the env's group and
k, so a run is reproducible and a resumed run continues with exactly the tasks it would have
seen (`state_dict` is the data cursor: the number of episodes each env has started).

Two kinds of task streams:

- `num_tasks=None` (generated tasks: arithmetic, echo): the seed is a hash of (batch seed,
  group, k), an independent stream per group.
- `num_tasks=n` (a problem file): the seed is a task index in [0, n). The batch's episodes
  are numbered t = k * (E / G) + group (round k of the rollouts, group by group) and task t
  is `order[t mod n]` of epoch t // n, `order` a permutation of range(n) drawn from
  (batch seed, epoch). So n consecutive episodes see every task exactly once, each epoch in
  its own seeded order, and a resumed batch goes on in the same order.

In a multi-process job each process owns one contiguous block of the E environments
(`owned`): it builds, resets and steps only those, and advances only their cursors; the
indices, seeds and groups stay those of the whole batch.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from marft_jax.envs.base import Environment, Observation, Step


class EnvBatch:
  """E environments made by `make_env(index)`, each auto-reset to its next task per episode.

  `owned`: the indices this process builds and steps (a `range`; default all E).
  `num_tasks`: the number of tasks of a finite set (see the module docstring), or None.
  `closing`: objects the environments share (a grading worker, a sandbox) whose `close()`
  the batch calls after its environments'."""

  def __init__(self, make_env: Callable[[int], Environment], size: int, seed: int = 0,
               group_size: int = 1, owned: Optional[range] = None,
               num_tasks: Optional[int] = None, closing: Sequence[Any] = ()):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"size={size!r}: the number of environments must be an int >= 1")
    if not isinstance(group_size, int) or group_size < 1 or size % group_size:
      raise ValueError(f"group_size={group_size!r}: must be an int >= 1 dividing size={size}")
    owned = range(size) if owned is None else owned
    if not isinstance(owned, range) or owned.step != 1 or not 0 <= owned.start < owned.stop <= size:
      raise ValueError(f"owned={owned!r}: must be a non-empty range(start, stop) within "
                       f"range({size})")
    if num_tasks is not None and (not isinstance(num_tasks, int) or num_tasks < 1):
      raise ValueError(f"num_tasks={num_tasks!r}: must be None or an int >= 1")
    # int() would truncate 1.5 to the seed 1; NumPy refuses a negative one without its name.
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed={seed!r}: must be an int >= 0")
    self.owned, self.num_tasks, self._closing = owned, num_tasks, tuple(closing)
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
    """The task seed of env `index`'s `episode`-th episode, the same for the `group_size`
    envs of a group (the G rollouts GRPO compares): a task index of the seeded epoch order
    with `num_tasks`, else a hash of (seed, group, episode) (the module docstring)."""
    group = index // self.group_size
    if self.num_tasks is None:
      state = np.random.SeedSequence([self.seed, group, episode]).generate_state(1)
      return int(state[0])
    epoch, position = divmod(episode * (len(self) // self.group_size) + group, self.num_tasks)
    return int(_epoch_order(self.seed, epoch, self.num_tasks)[position])

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

  @property
  def step_concurrency(self) -> int:
    """Environments `step_many` steps at once: the least any of them allows."""
    return min(env.step_concurrency for env in self.envs)

  def step_many(self, steps: Sequence[tuple[int, Mapping[str, str]]]
                ) -> list[Union[Step, Exception]]:
    """`step(index, actions)` for each pair, `step_concurrency` at a time (in the order given
    when 1), each env's `Step` or the exception it raised, in the order of `steps`. Envs are
    independent, so the results are those of stepping them one by one; what runs at once is
    their host work (a code task's sandboxed tests)."""
    def one(pair):
      try:
        return self.step(*pair)
      except Exception as e:  # the caller drops that env's episode
        return e
    workers = min(self.step_concurrency, len(steps))
    if workers <= 1:
      return [one(pair) for pair in steps]
    with concurrent.futures.ThreadPoolExecutor(workers, "env-step") as pool:
      return list(pool.map(one, steps))

  def state_dict(self) -> dict[str, Any]:
    """The data cursor (its entries outside `owned` are this process's stale copies: a
    multi-process job gathers each process's own block before saving it)."""
    return {"seed": self.seed, "episodes": list(self.episodes), "num_tasks": self.num_tasks}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores the data cursor; ValueError if it belongs to another seed, batch size or
    number of tasks (a cursor saved before `num_tasks` was recorded is taken as is)."""
    if int(state["seed"]) != self.seed or len(state["episodes"]) != len(self):
      raise ValueError(f"env batch state is for seed {state['seed']} and "
                       f"{len(state['episodes'])} envs, not seed {self.seed} and "
                       f"{len(self)} envs")
    if state.get("num_tasks", self.num_tasks) != self.num_tasks:
      raise ValueError(f"env batch state is for {state['num_tasks']} tasks, not "
                       f"{self.num_tasks}: the problem file changed, so the saved position "
                       "in its epoch order means other problems")
    self.episodes = [int(n) for n in state["episodes"]]

  def close(self) -> None:
    for env in self.envs:
      env.close()
    for shared in self._closing:
      shared.close()


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_tasks: int) -> np.ndarray:
  """The permutation of range(num_tasks) that epoch `epoch` visits tasks in."""
  return np.random.default_rng([seed, epoch]).permutation(num_tasks)
