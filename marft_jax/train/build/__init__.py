"""A run's pieces, built from its resolved config, one module a piece:

  preflight.py  the checks before anything slow starts (files, sandbox, your task, processes)
  team.py       the agents' profiles and the schedule structure the rollout plays
  envs.py       the environments (through the task table) and how episodes are played
  model.py      the bases: loaded, placed, the sampler's and the learner's copies, the judge
  learner.py    the optimizers, the state a run starts from, a backbone's jitted update

Training (`loop`), evaluation (`evaluate`) and the launch scripts build through these, so
they build the same team from the same keys. Each module imports only the config, tasks,
maths and leaves below it, and those listed above it (`tests/test_layers.py`).
"""
