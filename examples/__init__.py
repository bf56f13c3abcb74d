"""Shipped examples of tasks of your own (`task.name="examples.<module>:make_env"`, run from
the repository's root so that `examples` imports); `marft_jax/train/tasks.py` has the
factory's contract."""
