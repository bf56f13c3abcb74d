"""Asynchronous rollouts with bounded staleness: `rollout.max_staleness` = η ≥ 1.

A sampler thread plays iteration k's episodes while the main thread updates on iteration
k − 1's (XLA releases the GIL; the host work of a rollout, grading, code sandboxes and the
judge's text handling, overlaps the learner's device work). Iteration k always samples with
exactly policy version

    v(k) = max(k − η, 0)       (version j: the adapters after j updates; 0: the initial ones)

and its own keys (`fold_in(seed, k)`, as the synchronous loop), whatever the timing: so an
asynchronous run is reproducible, and resumes bit for bit. The batch of iteration k is
min(k, η) versions old (`async/version_gap`); the decoupled-PPO correction weighs each sample
by π_prox / π_behav (`loss.behaviour_correction`, on whenever η ≥ 1: `config.resolve`), where
π_prox is the learner's current policy recomputed before the update.

What the fixed schedule costs: the sampler waits for version k − η before it starts iteration
k. A schedule that sampled with the freshest version available would wait on the same
condition (no batch may be more than η versions old), so it saves no waiting: it would only
sometimes be fresher (the learner finished a version while the sampler was between
rollouts), at the price of a run that cannot be reproduced. With one sampler thread and
η = 1 the freshest version is v(k) = k − 1 in the steady state anyway (version k is being
computed while iteration k samples). So the fixed schedule is the only one; what it does
cost is freshness (every batch after the first η is exactly η versions old). The sampler starts
iteration k at most η iterations before the learner takes it (η + 1 rollouts held), and the
η versions behind the learner's are kept (adapters only, megabytes) and checkpointed beside
each step (`AsyncRollouts.save_versions`), with the data cursor of the last trained
iteration, not the sampler's: a resume replays the episodes that were in flight, and trains
each iteration once. For the same reason a stop (Ctrl-C, SIGTERM, an error in the learner)
cancels the rollout in flight at its next sampler call or env step (`rollout`'s `cancel`)
rather than playing it out: its episodes would be replayed anyway.

Several devices (`mesh.sampler_devices` = n > 0): the last n devices form the sampler's mesh
(rows over them, weights replicated), the learner's mesh is the config's over the devices
before them (`meshes`), and each published version is copied to the sampler's devices.
Single-process runs only (two threads' collectives would interleave: `config.check_processes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional

import jax

from marft_jax import lora as lora_lib
from marft_jax import sharding
from marft_jax.rollout import RolloutCancelled


def rollout_version(iteration: int, max_staleness: int) -> int:
  """The policy version iteration `iteration` samples with: max(k − η, 0)."""
  return max(iteration - max_staleness, 0)


def meshes(config) -> tuple[jax.sharding.Mesh, Optional[jax.sharding.Mesh]]:
  """(the learner's mesh, the sampler's or None): with `mesh.sampler_devices` = n > 0, the
  config's mesh over the devices before the last n, and (data n, fsdp 1, tensor 1) over
  those; else the config's mesh over all devices, as `sharding.mesh_from_config`."""
  m, n = config.mesh, config.mesh.sampler_devices
  if not n:
    return sharding.mesh_from_config(m.data, m.fsdp, m.tensor), None
  devices = jax.devices()
  if n >= len(devices):
    raise ValueError(f"mesh.sampler_devices={n}: leaves none of the {len(devices)} devices "
                     "to the learner")
  learner = devices[:len(devices) - n]
  shape = sharding.mesh_shape(m.data, m.fsdp, m.tensor, len(learner))
  return sharding.make_mesh(*shape, devices=learner), sharding.make_mesh(n, 1, 1, devices[-n:])


@dataclasses.dataclass
class Produced:
  """One iteration's rollout, as the sampler thread left it."""

  result: Any  # `rollout.RolloutResult`
  shaped: dict  # the judge's and reward function's metrics
  cursor: dict  # the environments' data cursor after this rollout (`EnvBatch.state_dict`)
  version: int  # the policy version that sampled it
  rollout_s: float  # the sampler's time on it (its wait for the version excluded)
  wait_s: float  # the sampler's wait for that version


class AsyncRollouts:
  """The sampler thread and the policy versions it reads (see the module docstring).

  `play(iteration, policy, version, cancel) -> (RolloutResult, shaped metrics)` plays one
  iteration's episodes, and stops with `rollout.RolloutCancelled` once the `threading.Event`
  `cancel` is set; `envs` are the environments it advances (their cursor is recorded after
  each);
  `scope()` a context for the thread (the mesh and matmul precision are thread-local in JAX);
  `place(policy)` copies a version to the sampler's devices. Iterations `start` to `end − 1`
  are played; `versions` holds the versions the first of them need (`initial_versions`);
  `saved`: the `Checkpointer` of the versions behind each checkpoint (`versions_dir`).
  Use it as a context manager: leaving it stops the thread, cancelling the rollout in flight
  at its next sampler call or env step (its episodes were never to be trained: the
  checkpoint's cursor is the last trained iteration's, so a resume replays them).
  """

  def __init__(self, play: Callable, envs, max_staleness: int, start: int, end: int,
               versions: dict, scope: Callable = contextlib.nullcontext,
               place: Callable = lambda policy: policy, saved=None):
    self._play, self._envs, self._eta, self._saved = play, envs, max_staleness, saved
    self._start, self._end, self._scope, self._place = start, end, scope, place
    self._versions = {v: place(p) for v, p in versions.items()}  # sampler's copies
    self._kept = dict(versions)  # the learner's copies, for checkpoints
    self._produced: dict[int, Produced] = {}
    self._cursors: dict[int, dict] = {}  # iteration -> cursor after its rollout
    self._error: Optional[BaseException] = None
    self._stop = False
    self._cancel = threading.Event()  # set with _stop: the rollout in flight stops too
    self._changed = threading.Condition()
    self._thread = threading.Thread(target=self._run, name="marft-sampler", daemon=True)

  def __enter__(self) -> "AsyncRollouts":
    self._thread.start()
    return self

  def __exit__(self, *exc_info) -> None:
    with self._changed:
      self._stop = True
      self._cancel.set()
      self._changed.notify_all()
    self._thread.join()

  # --- the sampler thread ---------------------------------------------------------------------

  def _run(self) -> None:
    try:
      with self._scope():
        for k in range(self._start, self._end):
          version = rollout_version(k, self._eta)
          waited = time.perf_counter()
          with self._changed:
            self._changed.wait_for(lambda: self._stop or version in self._versions)
            if self._stop:
              return
            policy = self._versions[version]
          began = time.perf_counter()
          result, shaped = self._play(k, policy, version, self._cancel)
          done = time.perf_counter()
          produced = Produced(result, shaped, _copy_cursor(self._envs.state_dict()), version,
                              done - began, began - waited)
          with self._changed:
            self._produced[k] = produced
            self._drop_versions_below(rollout_version(k + 1, self._eta), self._versions)
            self._changed.notify_all()
    except RolloutCancelled:
      return  # only __exit__ cancels: nobody takes this iteration
    except BaseException as e:  # the learner re-raises it (`take`)
      with self._changed:
        self._error = e
        self._changed.notify_all()

  # --- the learner's side ---------------------------------------------------------------------

  def take(self, iteration: int, stop: Optional[threading.Event] = None
           ) -> tuple[Any, dict, dict]:
    """(RolloutResult, shaped metrics, "async/" metrics) of `iteration`, waiting for it;
    `RolloutCancelled` if `stop` is set first (a signal handler sets it: polled, since a
    handler cannot notify the condition)."""
    waited = time.perf_counter()
    ready = lambda: iteration in self._produced or self._error is not None
    with self._changed:
      while not self._changed.wait_for(ready, timeout=None if stop is None else 0.2):
        if stop.is_set():
          raise RolloutCancelled(f"stopped while waiting for iteration {iteration}'s rollout")
      if iteration not in self._produced:
        raise RuntimeError(f"the sampler thread failed before iteration {iteration}'s "
                           "rollout") from self._error
      produced = self._produced.pop(iteration)
      self._cursors[iteration] = produced.cursor
    wait = time.perf_counter() - waited
    metrics = {"async/version_gap": float(iteration - produced.version),
               "async/policy_version": float(produced.version),
               "async/learner_wait_s": wait, "async/sampler_wait_s": produced.wait_s,
               "async/sampler_rollout_s": produced.rollout_s,
               "async/sampler_wait_share": produced.wait_s / max(
                   produced.wait_s + produced.rollout_s, 1e-9)}
    return produced.result, produced.shaped, metrics

  def publish(self, version: int, policy) -> None:
    """Version `version` (the learner's adapters after `version` updates) is ready."""
    placed = self._place(policy)
    with self._changed:
      self._versions[version] = placed
      self._kept[version] = policy
      self._drop_versions_below(version - self._eta, self._kept)
      self._changed.notify_all()

  def cursor(self, step: int) -> dict:
    """The data cursor after the rollout of iteration `step − 1`: what a checkpoint of `step`
    resumes from (the sampler's environments may be ahead, playing iterations not trained)."""
    with self._changed:
      cursor = self._cursors[step - 1]
      for k in [k for k in self._cursors if k < step - 1]:
        del self._cursors[k]
    return cursor

  def behind(self, step: int) -> tuple:
    """The η versions a resume at `step` samples with before its own: max(step − η + i, 0)
    for i < η (the learner's copies)."""
    with self._changed:
      return tuple(self._kept[rollout_version(step + i, self._eta)] for i in range(self._eta))

  def save_versions(self, step: int) -> None:
    """Saves the η versions behind `step` (call it before the step's own checkpoint, so that
    every checkpoint has them; a step saved again after a resume holds the same bits)."""
    self._saved.save(step, self.behind(step), {"iteration": step}, force=True)

  @staticmethod
  def _drop_versions_below(version: int, versions: dict) -> None:
    for v in [v for v in versions if v < version]:
      del versions[v]


def _copy_cursor(state: dict) -> dict:
  return {k: list(v) if isinstance(v, list) else v for k, v in state.items()}


def initial_versions(policy, start: int, max_staleness: int, behind: Optional[tuple]) -> dict:
  """{version: adapters} the iterations from `start` on need first: `policy` as version
  `start`, and `behind` (`AsyncRollouts.behind(start)`, restored) as the versions before it
  (None at the start of a run: only version 0)."""
  versions = {start: policy}
  if behind is not None:
    for i, adapters in enumerate(behind):
      versions.setdefault(rollout_version(start + i, max_staleness), adapters)
  return versions


# --- the versions behind a checkpoint -----------------------------------------------------------


def versions_dir(workdir: str) -> str:
  """Where the versions behind each checkpoint are saved (a `Checkpointer`'s workdir)."""
  return os.path.join(workdir, "sampler_versions")


def restore_versions(checkpointer, step: int, policy, max_staleness: int) -> tuple:
  """The η versions behind checkpoint `step`, restored in `policy`'s structure."""
  if step not in checkpointer.all_steps():
    raise FileNotFoundError(
        f"{checkpointer.directory}: no sampler versions for step {step}: the checkpoint was "
        f"not written by a run with rollout.max_staleness={max_staleness}")
  return checkpointer.restore((policy,) * max_staleness, step=step)[0]


def placer(sampler_mesh) -> Callable:
  """Copies adapters to the sampler's mesh (split like their base kernels); the identity
  when the sampler shares the learner's mesh."""
  if sampler_mesh is None:
    return lambda policy: policy
  return lambda policy: jax.device_put(policy, lora_lib.follow_adapters(sampler_mesh, policy))


def place_weights(weights: tuple, sampler_mesh) -> tuple:
  """The sampler's (params, model config) replicated over its mesh (`meshes`: fsdp and
  tensor are 1 there); unchanged without a sampler mesh."""
  if sampler_mesh is None:
    return weights
  params, model_config = weights
  return jax.device_put(params, sharding.replicated(sampler_mesh)), model_config

