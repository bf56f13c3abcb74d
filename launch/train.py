r"""Train a team of agents with MARFT (the main job).

  python -m launch.train --workdir=runs/default            # SmolLM2, reasoner → actor
  python -m launch.train --config=launch/configs/marft_t.py --workdir=runs/marft_t
  python -m launch.train --workdir=runs/default --config.iterations=80   # extend a run

The checkpoint already in --workdir always wins: the same command resumes where it stopped
(SIGTERM or Ctrl-C save first). Metrics go to <workdir>/metrics.jsonl and TensorBoard
(<workdir>/tensorboard), the learning curve to <workdir>/learning_curve.png, transcripts to
<workdir>/transcripts/, PEFT exports of every agent's adapter to <workdir>/exports/.
"""

from __future__ import annotations

from absl import flags

from launch import cli
from marft_jax.train.config import TrainConfig
from marft_jax.train.loop import train

_CONFIG = cli.define_config_flag("train.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "where checkpoints, metrics, "
                               "transcripts and exports go (resumed if it holds a checkpoint)")


def main(config: TrainConfig) -> None:
  metrics = train(config, _WORKDIR.value)
  print(f"iterations={config.iterations} reward={metrics.get('reward', float('nan')):.4f} "
        f"accuracy={metrics.get('accuracy', float('nan')):.4f} workdir={_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main, _CONFIG, TrainConfig)
