"""The config file of `examples/parity.py`: a thinker → answerer team on the parity task
(`task.name` names the factory, `task.options` reaches it; a task of your own declares its
team). Short on purpose: 4 environments, 2 iterations."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import (RoleSection, RolloutSection, TaskSection, TeamSection,
                                    TrainConfig)


def get_config():
  roles = (RoleSection("thinker", "Think about the number in one line.", "Thinks."),
           RoleSection("answerer", "Answer 'even' or 'odd'.", "Answers.", graded=True))
  return to_config_dict(TrainConfig(
      task=TaskSection(name="examples.parity:make_env", options={"high": 100},
                       eval_problems=8),
      team=TeamSection(roles=roles, order="thinker,answerer", max_new_tokens=16,
                       last_max_new_tokens=8),
      rollout=RolloutSection(num_envs=4),
      iterations=2, checkpoint_every=1))
