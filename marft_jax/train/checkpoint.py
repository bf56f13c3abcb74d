"""Orbax checkpoints of the trainer's state, PEFT exports beside them, and a SIGTERM flag.

A workdir holds::

    workdir/checkpoints/<step>/state/   the state pytree (Orbax StandardSave)
    workdir/checkpoints/<step>/meta/    a JSON dict: counters, data cursor, config, fingerprint
    workdir/exports/step_<step>/<name>/ one PEFT adapter folder per agent

Guarantees, and where they come from:
  - A step folder appears whole or not at all: Orbax writes `<step>.orbax-checkpoint-tmp` and
    renames it; `latest_step` ignores tmp folders and `cleanup_tmp_directories=True` deletes
    them when the next `Checkpointer` opens the workdir (in the background; `close` waits for
    it). A process killed mid-save therefore leaves the previous step loadable (tested with
    SIGKILL).
  - A state with a NaN or inf in any floating leaf is never written (`NonFiniteStateError`):
    resuming from a diverged state would only diverge again.
  - Restoring goes through an abstract tree, so a freshly initialised state of the same
    structure receives the saved values bit for bit (adapters, optimizer moments, key data).
    A checkpoint of another structure (agents, LoRA rank, targets) or config is refused with
    an error naming the workdir, the step and the differing keys, never loaded half-way.
  - Exports are written to a hidden temporary folder and renamed, and live outside the step
    folders: a failed export leaves the checkpoint untouched.

Single-host runs get no preemption notice from Orbax (`reached_preemption` is live only under
`jax.distributed`), hence `PreemptionFlag`: the loop polls it, saves with `force=True`, waits
and exits 0.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import uuid
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

try:  # a private module of Orbax's, patched by `skip_orbax_byte_counts`
  from orbax.checkpoint._src.serialization import tensorstore_utils as _orbax_tensorstore
except ImportError:
  _orbax_tensorstore = None
_ORBAX_RAW_BYTES = getattr(_orbax_tensorstore, "get_tensorstore_raw_bytes", None)  # unpatched

from marft_jax.lora import Adapters, save_peft_adapters
from marft_jax.train.saved_steps import saved_steps
from marft_jax.train.write_failures import writing

StrPath = Union[str, "os.PathLike[str]"]
_EXPORT = re.compile(r"^step_(\d+)$")
_EXPORT_TEMP = re.compile(r"^\.step_\d+\.(tmp|old)-[0-9a-f]+$")


_all_finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))


class NonFiniteStateError(ValueError):
  """A state with a NaN or inf leaf was about to be checkpointed (and was not)."""


class CheckpointMismatchError(ValueError):
  """The checkpoint in a workdir was written by a run of another structure or config."""


class UnreadableCheckpointError(ValueError):
  """A finalised checkpoint whose files cannot be read back (damaged or edited on disk)."""


def config_fingerprint(config: Mapping[str, Any]) -> str:
  """A short hash of a JSON-able config: equal configs give equal fingerprints.

  Keys are sorted and tuples count as lists (as they come back from JSON), so a config and its
  JSON round trip have the same fingerprint.
  """
  canonical = json.dumps(_json_round_trip(config), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def first_non_finite(tree: Any) -> Optional[str]:
  """The path ("adapters/layers/q_proj/a") of the first floating leaf with a NaN or inf, or None.

  Integer, boolean and PRNG-key leaves are skipped. Leaves on this host are checked in NumPy
  (the save copies them to the host anyway); arrays spread over other hosts on device.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    if (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        or not jax.dtypes.issubdtype(dtype, jnp.inexact)):
      continue
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      finite = bool(_all_finite(leaf))
    else:
      values = np.asarray(leaf)
      if values.dtype.kind not in "fc":  # bfloat16 and other ml_dtypes floats
        values = values.astype(np.float32)
      finite = bool(np.all(np.isfinite(values)))
    if not finite:
      return _path_name(path)
  return None


@contextlib.contextmanager
def _without_log_line(prefix: str):
  """Drops the log records (absl's logger, which Orbax logs to) that start with `prefix`
  while the block runs: a notice about what the caller asked for, not news to a user."""
  drop = logging.Filter()
  drop.filter = lambda record: not record.getMessage().startswith(prefix)
  logger = logging.getLogger("absl")
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def skip_orbax_byte_counts() -> bool:
  """Stops Orbax asking TensorStore for its bytes read and written around every save and
  restore; returns whether it did (False where Orbax has no such call to replace).

  Orbax (0.12) calls `tensorstore.experimental_collect_matching_metrics` twice per save or
  restore only to log a throughput line and feed `jax.monitoring`, which nothing here reads;
  in tensorstore 0.1.86 every call leaks the Python objects it returns (about one per
  metric: measured with `gc.get_objects()`). Over a long run that is resident memory that
  grows with each checkpoint (tests/train/test_checkpoint_memory.py). Process-wide and
  idempotent: the first `Checkpointer` calls it.
  """
  if _ORBAX_RAW_BYTES is None:
    return False
  # None is Orbax's own "not measured": its raw-byte metrics are then skipped.
  _orbax_tensorstore.get_tensorstore_raw_bytes = _no_byte_count
  return True


def _no_byte_count(direction=None) -> None:
  del direction
  return None


class Checkpointer:
  """Saves and restores `(state, meta)` pairs by step in `workdir/checkpoints`.

  Use it as a context manager (or call `close`): with `async_save=True` a save returns once
  the arrays are copied to the host and finishes in the background; every exit path must then
  wait for it, which `close` does, and a background failure is raised there, not swallowed.

  Args:
    workdir: the run's folder; checkpoints go to `workdir/checkpoints`, exports to
      `workdir/exports`.
    max_to_keep: the newest checkpoints kept (older ones are deleted after each save).
    keep_every: also keep every step that is a multiple of this forever (None: none), so a
      long run keeps sparse fallbacks even if several recent steps turn out bad.
    save_interval_steps: `save` writes only steps that are multiples of this unless forced,
      or the first save into an empty workdir (Orbax's InitialSavePolicy: a run that cannot
      checkpoint fails at once, not after an interval).
    async_save: write in a background thread (default off: the LoRA + critic + optimizer state
      is small, and a synchronous save keeps retention, exports and errors in order).
    read_only: only read the workdir's checkpoints, e.g. to evaluate a run that may still be
      writing there: nothing is created, no half-written step or export is cleaned up, nothing
      is pruned, and `save` raises.
  """

  def __init__(self, workdir: StrPath, max_to_keep: int = 3, keep_every: Optional[int] = None,
               save_interval_steps: int = 1, async_save: bool = False, read_only: bool = False):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 (got {max_to_keep}): a run needs one "
                       "checkpoint to resume from")
    self.workdir = os.path.abspath(os.fspath(workdir))
    self.directory = os.path.join(self.workdir, "checkpoints")
    self.exports_dir = os.path.join(self.workdir, "exports")
    self.async_save = async_save
    self.read_only = read_only
    skip_orbax_byte_counts()
    self._closed = False
    policies = [ocp.checkpoint_managers.LatestN(n=max_to_keep)]
    if keep_every is not None:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_every))
    options = ocp.CheckpointManagerOptions(
        # (0 when read-only: Orbax would set it so, with a warning on every evaluation)
        save_interval_steps=0 if read_only else save_interval_steps, create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,  # (an asynchronous deletion at creation)
        enable_async_checkpointing=async_save,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies))
    # Handlers registered up front, so a fresh process can read a step's metadata (for the
    # structure check) before anything was saved or restored through it.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, handler, save_args, restore_args in (
        ("state", ocp.StandardCheckpointHandler(), ocp.args.StandardSave, ocp.args.StandardRestore),
        ("meta", ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore)):
      registry.add(item, save_args, handler)
      registry.add(item, restore_args, handler)
    with _without_log_line("Given directory is read only"):  # Orbax's, at every evaluation
      self._manager = ocp.CheckpointManager(self.directory, options=options,
                                            handler_registry=registry)
    # The export folder is process 0's alone (the loop exports there); Orbax coordinates the
    # step folders, which every process writes its shards into.
    self._owns_exports = not read_only and jax.process_index() == 0
    if self._owns_exports:
      self._remove_export_leftovers()

  # --- steps ---

  def all_steps(self) -> list[int]:
    """The finalised steps, oldest first (half-written ones never appear)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest finalised step, or None for a fresh workdir."""
    return self._manager.latest_step()

  def read_meta(self, step: int) -> dict:
    """The meta saved with `step` (its config, data cursor, ...), without the state."""
    steps = self.all_steps()
    if step not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step} "
                              f"(steps present: {steps or 'none'})")
    with self._reading(step, steps):
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(meta["meta"])

  def written_at(self, step: int) -> Optional[datetime.datetime]:
    """When `step` was committed (UTC), as Orbax records it in the step's metadata; None
    where the record is missing or unreadable (a checkpoint's era is then read from its
    config's keys alone: `config_history`)."""
    try:
      nanoseconds = self._manager.metadata(step).commit_timestamp_nsecs
    except (OSError, ValueError, KeyError, AttributeError):
      return None
    if not nanoseconds:
      return None
    return datetime.datetime.fromtimestamp(nanoseconds / 1e9, datetime.timezone.utc)

  # --- save ---

  def save(self, step: int, state: Any, meta: Optional[Mapping[str, Any]] = None,
           force: bool = False, wait: bool = False) -> bool:
    """Checkpoints `state` (any pytree of arrays) and `meta` (a JSON-able dict) as `step`.

    Returns False without writing when `step` is not a multiple of `save_interval_steps` (and
    `force` is False) or is already saved (a step is never overwritten). If `meta` has a
    "config" entry, its `config_fingerprint` is stored as "config_fingerprint" for `restore`.

    Raises:
      NonFiniteStateError: a floating leaf holds a NaN or inf (the error names the step and
        the leaf); nothing is written.
      TypeError: `meta` is not JSON-serialisable (names the step).
    """
    step = _check_step(step)
    if self.read_only:
      raise ValueError(f"{self.directory}: opened read_only; not saving step {step}")
    if step in self._manager.all_steps():
      logging.info("%s: step %d is already checkpointed; not saving it again", self.directory,
                   step)
      return False
    if not force and not self._manager.should_save(step):
      return False
    bad = first_non_finite(state)
    if bad is not None:
      raise NonFiniteStateError(f"{self.directory}: not saving step {step}: the state leaf "
                                f"{bad} holds a NaN or inf (the previous checkpoint is kept)")
    meta = self._meta_to_save(step, meta)
    # A full disk: one line naming the step, the space left and the step to resume from (the
    # unfinished step folder is never read, and the next Checkpointer deletes it).
    with writing(self.workdir, f"the checkpoint of step {step} (checkpoints/{step})"):
      saved = self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force)
      if wait or not self.async_save:
        self.wait()
    return saved

  def wait(self) -> None:
    """Blocks until a background save is on disk; raises its error if it failed."""
    self._manager.wait_until_finished()
    self._manager.check_for_errors()
    if self._owns_exports:
      self._prune_exports()

  def close(self) -> None:
    """Waits for outstanding saves, then releases Orbax's threads (a second call is a no-op)."""
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
      self._await_unfinished_steps_deleted()
    finally:
      self._manager.close()

  def _await_unfinished_steps_deleted(self) -> None:
    # Orbax deletes the unfinished steps it finds at creation in a background thread and waits
    # for it only before a save; its close() does not. A process that opens the run, restores
    # and exits would leave the deletion racing the interpreter's exit (seen in CI). Orbax has
    # no public handle for that future, hence the guarded private call.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  # --- restore ---

  def restore(self, abstract_state: Any, step: Optional[int] = None,
              config: Optional[Mapping[str, Any]] = None,
              may_differ: Iterable[str] = (),
              read_config: Optional[Callable[[Mapping[str, Any]], Mapping[str, Any]]] = None
              ) -> tuple[Any, dict]:
    """Restores step `step` (default: the latest) into the structure of `abstract_state`.

    `abstract_state` is a state of the run's structure (a freshly initialised one, or a tree of
    `jax.ShapeDtypeStruct`s): leaves are restored with its shapes, dtypes and shardings, and
    flax struct dataclasses and optax named tuples come back as such. Leaves without a sharding
    go to the default device.

    If `config` is given (the current run's JSON-able config, compared with the saved
    meta["config"]), a differing fingerprint is an error naming every differing dotted key,
    except keys listed in `may_differ` (or under them, e.g. "train.num_iterations" to extend a
    run). `read_config` reads the saved config as the current code understands it before the
    comparison (e.g. the keys added since the checkpoint was written filled in with their
    defaults, "auto" keys resolved): without it the saved dict is compared as it is.

    Returns:
      `(state, meta)`.
    Raises:
      FileNotFoundError: no such step (names the workdir and the steps it holds).
      CheckpointMismatchError: the config or the state's structure differs from the saved one
        (names the workdir, step and keys).
    """
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
      step = steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step} "
                              f"(steps present: {steps or 'none'})")
    with self._reading(step, steps):
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = dict(meta["meta"])
    if config is not None:
      self._check_config(step, meta, config, may_differ, read_config)
    abstract = jax.tree.map(_abstract_leaf, abstract_state)
    with self._reading(step, steps):
      saved_tree = self._manager.item_metadata(step)["state"]
    self._check_structure(step, saved_tree, abstract)
    with self._reading(step, steps):
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract)))
    return restored["state"], meta

  @contextlib.contextmanager
  def _reading(self, step: int, steps: Sequence[int]):
    """Turns a failure to read `step`'s files into one `UnreadableCheckpointError` that names
    the folder and says how to resume from the step before it if they are damaged. Nothing is
    moved or deleted: the choice (and the evidence) stays with the user. Errors of the
    devices (out of memory: RuntimeError) pass through as they are."""
    try:
      yield
    except (OSError, ValueError) as e:  # tensorstore's read errors are ValueErrors, as JSON's
      folder = os.path.join(self.directory, str(step))
      earlier = [s for s in steps if s < step]
      then = (f"if its files are damaged, move that folder out of {self.directory} to resume "
              f"from step {earlier[-1]} (kept: {earlier})" if earlier else
              "no earlier checkpoint is kept: if its files are damaged, start again in a "
              "fresh workdir")
      # tensorstore appends its whole spec (hundreds of characters) to the reason.
      reason = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec=")[0]
      if len(reason) > 400:
        reason = reason[:400] + " ..."
      raise UnreadableCheckpointError(
          f"{folder}: checkpoint of step {step} cannot be read ({type(e).__name__}: "
          f"{reason}); {then}") from e

  def _check_config(self, step: int, meta: Mapping[str, Any], config: Mapping[str, Any],
                    may_differ: Iterable[str],
                    read_config: Optional[Callable[[Mapping[str, Any]], Mapping[str, Any]]]
                    ) -> None:
    if meta.get("config_fingerprint") == config_fingerprint(config):
      return
    if "config" not in meta:
      raise CheckpointMismatchError(
          f"{self.directory}: step {step} has no saved config to compare with the current one "
          "(the run that wrote it did not store meta['config'])")
    saved = meta["config"] if read_config is None else read_config(meta["config"])
    differing = [(key, was, now) for key, was, now in config_differences(saved, config)
                 if not under(key, may_differ)]
    if differing:
      lines = "; ".join(f"{key}: saved {was!r}, now {now!r}" for key, was, now in differing)
      raise CheckpointMismatchError(
          f"{self.directory}: step {step} was written with a different config ({lines}). "
          "Resume with the saved values, or start the new config in a fresh workdir.")

  def _check_structure(self, step: int, saved_tree: Any, abstract: Any) -> None:
    """Compares leaf paths, shapes and dtypes with the saved tree's metadata, so that a
    checkpoint of another structure fails with the first differing key named."""
    saved = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(
        saved_tree, is_leaf=_is_array_metadata)}
    wanted = {_path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    where = f"{self.directory}: step {step}"
    missing = sorted(wanted.keys() - saved.keys())
    if missing:
      raise CheckpointMismatchError(
          f"{where} has no leaf {missing[0]!r} ({len(missing)} missing; the checkpoint holds "
          f"{_preview(saved)}): it was written by a run of another structure")
    extra = sorted(saved.keys() - wanted.keys())
    if extra:
      raise CheckpointMismatchError(
          f"{where} holds leaf {extra[0]!r} ({len(extra)} extra) that the current state lacks: "
          "it was written by a run of another structure")
    for key, want in wanted.items():
      if not isinstance(want, jax.ShapeDtypeStruct):
        continue  # A Python scalar leaf: restored as saved.
      have = saved[key]
      shape, dtype = tuple(getattr(have, "shape", ()) or ()), getattr(have, "dtype", None)
      if shape != tuple(want.shape) or (dtype is not None and np.dtype(dtype) != want.dtype):
        raise CheckpointMismatchError(
            f"{where}: leaf {key!r} is saved as {shape} {dtype} but the current state has "
            f"{tuple(want.shape)} {want.dtype} (another number of agents, LoRA rank or model?)")

  # --- PEFT exports ---

  def export_peft(self, step: int, adapters: Adapters, names: Sequence[str],
                  base_model_name_or_path: Optional[str] = None) -> str:
    """Writes every agent's adapter as a PEFT folder `workdir/exports/step_<step>/<name>/`
    (`export_peft_groups` of one group)."""
    return self.export_peft_groups(step, [(adapters, names, base_model_name_or_path)])

  def export_peft_groups(self, step: int,
                         groups: Sequence[tuple[Adapters, Sequence[str], Optional[str]]]) -> str:
    """Writes the adapters of each group (stacked adapters, their names, the base they
    adapt: a team on several backbones has one group per backbone) as PEFT folders
    `workdir/exports/step_<step>/<name>/`.

    The export is built in a hidden temporary folder and renamed into place, so
    `step_<step>` is complete or absent, and it lives outside the Orbax step folders: an
    exception here leaves the checkpoints as they were. Exports of steps that are no longer
    checkpointed are deleted (exports newer than the latest checkpoint are kept).

    Returns:
      The export folder.
    Raises:
      NonFiniteStateError: an adapter leaf holds a NaN or inf (nothing is written).
    """
    step = _check_step(step)
    bad = next(filter(None, (first_non_finite(adapters) for adapters, _, _ in groups)), None)
    if bad is not None:
      raise NonFiniteStateError(f"{self.exports_dir}: not exporting step {step}: the adapter "
                                f"leaf {bad} holds a NaN or inf")
    final = os.path.join(self.exports_dir, f"step_{step}")
    token = uuid.uuid4().hex[:8]
    temp = os.path.join(self.exports_dir, f".step_{step}.tmp-{token}")
    old = os.path.join(self.exports_dir, f".step_{step}.old-{token}")
    with writing(self.workdir, f"the PEFT export of step {step} (exports/step_{step})"):
      os.makedirs(self.exports_dir, exist_ok=True)
      os.mkdir(temp)
      try:
        for adapters, names, base_model_name_or_path in groups:
          save_peft_adapters(temp, adapters, names, base_model_name_or_path)
        if os.path.exists(final):
          os.replace(final, old)
        os.replace(temp, final)
      except BaseException:
        if os.path.exists(old) and not os.path.exists(final):
          os.replace(old, final)
        shutil.rmtree(temp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    self._prune_exports()
    return final

  def _prune_exports(self) -> None:
    """Deletes `step_<N>` exports whose checkpoint has been deleted by retention."""
    if not os.path.isdir(self.exports_dir):
      return
    steps = set(self._manager.all_steps())
    newest = max(steps, default=-1)
    for name in os.listdir(self.exports_dir):
      match = _EXPORT.match(name)
      if match and int(match.group(1)) not in steps and int(match.group(1)) < newest:
        shutil.rmtree(os.path.join(self.exports_dir, name), ignore_errors=True)

  def _remove_export_leftovers(self) -> None:
    """Temporary export folders of a process that died mid-export."""
    if os.path.isdir(self.exports_dir):
      for name in os.listdir(self.exports_dir):
        if _EXPORT_TEMP.match(name):
          shutil.rmtree(os.path.join(self.exports_dir, name), ignore_errors=True)

  def _meta_to_save(self, step: int, meta: Optional[Mapping[str, Any]]) -> dict:
    meta = dict(meta or {})
    if "config" in meta and "config_fingerprint" not in meta:
      meta["config_fingerprint"] = config_fingerprint(meta["config"])
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"{self.directory}: the meta of step {step} is not JSON-serialisable: "
                      f"{e}") from None
    return meta


class PreemptionFlag:
  """Turns SIGTERM and SIGINT into a flag the training loop polls, instead of dying.

  Schedulers send SIGTERM some seconds before SIGKILL; this leaves time for a forced
  checkpoint. A second SIGINT (Ctrl-C twice) raises KeyboardInterrupt, so a user can still stop
  a loop that never polls. The previous handlers come back on exit. Main thread only (Python
  delivers signals there)::

      with PreemptionFlag() as preempted, Checkpointer(workdir) as ckpt:
        for step in range(start, num_steps):
          state = train_step(state)
          if preempted.requested:
            ckpt.save(step, state, meta, force=True, wait=True)
            break
  """

  def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)):
    self.signals = tuple(signals)
    self.requested = False
    self.event = threading.Event()  # set with `requested`: what a rollout's `cancel` reads
    self.signal_received: Optional[int] = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> "PreemptionFlag":
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError("PreemptionFlag must be entered in the main thread (Python runs "
                         "signal handlers there)")
    for sig in self.signals:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _handle(self, signum: int, frame: Any) -> None:
    del frame
    if signum == signal.SIGINT and self.requested:
      raise KeyboardInterrupt
    self.requested, self.signal_received = True, signum
    self.event.set()
    logging.warning("Received %s: checkpointing and exiting at the next safe point (after "
                    "an update in progress; a one-process rollout in progress stops at its "
                    "next sampler call)", signal.Signals(signum).name)


# --- helpers ---

_MISSING = "<missing>"


def _check_step(step: int) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
  return int(step)


def _json_round_trip(value: Any) -> Any:
  return json.loads(json.dumps(value))


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]
                       ) -> list[tuple[str, Any, Any]]:
  """(dotted key, saved value, current value) for each key whose value differs between two
  nested config dicts (as JSON holds them; "<missing>" where one lacks the key), by key."""
  saved, current = _flatten(_json_round_trip(saved)), _flatten(_json_round_trip(current))
  differing = []
  for key in sorted(saved.keys() | current.keys()):
    was, now = saved.get(key, _MISSING), current.get(key, _MISSING)
    if was != now:
      differing.append((key, was, now))
  return differing


def under(key: str, prefixes: Iterable[str]) -> bool:
  """`key` is one of the dotted `prefixes` or lies inside one ("team.roles" is under "team")."""
  return any(key == p or key.startswith(p + ".") for p in prefixes)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are values."""
  if not isinstance(tree, dict):
    return {prefix: tree}
  if not tree and prefix:
    return {prefix: {}}
  flat = {}
  for key, value in tree.items():
    flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
  return flat


def _abstract_leaf(leaf: Any) -> Any:
  abstract = ocp.utils.to_shape_dtype_struct(leaf)
  if isinstance(abstract, jax.ShapeDtypeStruct) and abstract.sharding is None:
    abstract = jax.ShapeDtypeStruct(abstract.shape, abstract.dtype,
                                    sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  return abstract


def _is_array_metadata(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _path_name(path: Sequence[Any]) -> str:
  """A key path as "a/b/0", the same for a live tree and Orbax's saved metadata tree (which
  stores dataclass fields and named-tuple fields as dict keys, sequences by index)."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def _preview(leaves: Mapping[str, Any], count: int = 4) -> str:
  names = sorted(leaves)
  more = f", ... ({len(names)} leaves)" if len(names) > count else ""
  return ", ".join(repr(n) for n in names[:count]) + more
