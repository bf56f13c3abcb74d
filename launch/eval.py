r"""Evaluate a team on held-out problems: a run's latest checkpoint, or the untuned base.

  python -m launch.eval --workdir=runs/default                # the checkpoint in runs/default
  python -m launch.eval --workdir=runs/default --untuned      # the same team, no adapters
  python -m launch.eval --config=launch/configs/marft_t.py --workdir=runs/marft_t

Pass the config the run was trained with (the same --config and --config.* flags): the
checkpoint's saved config is compared with it, and a difference is an error naming the keys
(`iterations`, `checkpoint_every` and `task.eval_problems` may differ). Prints `name=value`
lines (accuracy overall and per graded role, answer-format rate and reply length per role) and
writes them to <workdir>/eval.json (eval_untuned.json with --untuned).
"""

from __future__ import annotations

import json
import os

from absl import flags

from launch import cli
from marft_jax.configs import to_config_dict
from marft_jax.train import loop
from marft_jax.train.checkpoint import Checkpointer
from marft_jax.train.config import TrainConfig
from marft_jax.train.evaluate import evaluate

_CONFIG = cli.define_config_flag("train.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "the training run's folder")
_UNTUNED = flags.DEFINE_bool("untuned", False, "evaluate the base model (no adapters)")
_PROBLEMS = flags.DEFINE_integer("problems", None, "held-out problems (default: the config's "
                                 "task.eval_problems)")


def restore_policy(config: TrainConfig, model: loop.Model, workdir: str):
  """(the adapters of `workdir`'s latest checkpoint, its step)."""
  team, structure = loop.build_team(config)
  policy_opt, critic_opt = loop._optimizers(config)
  template = loop.init_state(config, model, len(team) + (structure is not None), policy_opt,
                             critic_opt)
  with Checkpointer(workdir) as checkpointer:
    step = checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(f"{workdir}: no checkpoint to evaluate (train first, or pass "
                              "--untuned)")
    state, _ = checkpointer.restore(template, config=to_config_dict(config).to_dict(),
                                    may_differ=("iterations", "checkpoint_every",
                                                "task.eval_problems"))
  return state.policy, step


def main(config: TrainConfig) -> None:
  model = loop.load(config)
  policy, step = (None, 0) if _UNTUNED.value else restore_policy(config, model, _WORKDIR.value)
  results = evaluate(config, model, policy, num_problems=_PROBLEMS.value, progress=True)
  results["checkpoint_step"] = step
  os.makedirs(_WORKDIR.value, exist_ok=True)
  name = "eval_untuned.json" if _UNTUNED.value else "eval.json"
  with open(os.path.join(_WORKDIR.value, name), "w") as f:
    json.dump(results, f, indent=2)
  for key, value in results.items():
    print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")


if __name__ == "__main__":
  cli.run(main, _CONFIG, TrainConfig)
