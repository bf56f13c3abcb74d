"""Agent graphs and environment batches refuse bad arguments by name."""

import re

import numpy as np
import pytest

from marft_jax import envs


@pytest.mark.parametrize("roles, edges, message", [
    (("a", "a", "b"), (("a", "b"),), "graph: roles ['a'] appear more than once in "
                                     "['a', 'a', 'b']"),
    ((), (), "graph: no roles"),
    (("a", "b"), (("a", "b"), ("b", "a")), "graph has a cycle among ['a', 'b']"),
    (("a",), (("a", "c"),), "graph edge ('a', 'c'): unknown role 'c'"),
])
def test_a_graph_that_is_not_a_dag_of_distinct_roles_is_refused(roles, edges, message):
  """Before: repeated roles were reported as "a cycle among []", and no roles made a team
  of nobody."""
  with pytest.raises(ValueError, match=re.escape(message)):
    envs.AgentGraph(roles, edges)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_an_env_batch_refuses_a_seed_that_is_not_an_int_of_at_least_0(seed):
  """Before: 1.5 was truncated to the seed 1, and -1 failed at the first episode with NumPy's
  "expected non-negative integer"."""
  with pytest.raises(ValueError, match=re.escape(f"seed={seed!r}: must be an int >= 0")):
    envs.EnvBatch(lambda i: envs.EchoEnv(graded=["a"]), 2, seed=seed)
  assert envs.EnvBatch(lambda i: envs.EchoEnv(graded=["a"]), 2, seed=np.int64(3)).seed == 3
