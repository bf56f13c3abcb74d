"""Rollouts record exactly what the sampler produced, and re-scoring reproduces it.

The tiny model and tokenizer (`models.tiny`) in the decoding layout, two LoRA adapters, the
echo environment. References: a direct `sampler.generate` call with the rollout's key (the
recorded tokens are the sampler's), a teacher-forced forward over each recorded sequence
with its per-token adapter ids (the behaviour log-probs), and re-encoding the whole stream
every turn (the shared stream's KV-cache continuation).
"""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import envs, rollout as rollout_lib
from marft_jax.lora.routing import Adapters
from marft_jax.models import layout, sampler, sampler_plan, tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.sampling import SamplingConfig
from marft_jax.models.targets import linear_shapes
from marft_jax.rollout import context

E = 3  # environments


@pytest.fixture(scope="module")
def model():
  tokenizer = tiny.tiny_tokenizer()
  base = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
  params = transformer.init_params(base, jax.random.key(0), std=0.1)
  config = base.replace(layout=layout.DECODING)
  rng = np.random.default_rng(1)
  # Factors normal(0, 0.1), scale 2: updates about half the base's outputs. At 0.3 they
  # outweighed the base and made some positions so ill-conditioned that two f32 paths of the
  # same maths moved a log-prob by 1e-4 (test_process_split's shared stream at another key:
  # 3.9× its 1e-5 allowance; at 0.1, 33 keys used at most 0.04 of it).
  layers = {name: {"a": jnp.asarray(rng.normal(0, 0.1, (2, 2, i, 4)), jnp.float32),
                   "b": jnp.asarray(rng.normal(0, 0.1, (2, 2, 4, o)), jnp.float32)}
            for name, (i, o) in linear_shapes(base).items()}
  return dict(tokenizer=tokenizer, base=base, params=params, config=config,
              fast=layout.convert_params(params, base.layout, config.layout),
              lora=Adapters(layers=layers, scale=2.0))


def _team(temperature=1.0, top_p=1.0):
  sampling = lambda n: SamplingConfig(max_new_tokens=n, temperature=temperature, top_p=top_p)
  return (envs.AgentProfile("reasoner", "Think about it.", "Thinks.", sampling(12)),
          envs.AgentProfile("actor", "Answer with the number.", "Answers.", sampling(6),
                            graded=True))


def _play(model, team, structure=None, seed=0, **config):
  batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), E, seed=seed)
  return rollout_lib.rollout(batch, team, structure, model["fast"], model["config"],
                             model["tokenizer"], jax.random.key(5), lora=model["lora"],
                             config=rollout_lib.RolloutConfig(**config), policy_version=3)


@functools.partial(jax.jit, static_argnames="config")
def _teacher_forced_logp(params, lora, tokens, adapter_ids, temperature, config):
  logits, _ = transformer.forward(params, tokens[None], config, lora=lora,
                                  adapter_ids=adapter_ids[None])
  logp = jax.nn.log_softmax(logits[0, :-1] / temperature[1:, None], axis=-1)
  return jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]


def _assert_rescoring_reproduces(model, sequence):
  """Teacher-forced log-probs (training layout, recorded adapter ids) = behaviour log-probs."""
  a = sequence.arrays()
  logp = _teacher_forced_logp(model["params"], model["lora"], jnp.asarray(a["tokens"]),
                         jnp.asarray(a["adapter_ids"]), jnp.asarray(a["temperature"]),
                         model["base"])
  mask = a["loss_mask"][1:]
  assert not a["loss_mask"][0]
  # f32 rounding grows with the length (a 450-token stream: 3e-5 on log-probs near -5, the
  # same in both layouts: it is the cached vs uncached summation order), hence rtol too.
  np.testing.assert_allclose(np.asarray(logp)[mask], a["behaviour_logprobs"][1:][mask],
                             atol=1e-5, rtol=1e-5)


def test_per_agent_rollout_records_the_sampler_output(model):
  team = _team(temperature=0.7)
  result = _play(model, team)
  assert result.metrics["episodes"] == E and result.metrics["dropped"] == 0
  for i, episode in enumerate(result.episodes):
    assert episode.policy_version == 3 and len(episode.sequences) == 2  # one per turn
    assert [t.role for t in episode.turns] == ["reasoner", "actor"]
    for agent, sequence in enumerate(episode.sequences):
      a = sequence.arrays()
      assert set(a["agent_ids"][a["loss_mask"]]) == {agent}
      assert set(a["adapter_ids"]) == {agent}  # prompt and reply through the agent's adapter
      _assert_rescoring_reproduces(model, sequence)
  # The first turn, by hand: the same prompts, key and settings through the sampler directly.
  tok = model["tokenizer"]
  prompts = [context.per_agent_prompt(tok, team[0], team, envs.Observation(ep.task), [], [])
             for ep in result.episodes]
  width = max(map(len, prompts))
  padded = np.array([p + [tok.pad_token_id] * (width - len(p)) for p in prompts])
  out = sampler.generate(model["fast"], padded, model["config"], rng=jax.random.fold_in(
      jax.random.key(5), 0), max_new_tokens=12, prompt_lens=[len(p) for p in prompts],
      lora=model["lora"], adapter_ids=[0] * E, temperature=0.7, eos_ids=tok.eos_token_id,
      pad_id=tok.pad_token_id, max_new_tokens_bucket=16)
  for row, episode in enumerate(result.episodes):
    n = int(out.lengths[row])
    reply = episode.sequences[0].arrays()
    np.testing.assert_array_equal(reply["tokens"][reply["loss_mask"]],
                                  np.asarray(out.tokens[row, :n]))
    np.testing.assert_array_equal(reply["tokens"][~reply["loss_mask"]], prompts[row])


def test_shared_stream_continues_the_cache_exactly_as_reencoding(model):
  team = _team()
  continued = _play(model, team, context_mode="shared_stream")
  reencoded = _play(model, team, context_mode="shared_stream", reencode=True)
  for a, b in zip(continued.episodes, reencoded.episodes):
    assert len(a.sequences) == 1  # one stream per episode
    sa, sb = a.sequences[0].arrays(), b.sequences[0].arrays()
    np.testing.assert_array_equal(sa["tokens"], sb["tokens"])
    # Cache sizes differ between the two, so the summation order does (see the rtol above).
    np.testing.assert_allclose(sa["behaviour_logprobs"], sb["behaviour_logprobs"], atol=1e-5,
                               rtol=1e-5)
    _assert_rescoring_reproduces(model, a.sequences[0])
    spans = a.sequences[0].spans
    assert [s.agent for s in spans] == [0, 1] and spans[0].end < spans[1].start
    # Both roles' own instructions are in the stream (the AReaL code drops the second).
    text = model["tokenizer"].decode(sa["tokens"])
    assert "Think about it." in text and "Answer with the number." in text


def test_shared_stream_cache_holds_what_the_turns_use(model, monkeypatch):
  """Every decode step attends over all of the cache's slots: the stream's cache starts at its
  first call's size and grows as turns need, instead of reserving 2 × max_context up front."""
  calls, generate = [], sampler.generate

  def recording(params, tokens, config, **kw):
    out = generate(params, tokens, config, **kw)
    used = int(np.max(kw["prompt_lens"]))
    longest = int(np.max(kw["max_new_tokens"]))
    calls.append((sampler_plan.bucket(used, sampler_plan.MIN_PROMPT_BUCKET, 4)
                  + sampler_plan.bucket(longest, sampler_plan.MIN_NEW_TOKENS_BUCKET, 4),
                  out.cache.size))
    return out

  monkeypatch.setattr(sampler, "generate", recording)
  result = _play(model, _team(), context_mode="shared_stream", max_context=1024)
  assert result.metrics["dropped"] == 0 and len(calls) == 2
  needed = sum(width for width, _ in calls)  # padded chunks + bucketed replies, all turns
  # Fresh: the first call's chunk and replies (a prefix that the rows share is bucketed on
  # its own, `sampler.generate(share_prefix=)`: that can shift the total by a bucket step).
  assert calls[0][1] <= calls[0][0] + sampler_plan.MIN_PROMPT_BUCKET
  assert calls[-1][1] <= sampler_plan.bucket(needed, sampler_plan.MIN_PROMPT_BUCKET, 4) < 1024


def test_dag_branches_see_only_their_ancestors(model):
  sampling = SamplingConfig(max_new_tokens=6)
  team = (envs.AgentProfile("a", "Root.", "r", sampling, adapter=0),
          envs.AgentProfile("b", "Left.", "l", sampling, adapter=1),
          envs.AgentProfile("c", "Right.", "r", sampling, adapter=0),
          envs.AgentProfile("d", "Join.", "j", sampling, adapter=1, graded=True))
  graph = envs.AgentGraph(("a", "b", "c", "d"), (("a", "b"), ("a", "c"), ("b", "d"),
                                                  ("c", "d")))
  assert graph.layers() == (("a",), ("b", "c"), ("d",))
  batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["d"]), 2)
  result = rollout_lib.rollout(batch, team, graph, model["fast"], model["config"],
                               model["tokenizer"], jax.random.key(1), lora=model["lora"])
  for episode in result.episodes:
    turns = {t.role: t for t in episode.turns}
    assert [t.role for t in episode.turns][0] == "a" and episode.turns[-1].role == "d"
    said = {role: f"{role.title()}: {turns[role].reply.strip()}" for role in "abc"}
    assert said["a"] in turns["b"].prompt and said["a"] in turns["c"].prompt
    if turns["b"].reply.strip() and turns["c"].reply.strip():
      assert said["c"] not in turns["b"].prompt and said["b"] not in turns["c"].prompt
    assert all(said[r] in turns["d"].prompt for r in "abc" if turns[r].reply.strip())


def test_orchestrator_schedule_routes_by_its_tags():
  team = _team()
  schedule = envs.Schedule(envs.Orchestrator(envs.orchestrator_profile(team), max_calls=2),
                           team)
  assert schedule.next_turn() == (2,)  # the orchestrator speaks first
  schedule.record(2, "The plan first. <call>Reasoner</call>")
  assert schedule.next_turn() == (0,)
  schedule.record(0, "steps")
  assert schedule.next_turn() == (2,)
  schedule.record(2, "<call>actor</call>")
  assert schedule.next_turn() == (1,)
  schedule.record(1, "7")
  schedule.record(2, "<call>reasoner</call>")  # a third call: over the limit of 2
  assert schedule.next_turn() == () and schedule.calls == 2
  done = envs.Schedule(envs.Orchestrator(envs.orchestrator_profile(team)), team)
  done.next_turn()
  done.record(2, "nothing to route")  # unparseable: the env step ends
  assert done.next_turn() == ()
  assert envs.parse_route("<call>x</call> <DONE/>", ["x"]) == "done"
  assert envs.parse_route("<call> actor </call>", ["actor"]) == "actor"
  assert envs.parse_route("<call>nobody</call>", ["actor"]) is None


def test_orchestrated_rollout_trains_the_routing_tokens(model):
  team = _team()
  orchestrator = envs.Orchestrator(envs.orchestrator_profile(team, adapter=1, max_new_tokens=8))
  result = _play(model, team, orchestrator, context_mode="shared_stream")
  for episode in result.episodes:
    assert episode.turns[0].role == "orchestrator"  # random text: rarely a valid route
    a = episode.sequences[0].arrays()
    assert 2 in set(a["agent_ids"][a["loss_mask"]])  # the orchestrator's tokens are trained
    _assert_rescoring_reproduces(model, episode.sequences[0])


def test_env_order_is_seeded_and_failures_are_counted(model):
  tasks = lambda r: [e.task for e in r.episodes]
  assert tasks(_play(model, _team(), seed=4)) == tasks(_play(model, _team(), seed=4))
  assert tasks(_play(model, _team(), seed=4)) != tasks(_play(model, _team(), seed=5))
  overflow = _play(model, _team(), max_context=40)  # the prompt alone is longer
  assert overflow.metrics["context_overflow"] == E and overflow.metrics["dropped"] == E
  assert all(e.dropped == "context_overflow" for e in overflow.episodes)
  # The default limit is the model's own positions (RoPE: shorter ones change no parameter).
  short = model["config"].replace(max_position_embeddings=40)
  capped = rollout_lib.rollout(envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), E),
                               _team(), None, model["fast"], short, model["tokenizer"],
                               jax.random.key(5), lora=model["lora"])
  assert capped.metrics["context_overflow"] == E
  with pytest.raises(ValueError, match="max_context=2048 exceeds the model's "
                                       "max_position_embeddings=1024"):
    _play(model, _team(), max_context=2048)
  # A budget that fills max_context alone leaves no turn possible: refused before anything
  # runs (it once played every episode to an overflow, and a run trained on nothing).
  for limit, config in ((12, model["config"]), (None, model["config"].replace(
      max_position_embeddings=12))):
    with pytest.raises(ValueError, match=r"agent 'reasoner': max_new_tokens=12 leaves no "
                                         r"position for its prompt within max_context=12"):
      rollout_lib.rollout(envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), E), _team(),
                          None, model["fast"], config, model["tokenizer"], jax.random.key(5),
                          lora=model["lora"],
                          config=rollout_lib.RolloutConfig(max_context=limit))

  class Broken(envs.EchoEnv):
    def step(self, actions):
      raise RuntimeError("grader crashed")

  batch = envs.EnvBatch(lambda i: Broken(graded=["actor"]) if i == 1 else
                        envs.EchoEnv(graded=["actor"]), E)
  result = rollout_lib.rollout(batch, _team(), None, model["fast"], model["config"],
                               model["tokenizer"], jax.random.key(0), lora=model["lora"])
  assert result.metrics["env_error"] == 1
  assert result.episodes[1].dropped.startswith("env_error: RuntimeError: grader crashed")
  assert result.episodes[0].dropped is None and result.episodes[0].rewards


def test_envs_that_may_step_together_are_stepped_together(model):
  """A batch whose envs allow 3 steps at once (as a code task's do, sharing a sandbox) has
  them stepped from 3 threads: each env's step waits at a barrier of 3, which one-by-one
  stepping would break (every episode dropped). Their rewards are the echo env's own, in env
  order, as if stepped one by one."""
  barrier = threading.Barrier(E, timeout=20)

  class Together(envs.EchoEnv):
    step_concurrency = E

    def step(self, actions):
      barrier.wait()
      return super().step(actions)

  together = rollout_lib.rollout(envs.EnvBatch(lambda i: Together(graded=["actor"]), E, seed=2),
                                 _team(), None, model["fast"], model["config"],
                                 model["tokenizer"], jax.random.key(0), lora=model["lora"])
  alone = rollout_lib.rollout(envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), E,
                                            seed=2),
                              _team(), None, model["fast"], model["config"],
                              model["tokenizer"], jax.random.key(0), lora=model["lora"])
  assert together.metrics["env_error"] == 0, [e.dropped for e in together.episodes]
  assert [e.rewards for e in together.episodes] == [e.rewards for e in alone.episodes]
  assert [e.infos for e in together.episodes] == [e.infos for e in alone.episodes]


@pytest.mark.parametrize("context_mode", ["per_agent", "shared_stream"])
@pytest.mark.parametrize("set_after", [1, 2])
def test_a_cancelled_rollout_stops_before_its_next_sampler_call_or_env_step(
    model, monkeypatch, context_mode, set_after):
  """The event is set (as the trainer's sampler thread sets it on Ctrl-C) during the reasoner's
  call (set_after 1) or the actor's (2): the rollout raises before the actor's call or before
  the env step, and makes neither. Unset, the same rollout makes both calls and the step."""
  cancel = threading.Event()
  calls, steps = [], []
  real_generate = sampler.generate

  def generate(*args, **kwargs):
    calls.append(1)
    if len(calls) == set_after:
      cancel.set()
    return real_generate(*args, **kwargs)

  class Counted(envs.EchoEnv):
    def step(self, actions):
      steps.append(1)
      return super().step(actions)

  monkeypatch.setattr(sampler, "generate", generate)
  play = lambda event: rollout_lib.rollout(
      envs.EnvBatch(lambda i: Counted(graded=["actor"]), E), _team(), None, model["fast"],
      model["config"], model["tokenizer"], jax.random.key(0), lora=model["lora"],
      config=rollout_lib.RolloutConfig(context_mode=context_mode), cancel=event)
  with pytest.raises(rollout_lib.RolloutCancelled, match=f"after {set_after} sampler calls"):
    play(cancel)
  assert (len(calls), len(steps)) == (set_after, 0)
  calls.clear()
  result = play(threading.Event())  # never set
  assert (len(calls), len(steps)) == (2, E) and result.metrics["dropped"] == 0


def test_cancel_is_refused_in_a_multi_process_layout(model):
  from marft_jax import multihost, sharding
  rows = multihost.ProcessRows(sharding.make_mesh(1, 1, 1))
  with pytest.raises(ValueError, match="cancel: one process only"):
    rollout_lib.rollout(envs.EnvBatch(lambda i: envs.EchoEnv(graded=["actor"]), E), _team(),
                        None, model["fast"], model["config"], model["tokenizer"],
                        jax.random.key(0), lora=model["lora"], rows=rows,
                        cancel=threading.Event())


def test_transcripts_are_one_readable_line_per_episode(model, tmp_path):
  import json
  result = _play(model, _team())
  path = rollout_lib.write_transcripts(str(tmp_path / "it_0.jsonl"), result.episodes)
  lines = [json.loads(line) for line in open(path)]
  assert len(lines) == E
  assert [t["role"] for t in lines[0]["turns"]] == ["reasoner", "actor"]
  assert lines[0]["task"].startswith("Repeat: ")
  assert "infos" in lines[0] and lines[0]["rewards"][0][1] in (0.0, 1.0)
