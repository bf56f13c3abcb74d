"""The trainer end to end on the tiny model: it learns, resumes exactly, isolates agents,
skips non-finite updates, and trains the policy that sampled.

References: a toy task whose best answer is known (the untrained model's reward is chance),
an uninterrupted run (for resume), the adapters before the update (for isolation), and the
sampler's own log-probs of the tokens it drew (for learner/sampler agreement).
"""

import contextlib
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import config as config_lib
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train import loop
from marft_jax.train import algorithms
from marft_jax.train import teams
from marft_jax.train import trained_problems
from marft_jax.train.advantages import AdvantageConfig
from tests.train.echo_config import (echo_config, echo_flags, from_default_file,
                                     tiny_trainer_model)

# Rewards every reply, so each form has advantages to learn from whatever its tiny model says.
VARIED = "tests.train.echo_config:varied_reward"


@pytest.fixture(scope="module")
def model():
  return tiny_trainer_model()


def _echo_config(algorithm, num_envs=64, **changes):
  """14 iterations of the echo task (tests/train/echo_config.py) on 64 environments."""
  return echo_config(algorithm, num_envs=num_envs, **{"iterations": 14, **changes})


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _final_state(config, model, workdir, step=None):
  """The state in `workdir`'s checkpoint `step` (default the latest), restored into the run's
  structure."""
  template = run_lib.new_state(config, model)
  with checkpoint_lib.Checkpointer(workdir) as checkpointer:
    return checkpointer.restore(template, step=step)[0], template


def _assert_trees_equal(a, b):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("algorithm", ["marft_a", "marft_t", "grpo"])
def test_reward_rises_from_chance_on_the_echo_task(model, tmp_path, algorithm):
  """Launched as a user does: the default file with `--config.algorithm=<algorithm>` and the
  echo task's overrides; the run records the algorithm it resolved."""
  launched = from_default_file(echo_flags(algorithm, num_envs=64, iterations=14))
  train_config = algorithms.resolve(_echo_config(algorithm))
  # The default file spells out the arithmetic team; the echo runs keep the echo task's own
  # shipped team (same size, shorter prompts). Everything else is what the user launched.
  echo_team = dataclasses.replace(launched.team, roles=(), order="")
  assert dataclasses.replace(launched, team=echo_team) == train_config
  seen = []

  def stop_once_learned(iteration, metrics):  # the later iterations would only cost time
    seen.append(metrics["reward"])
    if len(seen) >= 3 and np.mean(seen[-3:]) >= 0.8:
      raise _Learned()

  with contextlib.suppress(_Learned):
    loop.train(train_config, str(tmp_path), model=model, progress=False,
               on_iteration=stop_once_learned)
  rewards = [m["reward"] for m in _metrics(tmp_path)]
  assert rewards[0] < 0.2, rewards  # before any update: the untrained model's chance
  best = max(np.mean(rewards[i:i + 3]) for i in range(len(rewards) - 2))
  assert best >= 0.8, rewards
  # Every update trained the policy that sampled: same adapters, temperature, tokens.
  gaps = [m["logp/sampler_learner_max_gap"] for m in _metrics(tmp_path)]
  assert max(gaps) < 1e-4, gaps
  with open(os.path.join(tmp_path, "config.json")) as f:
    recorded = json.load(f)
  level = {"marft_a": "action", "marft_t": "token", "grpo": "grpo"}[algorithm]
  assert (recorded["algorithm"], recorded["advantage"]["level"]) == (algorithm, level)


class _Kill(Exception):
  pass


def _as_written_before_team_roles(workdir, step):
  """Rewrites checkpoint `step`'s saved config as the library wrote it before `team.roles`,
  `team.order` and `loss.behaviour_correction` existed, with the algorithm's keys as the
  config file set them (team.num_roles 2, no "auto"). (Without `model.matmul_precision` it
  would read as "default", the platform's precision an f32 run had then, and be refused
  naming the key: tests/train/test_old_checkpoints.py.)"""
  path = os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  config = meta["config"]
  for section, key in (("team", "roles"), ("team", "order"), ("loss", "behaviour_correction")):
    del config[section][key]
  meta["config_fingerprint"] = checkpoint_lib.config_fingerprint(config)
  with open(path, "w") as f:
    json.dump(meta, f)


class _Learned(Exception):
  pass


@pytest.mark.exactness
def test_resume_is_exact(model, tmp_path):
  """4 iterations straight vs 2, a crash in the 3rd (before its checkpoint), and a resume of
  the same command: identical adapters, critic, optimizer states and metrics."""
  train_config = _echo_config("marft_a", num_envs=8, iterations=4, checkpoint_every=2)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  finished = loop.train(train_config, straight, model=model, progress=False)

  def crash(iteration, metrics):
    if iteration == 2:
      raise _Kill()

  with pytest.raises(_Kill):
    loop.train(train_config, resumed, model=model, progress=False, on_iteration=crash)
  assert checkpoint_lib.Checkpointer(resumed).all_steps() == [2]
  # The checkpoint as an older version wrote it: it is read with today's defaults and resolved
  # (the team written out), so the same command resumes it, and another team is refused.
  _as_written_before_team_roles(resumed, step=2)
  other_team = dataclasses.replace(train_config, team=dataclasses.replace(
      train_config.team, **teams.shipped("echo", 2)))
  other_team = dataclasses.replace(other_team, team=dataclasses.replace(
      other_team.team, roles=tuple(dataclasses.replace(r, system_prompt="Say 7.")
                                   for r in other_team.team.roles)))
  with pytest.raises(checkpoint_lib.CheckpointMismatchError,
                     match=r"team\.roles\.repeater\.system_prompt: saved 'Repeat it\.', "
                           r"now 'Say 7\.'"):
    loop.train(other_team, resumed, model=model, progress=False)
  loop.train(train_config, resumed, model=model, progress=False)

  with checkpoint_lib.Checkpointer(resumed, read_only=True) as checkpointer:
    meta = checkpointer.read_meta(4)  # what it trained on, for launch.eval (none: echo)
  assert meta[trained_problems.KEY] == trained_problems.record(train_config, meta["envs"]) \
      == {"task": "echo", "problems": []}

  state_straight, template = _final_state(train_config, model, straight)
  state_resumed, _ = _final_state(train_config, model, resumed)
  _assert_trees_equal(state_straight, state_resumed)
  assert not np.array_equal(np.asarray(jax.tree.leaves(state_straight.policy)[0]),
                            np.asarray(jax.tree.leaves(template.policy)[0]))  # it trained
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/") and
                         not k.endswith("tok_s") and not k.endswith("_s")} for r in rows]
  assert strip(_metrics(straight)) == strip(_metrics(resumed))  # no iteration twice

  # The finished command relaunched, or with fewer iterations: nothing trains, nothing loads
  # (no model is passed, and the config's is SmolLM2), the log is untouched, and the result
  # is what the finished run returned (it was {} with NaN summaries, after loading the model).
  rows = _metrics(straight)
  for iterations in (4, 2):
    again = loop.train(dataclasses.replace(train_config, iterations=iterations), straight,
                       progress=False)
    assert again.keys() == finished.keys()
    np.testing.assert_allclose([again[k] for k in finished],
                               [float(finished[k]) for k in finished], rtol=1e-6)
  assert _metrics(straight) == rows


def test_agent_by_agent_update_leaves_the_other_agent_and_the_base_bit_identical(model,
                                                                                tmp_path):
  """K = 1: iteration 0 trains agent 0 only. Weight decay is on, so an unmasked AdamW step
  would move agent 1 even with a zero gradient."""
  train_config = _echo_config(
      "marft_a", num_envs=16, iterations=1,
      optimizer=config_lib.OptimizerSection(lr=5e-3, weight_decay=0.1, epochs=2,
                                            minibatches=2, agent_iteration_interval=1))
  before = jax.tree.map(np.array, model.params)
  state, template = _final_state(train_config, model, _trained(train_config, model, tmp_path))
  _assert_trees_equal(before, model.params)  # the base is never changed
  moved = lambda a: [not np.array_equal(np.asarray(x)[:, a], np.asarray(y)[:, a])
                     for x, y in zip(jax.tree.leaves(state.policy.layers),
                                     jax.tree.leaves(template.policy.layers))]
  assert any(moved(0)) and not any(moved(1))
  adam = state.policy_opt[0]  # adamw: (ScaleByAdamState, ...)
  for moment in (adam.mu, adam.nu):
    for leaf in jax.tree.leaves(moment.layers):
      assert np.all(np.asarray(leaf)[:, 1] == 0)  # agent 1's moments never advanced
      assert np.any(np.asarray(leaf)[:, 0] != 0)


def _trained(train_config, model, tmp_path):
  loop.train(train_config, str(tmp_path), model=model, progress=False)
  return str(tmp_path)


def test_nonfinite_loss_skips_the_update_and_is_counted(model, tmp_path, monkeypatch):
  """NaN advantages make every minibatch's loss NaN: nothing moves, each skip is counted,
  and the checkpoint written at the end holds the (finite) untouched state."""
  compute = run_lib.compute_advantages

  def nan_advantages(batch, *args, **kwargs):
    batch = compute(batch, *args, **kwargs)
    return batch.replace(turn_advantage=np.full_like(batch.turn_advantage, np.nan))

  monkeypatch.setattr(run_lib, "compute_advantages", nan_advantages)
  train_config = _echo_config("marft_a", num_envs=16, iterations=2)
  state, template = _final_state(train_config, model, _trained(train_config, model, tmp_path))
  _assert_trees_equal(state.policy, template.policy)
  _assert_trees_equal(state.critic, template.critic)
  steps = train_config.optimizer.epochs * train_config.optimizer.minibatches
  assert [m["nonfinite"] for m in _metrics(tmp_path)] == [steps, steps]


@pytest.mark.parametrize("algorithm,changes", [
    ("ppo", {}),
    ("shared_stream_ppo", {}),
    ("marft_a", {"critic": config_lib.CriticSection(mode="per_agent_lora", lora_rank=4,
                                                    hidden=(32,))}),
    ("marft_t", {"critic": config_lib.CriticSection(mode="per_agent_head", hidden=(32,)),
                 "team": config_lib.TeamSection(max_new_tokens=3, last_max_new_tokens=3,
                                                shared_adapter=True)}),
    ("marft_a", {"team": config_lib.TeamSection(max_new_tokens=3, last_max_new_tokens=3,
                                                graph="orchestrator",
                                                orchestrator_max_calls=2,
                                                orchestrator_max_new_tokens=4),
                 "rollout": config_lib.RolloutSection(num_envs=8, max_context=1024)}),
    ("marft_t", {"advantage": AdvantageConfig(kl_reward_coef=0.05, kl_reward_estimator="k1")}),
    ("marft_a", {"team": config_lib.TeamSection(
        roles=(config_lib.RoleSection("first", "Say it."),
               config_lib.RoleSection("second", "Say it."),
               config_lib.RoleSection("repeater", "Repeat it.", graded=True)),
        order="first,second,repeater", graph="dag",
        edges="first>repeater, second>repeater", max_new_tokens=3, last_max_new_tokens=3)}),
], ids=["ppo", "shared_stream_ppo", "per_agent_lora_critic", "per_agent_head_shared_adapter",
        "orchestrator", "kl_in_reward", "dag"])
def test_every_algorithm_and_critic_trains_the_policy_that_sampled(model, tmp_path, algorithm,
                                                                   changes):
  """Two iterations of each form: finite losses, adapters that move, and the learner's
  log-probs of the sampled tokens equal to the sampler's under the updated adapters."""
  train_config = _echo_config(algorithm, **{"num_envs": 8, "iterations": 2, **changes,
                                             "reward": config_lib.RewardSection(fn=VARIED)})
  state, template = _final_state(train_config, model, _trained(train_config, model, tmp_path))
  rows = _metrics(tmp_path)
  assert len(rows) == 2
  for row in rows:
    assert np.isfinite(row["loss"]) and row["nonfinite"] == 0, row
    assert row["logp/sampler_learner_max_gap"] < 1e-4, row
  assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(state.policy), jax.tree.leaves(template.policy)))


def test_init_from_starts_from_exported_peft_adapters(model, tmp_path):
  """The PEFT folders a checkpoint exports, given as --init_from, are the new run's start."""
  train_config = _echo_config("marft_a", num_envs=8, iterations=1)
  first = _trained(train_config, model, tmp_path / "first")
  state, _ = _final_state(train_config, model, first)
  exports = os.path.join(first, "exports", "step_1")
  folders = ",".join(os.path.join(exports, role) for role in ("helper0", "repeater"))
  restarted = dataclasses.replace(train_config, init_from=folders)
  start = run_lib.new_state(restarted, model)
  for x, y in zip(jax.tree.leaves(start.policy), jax.tree.leaves(state.policy)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)

  # A run from copies of them, whose folders are then gone (a preempted job restarting on
  # another host): the checkpoint wins on resume, and the folders are not read again.
  copies = shutil.copytree(exports, tmp_path / "init")
  restarted = dataclasses.replace(train_config, init_from=",".join(
      str(copies / role) for role in ("helper0", "repeater")))
  second = _trained(restarted, model, tmp_path / "second")
  shutil.rmtree(copies)
  resumed = dataclasses.replace(restarted, iterations=2)
  loop.train(resumed, second, model=model, progress=False)
  assert [m["step"] for m in _metrics(second)] == [0, 1]  # resumed after iteration 0
  assert checkpoint_lib.saved_steps(second) == [1, 2]
  with pytest.raises(FileNotFoundError, match="init_from="):  # a fresh run still needs them
    loop.train(resumed, str(tmp_path / "third"), model=model, progress=False)


def _bf16(model):
  """The trainer tests' tiny base with its weights and compute in bfloat16."""
  bf16_config = model.config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  return model_lib.Model(jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), model.params),
                        bf16_config, model.tokenizer)


def test_adapters_and_optimizer_state_stay_f32_over_a_bf16_base(model, tmp_path):
  bf16 = _bf16(model)
  train_config = _echo_config("marft_a", num_envs=8, iterations=1)
  state, _ = _final_state(train_config, bf16, _trained(train_config, bf16, tmp_path))
  for tree in (state.policy, state.policy_opt, state.critic, state.critic_opt):
    floats = [x.dtype for x in jax.tree.leaves(tree) if jax.numpy.issubdtype(x.dtype,
                                                                              np.floating)]
    assert floats and all(d == np.float32 for d in floats), floats
  row = _metrics(tmp_path)[0]
  assert np.isfinite(row["loss"]) and row["entropy"] > 0, row


def test_model_lora_update_f32_reaches_the_sampler_and_the_learner(model, tmp_path,
                                                                   monkeypatch):
  """model.lora_update_f32 is what every routed LoRA layer computes with: the sampler's
  (decoding layout), the learner's (routed under LoRA dropout) and a held-out evaluation's
  (`evaluate` on a base loaded with the default). What the setting does to the numbers
  (bf16 only): tests/train/test_update_behaviour.py::test_the_samplers_lora_update_in_f32_
  narrows_the_bfloat16_gap. Set to False, a value no forward had before this run (its
  compiles are new, so each is traced here), in bf16 (an f32 sampler folds a call's one
  adapter into its weights, `merge_lora`, and routes nothing)."""
  from marft_jax.lora.config import LoraConfig
  from marft_jax.models import layout as layout_lib, transformer
  from marft_jax.train import evaluate
  seen, dense = set(), transformer._dense

  def recording(x, p, adapter, call):
    if adapter is not None:
      seen.add((call.config.layout, call.config.lora_update_f32))
    return dense(x, p, adapter, call)

  monkeypatch.setattr(transformer, "_dense", recording)
  bf16 = _bf16(model)
  config = _echo_config("marft_a", num_envs=4, iterations=1,
                        lora=LoraConfig(rank=8, alpha=16.0, dropout_rate=0.1),
                        model=config_lib.ModelSection(param_dtype="bfloat16",
                                                      lora_update_f32=False))
  loop.train(config, str(tmp_path), model=bf16, progress=False)
  learner = dataclasses.replace(layout_lib.TRAINING, remat=config.model.remat)
  assert seen == {(layout_lib.decoding(), False), (learner, False)}, seen
  seen.clear()
  state, _ = _final_state(config, bf16, tmp_path)
  evaluate.evaluate(config, bf16, state.policy, num_problems=2)
  assert bf16.config.lora_update_f32  # the base as loaded: the run's config decides
  assert {flag for _, flag in seen} <= {False}, seen  # (traced again only if it differed)


def test_heldout_evaluation_during_training_is_evaluate_of_that_steps_policy(model, tmp_path):
  """eval_every=2 over 3 iterations: the untuned team at step 0, then the policies after 2 and
  3 updates (the last before the final checkpoint), each equal to `evaluate` run apart on the
  adapters restored from that step's checkpoint."""
  from marft_jax.train import evaluate
  config = _echo_config("marft_a", num_envs=8, iterations=3, eval_every=2, eval_episodes=6,
                        checkpoint_every=1)
  loop.train(config, str(tmp_path), model=model, progress=False)
  records = _metrics(tmp_path)
  heldout = {r["step"]: {k[len("heldout/"):]: v for k, v in r.items() if k.startswith("heldout/")}
             for r in records if "heldout/accuracy" in r}
  assert sorted(heldout) == [0, 2, 3]
  assert all("reward" in r for r in records if r["step"] < 3)  # merged into the iteration's
  expected = {0: evaluate.evaluate(config, model, None, num_problems=6)}
  for step in (2, 3):
    state, _ = _final_state(config, model, tmp_path, step=step)
    expected[step] = evaluate.evaluate(config, model, state.policy, num_problems=6)
  for step, result in expected.items():
    assert heldout[step] == pytest.approx({k: float(v) for k, v in result.items()}), step
