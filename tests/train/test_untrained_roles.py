"""Untrained roles weigh nothing: a `base` role's turns (the frozen model speaks) and, under the
agent-by-agent schedule, the turns of adapters not trained this iteration are left out of the
advantage whitening, the policy losses and the policy metrics; the critic still learns them.

References: the whitening as a NumPy formula over the turns that train, picked from the team
(`teams.adapter_ids`, `run_lib.active_adapters`) and the episodes' own spans, not from the batch's
masks; the loss and its metrics of the same batch with those turns removed by hand; the value
loss as ½R² over every turn. Teams are sampled (fixed seeds) from what a config can say:
roles "own" / "shared" / "base", `team.shared_adapter`, `optimizer.agent_iteration_interval`,
both context modes, both advantage levels, horizons 1 and 2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.rollout.episode import Episode, TokenSequence
from marft_jax.train import loop, teams
from marft_jax.train import run as run_lib
from marft_jax.train.build import learner as learner_lib
from marft_jax.train.advantages import NORMALIZE_EPS, AdvantageConfig, compute_advantages
from marft_jax.train.batching import act_positions, make_batch, trained_masks
from marft_jax.train.config import OptimizerSection, RoleSection, TeamSection, TrainConfig
from marft_jax.train.update import LossConfig, behaviour_metrics, losses
from tests.train.echo_config import tiny_trainer_model
from tests.train.test_update_loss import B, setup  # noqa: F401 (the module's fixture)

# --- the whitening, over teams sampled from the config space ------------------------------


def _sampled_team(rng):
  """A config's team and schedule: (TrainConfig, adapter id per role, [A] active, iteration)."""
  n = int(rng.integers(2, 5))
  kinds = list(rng.choice(["own", "shared", "base"], n))
  if all(k == "base" for k in kinds):
    kinds[int(rng.integers(n))] = "own"
  if kinds.count("shared") == 1:  # refused by the config: a role sharing with no one
    kinds[kinds.index("shared")] = "own"
  names = [f"r{i}" for i in range(n)]
  roles = tuple(RoleSection(name, "s", "d", graded=i == n - 1, adapter=kind)
                for i, (name, kind) in enumerate(zip(names, kinds)))
  team = TeamSection(roles=roles, order=",".join(names), shared_adapter=bool(rng.random() < .15))
  config = TrainConfig(team=team, optimizer=OptimizerSection(
      agent_iteration_interval=int(rng.choice([0, 1, 2]))))
  iteration = int(rng.integers(0, 4))
  ids = teams.adapter_ids(team, teams.declared(team, config.task.name)[0])[0]
  return config, ids, run_lib.active_adapters(config, iteration), iteration


def _episode(index, num_roles, ids, horizon, shared_stream, rng):
  """A chain's episode as the rollout records it: each role once per env step, replies of
  1-3 tokens sampled with the role's adapter (-1: the base). Returns (episode, turns) with
  turns [(env_step, agent)] in order."""
  turns = [(s, a) for s in range(horizon) for a in range(num_roles)]
  episode = Episode(env_index=index, seed=index, task="t", policy_version=0,
                    rewards=rng.normal(size=(horizon, num_roles)).tolist(),
                    dones=[s == horizon - 1 for s in range(horizon)])
  stream = TokenSequence()
  for n, (step, agent) in enumerate(turns):
    sequence = stream if shared_stream else TokenSequence()
    sequence.add_context(rng.integers(3, 50, 2), adapter=ids[agent])
    length = int(rng.integers(1, 4))
    sequence.add_reply(rng.integers(3, 50, length), np.zeros(length), agent, ids[agent], 1.0,
                       n, step)
    if not shared_stream:
      episode.sequences.append(sequence)
  if shared_stream:
    episode.sequences.append(stream)
  return episode


def _expected_trained(episodes, ids, active, shape_t, shape_k):
  """[B, T] decisions and [B, K] turns that train, from the episodes' spans and the team."""
  act, turn, row = np.zeros(shape_t, bool), np.zeros(shape_k, bool), 0
  for episode in episodes:
    for sequence in episode.sequences:
      for k, span in enumerate(sequence.spans):
        adapter = ids[span.agent]
        if adapter >= 0 and active[adapter]:
          turn[row, k] = True
          act[row, span.start - 1:span.end - 1] = True  # decision t emits token t + 1
      row += 1
  return act, turn


def _whitened(x, mask):
  """NumPy: (x − μ) / (σ + eps) over the entries of `mask` (population σ), 0 elsewhere."""
  out = np.zeros_like(x, np.float64)
  picked = x[mask].astype(np.float64)
  out[mask] = (picked - picked.mean()) / (picked.std() + NORMALIZE_EPS)
  return out


@pytest.mark.parametrize("seed", range(24))
def test_whitening_is_over_the_trained_turns_alone(seed):
  rng = np.random.default_rng(seed)
  config, ids, active, _ = _sampled_team(rng)
  level = ("action", "token")[seed % 2]
  shared_stream = seed % 4 >= 2
  horizon = int(rng.integers(1, 3))
  num_roles = len(ids)
  episodes = [_episode(e, num_roles, ids, horizon, shared_stream, rng) for e in range(3)]
  batch = make_batch(episodes, pad_id=0)
  batch = batch.replace(act_old_value=rng.normal(size=batch.tokens.shape).astype(np.float32))
  advantage = AdvantageConfig(level=level, gamma=0.9, lambda_=0.8, credit="per_step")
  raw = compute_advantages(batch, episodes, dataclasses.replace(advantage, normalize=False),
                           num_roles)
  out = compute_advantages(batch, episodes, dataclasses.replace(advantage, normalize=True),
                           num_roles, active=active)
  act, turn = _expected_trained(episodes, ids, active, batch.act_mask.shape,
                                batch.turn_valid.shape)
  assert turn.any()  # a config always trains something
  # An untrained turn's value still serves its predecessor's bootstrap: the returns (the
  # critic's targets, every turn's) do not depend on who trains.
  np.testing.assert_array_equal(out.turn_return, raw.turn_return)
  np.testing.assert_array_equal(out.act_return, raw.act_return)
  np.testing.assert_allclose(out.turn_advantage, _whitened(np.asarray(raw.turn_advantage), turn),
                             atol=2e-5)
  np.testing.assert_allclose(out.act_advantage, _whitened(np.asarray(raw.act_advantage), act),
                             atol=2e-5)


def test_trained_masks_read_per_row_and_per_token_adapter_ids():
  """The per-row form of `per_row_adapters` gives the masks of its per-token form."""
  rng = np.random.default_rng(7)
  ids = (1, -1, 0)
  episodes = [_episode(e, 3, ids, 2, False, rng) for e in range(2)]
  batch = make_batch(episodes, pad_id=0)
  per_row = batch.replace(adapter_ids=np.asarray(ids * 4, np.int32))  # rows in turn order
  for active in (None, np.array([True, False]), np.array([False, True])):
    want = _expected_trained(episodes, ids, np.ones(2, bool) if active is None else active,
                             batch.act_mask.shape, batch.turn_valid.shape)
    for b in (batch, per_row):
      got = trained_masks(b, active)
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_array_equal(got[1], want[1])


# --- the losses and the policy metrics --------------------------------------------------------

POLICY_METRICS = ("policy_loss", "approx_kl", "clip_fraction", "entropy", "kl_to_base",
                  "first_ratio_max_dev", "behaviour/first_ratio_max_dev")


def _with_base_turns(batch):
  """`test_update_loss`'s batch with per-token adapter ids: row 2 is a `base` role's turn
  (every token on the base), row 1's second turn is a `base` role's reply in a shared stream
  (adapter 1 before it)."""
  T = batch.tokens.shape[1]
  ids = np.broadcast_to(np.asarray(batch.adapter_ids)[:, None], (B, T)).copy()
  ids[2] = -1
  second = np.flatnonzero(np.asarray(batch.act_turn[1]) == 1)
  ids[1, second + 1] = -1  # decision t's token is token t + 1
  return batch.replace(adapter_ids=ids)


def _without(batch, act_out, turn_out):
  """The batch with the given decisions and turns removed by hand (as if never sampled)."""
  act_mask = np.asarray(batch.act_mask) & ~act_out
  return batch.replace(act_mask=act_mask, turn_valid=np.asarray(batch.turn_valid) & ~turn_out,
                       act_turn=np.where(act_mask, batch.act_turn, -1),
                       act_positions=act_positions(act_mask))


def _aux(setup, batch, level, correction, trained=None, critic_values=None):  # noqa: F811
  config = LossConfig(policy_level=level, behaviour_correction=correction, entropy_coef=0.1,
                      kl_coef=0.2, huber_delta=None, value_clip=None)
  total, aux = losses(setup["policy"], None, setup["params"], batch, setup["extras"],
                      model_config=setup["config"], config=config,
                      critic_values=critic_values, trained=trained)
  aux = {k: float(v) for k, v in aux.items()}
  aux.update({"total": float(total)}, **{k: float(v) for k, v in behaviour_metrics(
      batch, setup["extras"].old_logp, config, trained).items() if "weight" in k})
  return aux


@pytest.mark.parametrize("level,correction", [("action", "on"), ("token", "off"),
                                              ("token", "on")])
def test_untrained_turns_weigh_nothing_in_the_losses_and_metrics(setup, level,  # noqa: F811
                                                                correction):
  batch = _with_base_turns(setup["batch"])
  act_adapter = np.where(batch.act_mask, np.roll(batch.adapter_ids, -1, axis=1), -1)
  for active in (None, np.array([True, False]), np.array([False, True])):
    on = np.ones(2, bool) if active is None else active
    act_out = batch.act_mask & ((act_adapter < 0) | ~on[np.maximum(act_adapter, 0)])
    turn_out = np.zeros(batch.turn_valid.shape, bool)
    for r, k in zip(*np.nonzero(batch.turn_valid)):  # a turn is its decisions
      turn_out[r, k] = act_out[r, np.asarray(batch.act_turn[r]) == k].all()
    assert act_out.any() and turn_out.any() and (batch.act_mask & ~act_out).any()
    trained = None if active is None else trained_masks(batch, active)
    got = _aux(setup, batch, level, correction, trained)
    want = _aux(setup, _without(batch, act_out, turn_out), level, correction)
    for key in POLICY_METRICS + ("total", "behaviour/weight_mean", "behaviour/weight_max",
                                 "behaviour/weight_dropped"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_the_critic_still_learns_untrained_turns(setup):  # noqa: F811
  """Value loss ½R² (values 0, no clip) over every turn, a `base` role's included."""
  batch = _with_base_turns(setup["batch"])
  returns = np.random.default_rng(3).normal(size=batch.turn_valid.shape).astype(np.float32)
  batch = batch.replace(turn_return=returns)
  zeros = lambda critic, params, b, extras, positions=None: jnp.zeros(positions.shape)
  got = _aux(setup, batch, "action", "off", trained_masks(batch, np.array([True, False])),
             critic_values=zeros)["value_loss"]
  valid = np.asarray(batch.turn_valid)
  np.testing.assert_allclose(got, np.mean(0.5 * returns[valid] ** 2), rtol=1e-6)
  assert valid.sum() > trained_masks(batch, np.array([True, False]))[1].sum()


# --- end to end: one iteration of the trainer ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
  return tiny_trainer_model()


# (role adapters in order, agent_iteration_interval, context mode): a `base` role beside an
# own adapter; two `shared` roles around an own one, the agent-by-agent schedule training only
# the own adapter at iteration 0 (a shared stream: the frozen turns share rows with it).
END_TO_END = {"base": (("base", "own"), 0, "per_agent"),
              "shared": (("shared", "own", "shared"), 1, "shared_stream")}


@pytest.mark.parametrize("case", sorted(END_TO_END))
def test_one_iteration_trains_only_the_trained_roles(tiny_model, tmp_path, monkeypatch, case):
  from tests.train.echo_config import echo_config
  kinds, interval, context = END_TO_END[case]
  shipped = teams.shipped("echo", len(kinds))
  roles = tuple(dataclasses.replace(r, adapter=k) for r, k in zip(shipped["roles"], kinds))
  base = echo_config("marft_a" if context == "per_agent" else "shared_stream_ppo",
                     num_envs=4, iterations=1)
  config = dataclasses.replace(
      base, team=dataclasses.replace(base.team, roles=roles, order=shipped["order"],
                                     num_roles=0),
      rollout=dataclasses.replace(base.rollout, max_context=512),
      optimizer=dataclasses.replace(base.optimizer, agent_iteration_interval=interval,
                                    epochs=1))
  ids = teams.adapter_ids(config.team, roles)[0]
  active = run_lib.active_adapters(config, 0)
  seen = {}
  real_make_update = learner_lib.make_update

  def recording_make_update(*args, **kwargs):
    update = real_make_update(*args, **kwargs)

    def recorded(state, params, batch, extras, active, *rest):
      seen.update(before=jax.device_get(state.policy), batch=jax.device_get(batch),
                  active=np.asarray(active))
      out = update(state, params, batch, extras, active, *rest)
      seen["after"] = jax.device_get(out[0].policy)
      return out

    return recorded

  def recording_advantages(batch, episodes, advantage, *args, **kwargs):
    raw = compute_advantages(batch, episodes, dataclasses.replace(advantage, normalize=False),
                             *args, **kwargs)
    seen["raw"] = jax.device_get(raw)
    return compute_advantages(batch, episodes, advantage, *args, **kwargs)

  monkeypatch.setattr(learner_lib, "make_update", recording_make_update)
  monkeypatch.setattr(run_lib, "compute_advantages", recording_advantages)
  metrics = loop.train(config, str(tmp_path), model=tiny_model, progress=False)
  batch = seen["batch"]
  np.testing.assert_array_equal(seen["active"], active)
  # Which turns train, read from the batch's sampled adapters and checked against the team.
  act_adapter = np.where(batch.act_mask, np.roll(
      np.broadcast_to(batch.adapter_ids[:, None], batch.act_mask.shape)
      if batch.adapter_ids.ndim == 1 else batch.adapter_ids, -1, axis=1), -1)
  turn_adapter = np.take_along_axis(act_adapter, batch.turn_value_pos, axis=1)
  valid = batch.turn_valid
  np.testing.assert_array_equal(turn_adapter[valid], np.asarray(ids)[batch.turn_agent[valid]])
  trained = valid & (turn_adapter >= 0) & active[np.maximum(turn_adapter, 0)]
  assert trained.any() and (valid & ~trained).any()
  # The whitening's pool is the trained turns (decisions at the token level).
  if case == "base":  # action level: one advantage a turn
    got, raw, mask = batch.turn_advantage, seen["raw"].turn_advantage, trained
  else:  # token level: one a decision
    got, raw = batch.act_advantage, seen["raw"].act_advantage
    mask = batch.act_mask & (act_adapter >= 0) & active[np.maximum(act_adapter, 0)]
  np.testing.assert_allclose(got, _whitened(np.asarray(raw), mask), atol=2e-5)
  # Trained adapters moved; frozen ones kept every bit.
  for a, on in enumerate(active):
    moved = not all(np.array_equal(np.asarray(x)[:, a], np.asarray(y)[:, a]) for x, y in zip(
        jax.tree.leaves(seen["before"].layers), jax.tree.leaves(seen["after"].layers)))
    assert moved == bool(on), (a, on)
  for key in POLICY_METRICS + ("value_loss",):
    assert np.isfinite(metrics[key]), key
