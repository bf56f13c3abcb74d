"""The config file of `examples/guess_number.py`: a hinter → guesser team, up to 3 guesses an
episode (task.horizon), each after the feedback on the ones before."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import (RoleSection, RolloutSection, TaskSection, TeamSection,
                                    TrainConfig)


def get_config():
  roles = (RoleSection("hinter", "Read the feedback and say which numbers are still "
                       "possible, in one line.", "Narrows the range."),
           RoleSection("guesser", "Reply with one number: your guess.", "Guesses.",
                       graded=True))
  return to_config_dict(TrainConfig(
      task=TaskSection(name="examples.guess_number:make_env", options={"high": 16}, horizon=3,
                       eval_problems=8),
      team=TeamSection(roles=roles, order="hinter,guesser", max_new_tokens=16,
                       last_max_new_tokens=6),
      rollout=RolloutSection(num_envs=4),
      iterations=2, checkpoint_every=1))
