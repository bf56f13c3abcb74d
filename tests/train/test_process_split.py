"""The pieces that let each process of a multi-process job play and train on only its own
environments, checked in one process (test_multihost.py runs the real 2-process job).

References: the whole-batch computation (advantages of all the episodes at once; a rollout
without a row layout; `make_batch`'s own padding rows); two "processes" are two threads whose
gathers meet at a barrier.
"""

import dataclasses
import threading

import jax
import numpy as np
import pytest

from marft_jax import envs, multihost, rollout as rollout_lib, sharding
from marft_jax.rollout.episode import Episode, TokenSequence
from marft_jax.train import config as config_lib
from marft_jax.train import batching, local_batch
from marft_jax.train.advantages import AdvantageConfig, Blocks, compute_advantages
from marft_jax.train.batching import TrainBatch, make_batch
from marft_jax.train.build import preflight
from tests.rollout.test_rollout import _team, model  # noqa: F401 (a fixture)
from tests.train.echo_config import echo_config


# --- config validation -------------------------------------------------------------------------


@pytest.mark.parametrize("changes, mesh, processes, key", [
    (dict(num_envs=6), (2, 2, 1), 2, "rollout.num_envs=6"),
    (dict(num_envs=8), (1, 1, 8), 2, "mesh.data=1 x mesh.fsdp=1"),
    (dict(num_envs=8, group_size=8), (2, 2, 2), 2, "rollout.group_size=8"),
])
def test_a_layout_the_processes_cannot_split_is_refused_by_name(changes, mesh, processes, key):
  config = echo_config(rollout=config_lib.RolloutSection(**changes))
  with pytest.raises(ValueError, match="^" + key.replace(".", r"\.")):
    preflight.check_processes(config, mesh, processes)


def test_heldout_evaluation_during_training_is_refused_across_processes():
  config = echo_config(eval_every=4)
  preflight.check_processes(config, (2, 1, 1), 1)
  with pytest.raises(ValueError, match="^eval_every=4: .*launch/eval.py"):
    preflight.check_processes(config, (2, 1, 1), 2)


def test_one_process_or_a_divisible_layout_is_accepted():
  config = echo_config(rollout=config_lib.RolloutSection(num_envs=6, group_size=3))
  preflight.check_processes(config, (4, 1, 2), 1)  # one process: anything goes
  config = echo_config(rollout=config_lib.RolloutSection(num_envs=16, group_size=4))
  preflight.check_processes(config, (2, 2, 2), 2)


# --- environments --------------------------------------------------------------------------------


def test_an_env_batch_builds_and_steps_only_its_owned_block():
  built = []
  make = lambda i: built.append(i) or envs.EchoEnv(graded=["actor"])
  whole = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), 8, seed=3, group_size=2)
  block = envs.EnvBatch(make, 8, seed=3, group_size=2, owned=range(4, 8))
  assert built == [4, 5, 6, 7] and len(block) == 8
  assert block.reset(5) == whole.reset(5)  # the same task seed and observation
  assert block.episodes == [0, 0, 0, 0, 0, 1, 0, 0]
  with pytest.raises(ValueError, match="not one of this process's environments"):
    block.reset(3)
  block.load_state_dict({"seed": 3, "episodes": [7] * 8})
  assert block.reset(4)[0] == whole.episode_seed(4, 7)
  with pytest.raises(ValueError, match="owned"):
    envs.EnvBatch(make, 8, owned=range(6, 10))


# --- the training batch ------------------------------------------------------------------------


def _episode(index, rng, num_agents=2):
  """A per-agent-view episode of one env step: one row per agent turn."""
  episode = Episode(env_index=index, seed=index, task="", policy_version=0)
  for agent in range(num_agents):
    sequence = TokenSequence()
    sequence.add_context(list(rng.integers(1, 50, rng.integers(2, 9))), agent)
    n = int(rng.integers(1, 6))
    sequence.add_reply(list(rng.integers(1, 50, n)), list(rng.normal(-1, 0.3, n)), agent, agent,
                       1.0, agent, 0)
    episode.sequences.append(sequence)
  episode.rewards, episode.dones = [[float(rng.integers(0, 2))] * num_agents], [True]
  return episode


def test_padding_matches_make_batchs_own_padding_rows():
  assert set(batching.PADDING) == {f.name for f in dataclasses.fields(TrainBatch)}
  rng = np.random.default_rng(0)
  episodes = [_episode(i, rng) for i in range(3)]
  reference = make_batch(episodes, pad_id=7, num_rows=10)  # rows 6..9 are padding
  T, K, P = local_batch.widths(reference)
  padded = local_batch.pad_batch(make_batch(episodes, pad_id=7), 10, T, K, P, pad_id=7)
  blank = local_batch.pad_batch(None, 4, T, K, P, pad_id=7)
  for name in batching.PADDING:
    x, y = np.asarray(getattr(padded, name)), np.asarray(getattr(reference, name))
    assert x.dtype == y.dtype, name
    np.testing.assert_array_equal(x, y, err_msg=name)
    np.testing.assert_array_equal(np.asarray(getattr(blank, name)), y[6:], err_msg=name)


class _ThreadGather:
  """`multihost.gather_blocks` for N threads standing in for N processes."""

  def __init__(self, n):
    self.barrier, self.parts = threading.Barrier(n), [None] * n

  def for_process(self, p):
    def gather(block):
      self.parts[p] = np.array(block)
      self.barrier.wait()
      whole = np.concatenate(self.parts)
      self.barrier.wait()  # everyone has read the parts before the next call writes them
      return whole
    return gather


@pytest.mark.parametrize("dropped", [(), (1,)], ids=["full_blocks", "padding_mid_batch"])
@pytest.mark.parametrize("level", ["action", "token", "grpo"])
def test_advantages_of_each_processs_block_equal_the_whole_batchs(level, dropped):
  """Bit for bit: the whitening is the whole batch's, in one process's row order (with an
  episode dropped from process 0, its block's padding rows sit mid-batch, one process's at
  the end); GAE and GRPO's groups stay inside one block."""
  rng = np.random.default_rng(1)
  E, processes, G = 8, 2, 2
  episodes = [_episode(i, rng) for i in range(E)]
  config = AdvantageConfig(level=level, normalize=level != "grpo")
  groups = [i // G for i in range(E)]
  kept = [i for i in range(E) if i not in dropped]
  rows = 2 * E // processes  # 2 rows an episode: blocks of E / 2 episodes
  mine = [[i for i in kept if p * E // processes <= i < (p + 1) * E // processes]
          for p in range(processes)]
  whole = make_batch([episodes[i] for i in kept], pad_id=0, num_rows=2 * E)
  values = rng.normal(0, 1, whole.tokens.shape).astype(np.float32)
  whole = whole.replace(act_old_value=np.where(whole.mask, values, 0.0).astype(np.float32))
  expected = compute_advantages(whole, [episodes[i] for i in kept], config, 2,
                                [groups[i] for i in kept])
  T, K, P = local_batch.widths(whole)
  gather, results = _ThreadGather(processes), [None] * processes

  def process(p):
    block = local_batch.pad_batch(make_batch([episodes[i] for i in mine[p]], pad_id=0), rows,
                                  T, K, P, pad_id=0)
    first = 2 * sum(len(m) for m in mine[:p])  # its episodes' first row in `whole`
    own = np.zeros((rows, T), np.float32)
    own[:2 * len(mine[p])] = whole.act_old_value[first:first + 2 * len(mine[p])]
    block = block.replace(act_old_value=own)
    results[p] = compute_advantages(block, [episodes[i] for i in mine[p]], config, 2,
                                    [groups[i] for i in mine[p]],
                                    blocks=Blocks(p, gather.for_process(p)))

  threads = [threading.Thread(target=process, args=(p,)) for p in range(processes)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  used = [p * rows + r for p in range(processes) for r in range(2 * len(mine[p]))]
  for name in ("act_advantage", "act_return", "turn_advantage", "turn_return"):
    got = np.concatenate([getattr(r, name) for r in results])
    ref = getattr(expected, name)
    np.testing.assert_array_equal(got[used], ref[:len(used)], err_msg=name)
    assert not got[[r for r in range(2 * E) if r not in used]].any(), name
    assert not ref[len(used):].any(), name


# --- the rollout -------------------------------------------------------------------------------


@pytest.mark.exactness
@pytest.mark.parametrize("context_mode", ["per_agent", "shared_stream"])
def test_a_rollout_through_process_rows_equals_one_without(model, context_mode):  # noqa: F811
  """One process's `ProcessRows` path (rows placed from host blocks, read back per shard, a
  fresh cache made sharded, continued in the shared stream) samples what the plain path
  does."""
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  results = []
  for rows in (None, multihost.ProcessRows(mesh)):
    batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), 4, seed=0)
    with jax.set_mesh(mesh):
      results.append(rollout_lib.rollout(
          batch, _team(temperature=0.7), None, model["fast"], model["config"],
          model["tokenizer"], jax.random.key(5), lora=model["lora"],
          config=rollout_lib.RolloutConfig(context_mode=context_mode), rows=rows))
  plain, split = results
  # One process: its episodes are all of them (the transcript copies: without sequences).
  assert split.all_episodes == [dataclasses.replace(e, sequences=[]) for e in split.episodes]
  for a, b in zip(plain.episodes, split.episodes):
    assert a.turns == b.turns
    for x, y in zip(a.sequences, b.sequences):
      assert x.tokens == y.tokens
      # The plain path encodes the rows' shared prompt prefix once (sampler.generate's
      # share_prefix; one process only): f32 summation order, the file's rollout allowance.
      np.testing.assert_allclose(x.behaviour_logprobs, y.behaviour_logprobs, rtol=1e-5,
                                 atol=1e-5)
  assert {k: v for k, v in plain.metrics.items() if not k.endswith("_s")} == \
      {k: v for k, v in split.metrics.items() if not k.endswith("_s")}
