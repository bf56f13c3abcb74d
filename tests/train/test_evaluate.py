"""Held-out evaluation, checked against counts made independently of the graders.

The base model here is built by hand so that its greedy replies are known: attention and MLP
outputs are zero, so the last hidden state is the current token's embedding and the next token
depends on the current token only (a script: "1" after any unscripted token, then the stop
token). A hand-built LoRA on the last MLP's down projection switches one agent's answer to
"0". On the echo task with numbers from {0, 1}, accuracy must then be the share of episodes
whose task shows the number the script answers, counted from the task text.
"""

import asyncio
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from launch import cli
from marft_jax import lora as lora_lib
from marft_jax.configs import to_config_dict
from marft_jax.models import tiny
from marft_jax.train import config as config_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train import trained_problems
from marft_jax.train.checkpoint import CheckpointMismatchError, Checkpointer
from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOS = "<|im_end|>"
PUSH = 63  # the hidden dimension the hand-built adapter writes; lm_head reads it as "0"
ANSWER_1 = {None: "1", "1": EOS, "0": EOS}  # the echo script: reply "1" (and "0" -> stop)
BOXED_1 = {None: "\\", "\\": "b", "b": "o", "o": "x", "x": "ed", "ed": "{", "{": "1", "1": "}",
           "}": EOS}  # reply "\boxed{1}"


def scripted_model(script) -> model_lib.Model:
  """The base model of the module docstring: after token t its greedy reply is script[t]
  (script[None] after any token the script does not name)."""
  params, config, tokenizer = tiny.tiny_model(tie_word_embeddings=False,
                                              max_position_embeddings=1024)
  token_id = lambda t: tokenizer.eos_token_id if t == EOS else tokenizer.convert_tokens_to_ids(t)
  V, D = config.vocab_size, config.hidden_size
  embed, lm_head = np.zeros((V, D), np.float32), np.zeros((D, V), np.float32)
  embed[:, 0] = 1.0  # every unscripted token: class 0
  for cls, (token, nxt) in enumerate(script.items()):
    if token is not None:
      embed[token_id(token)] = np.eye(D)[cls]
    lm_head[cls, token_id(nxt)] = 10.0
  lm_head[PUSH, token_id("0")] = 10.0
  layers = jax.tree.map(np.zeros_like, params["layers"])
  for norm in ("input_norm", "post_attention_norm"):
    layers[norm] = np.ones_like(layers[norm])
  # the last layer's MLP input is silu(8) * 8 ≈ 64 on unit 0 at class-0 tokens, 0 elsewhere
  layers["gate_proj"]["kernel"][-1, 0, 0] = layers["up_proj"]["kernel"][-1, 0, 0] = 1.0
  params = {"embed": embed, "lm_head": lm_head, "final_norm": np.ones((D,), np.float32),
            "layers": layers}
  return model_lib.Model(jax.tree.map(jax.numpy.asarray, params), config, tokenizer)


def answer_zero_adapters(config, model, adapter):
  """The run's adapters, all off (B = 0) but `adapter`, which replies "0" where the base says
  "1": its down_proj LoRA adds ≈100 on PUSH at class-0 tokens, outweighing unit 0."""
  policy = lora_lib.init_adapters(config.lora, model.config, jax.random.key(0),
                                  config.num_adapters)
  layers = jax.tree.map(np.array, policy.layers)
  a, b = layers["down_proj"]["a"], layers["down_proj"]["b"]
  a[-1, adapter] = 0.0
  a[-1, adapter, 0, 0] = 1.0
  b[-1, adapter, 0, PUSH] = 100.0 / (policy.scale * 64.0)
  return policy.replace(layers=jax.tree.map(jax.numpy.asarray, layers))


def _config(source="smollm2", **task):
  base = config_lib.preset("marft_a")
  return dataclasses.replace(
      base, model=config_lib.ModelSection(source=source),
      task=config_lib.TaskSection(**{"name": "echo", "eval_problems": 10, **task,
                                     # read by the echo task only (refused by the others)
                                     **({"echo_high": 2} if task.get("name", "echo") == "echo"
                                        else {})}),
      team=dataclasses.replace(base.team, max_new_tokens=4, last_max_new_tokens=4),
      rollout=dataclasses.replace(base.rollout, max_context=256))


def _shown(episodes):
  return [int(e.task.split(":")[-1]) for e in episodes]


def _replies(episodes):
  return {(t.role, t.reply) for e in episodes for t in e.turns}


def test_accuracy_is_the_share_of_tasks_showing_the_scripted_answer():
  model, config = scripted_model(ANSWER_1), _config()
  team, _ = evaluate_lib.greedy_team(config)
  assert all(p.sampling.temperature == 0.0 for p in team)
  untuned = evaluate_lib.play(config, model, num_problems=12, batch_size=5)
  shown = _shown(untuned)
  assert len(untuned) == 12 and 0 < shown.count(1) < 12, shown  # both answers are asked for
  assert _replies(untuned) == {("helper0", "1"), ("repeater", "1")}
  summary = evaluate_lib.summarize(untuned, team)
  assert summary["accuracy"] == summary["accuracy/repeater"] == shown.count(1) / 12
  assert summary["reply_tokens/repeater"] == summary["reply_tokens/helper0"] == 2.0  # + stop
  assert summary["episodes"] == 12 and summary["dropped"] == 0

  policy = answer_zero_adapters(config, model, adapter=1)  # the repeater's adapter only
  tuned = evaluate_lib.play(config, model, policy, num_problems=12, batch_size=5)
  assert [e.task for e in tuned] == [e.task for e in untuned]  # the same held-out tasks
  assert _replies(tuned) == {("helper0", "1"), ("repeater", "0")}
  metrics = evaluate_lib.summarize(tuned, team)
  assert metrics["accuracy"] == metrics["accuracy/repeater"] == shown.count(0) / 12


def test_a_problems_samples_encode_their_shared_prompt_once_and_sample_as_before(monkeypatch):
  """Sampled evaluation (n = 4 at T = 1, 3 problems, two agents) on a random tiny model: the
  episodes equal those of the same call with every prompt encoded in full (group prefixes
  switched off), and the calls did encode group prefixes: the first agent's whole prompt,
  the second's task."""
  params, config, tokenizer = tiny.tiny_model(max_position_embeddings=1024)
  model = model_lib.Model(params, config, tokenizer)
  run = dataclasses.replace(_config(), team=dataclasses.replace(
      _config().team, max_new_tokens=6, last_max_new_tokens=6))
  from marft_jax.models import sampler_plan  # noqa: PLC0415
  play = lambda: evaluate_lib.play(run, model, num_problems=3, batch_size=8, samples=4,
                                   temperature=1.0)
  encoded = []
  original = sampler_plan._encode_group_prefixes
  counted = lambda *a, **k: encoded.append(a[1].shape) or original(*a, **k)
  counted.lower = original.lower  # a compile ahead is not a call
  monkeypatch.setattr(sampler_plan, "_encode_group_prefixes", counted)
  grouped = play()
  # one prefix per problem (2 a call), each problem's own: not one shared by every row
  assert len(encoded) >= 2 and {shape[0] for shape in encoded} == {2}, encoded
  monkeypatch.setattr(sampler_plan, "group_prefixes", lambda *a, **k: None)
  plain = play()
  assert len(grouped) == len(plain) == 12
  for a, b in zip(grouped, plain):
    assert a.task == b.task and [t.reply for t in a.turns] == [t.reply for t in b.turns]
    for x, y in zip(a.sequences, b.sequences):
      np.testing.assert_array_equal(x.tokens, y.tokens)
      np.testing.assert_allclose(x.behaviour_logprobs, y.behaviour_logprobs, atol=1e-5)


@pytest.mark.parametrize("graph", ["dag", "orchestrator"])
def test_a_graph_team_is_evaluated_greedily_from_its_checkpoint(graph, tmp_path):
  """Every role greedy, and the orchestrator's routing turns too; a DAG is played as it is,
  and its checkpoint's adapters restore (both once failed: a DAG was taken for an
  orchestrator)."""
  base = _config()
  roles = (config_lib.RoleSection("left", "Say the number."),
           config_lib.RoleSection("right", "Say the number."),
           config_lib.RoleSection("repeater", "Repeat the number.", graded=True))
  edges = "left>repeater, right>repeater" if graph == "dag" else ""
  config = dataclasses.replace(base, team=dataclasses.replace(
      base.team, roles=roles, order="left,right,repeater", graph=graph, edges=edges,
      num_roles=3, temperature=0.7))
  team, structure = evaluate_lib.greedy_team(config)
  assert [p.sampling.temperature for p in team] == [0.0] * 3
  model = scripted_model(ANSWER_1)
  policy = answer_zero_adapters(config, model, adapter=2)  # the repeater's
  _checkpoint(str(tmp_path), config, model, policy)
  restored, _ = evaluate_lib.restore_policy(config, model, str(tmp_path))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(policy)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if graph == "orchestrator":
    assert structure.profile.sampling.temperature == 0.0
    return
  assert structure == team_lib.build_team(config)[1]
  episodes = evaluate_lib.play(config, model, restored, num_problems=3, batch_size=3)
  assert [[t.role for t in e.turns] for e in episodes] == [["left", "right", "repeater"]] * 3
  assert _replies(episodes) == {("left", "1"), ("right", "1"), ("repeater", "0")}


def test_arithmetic_is_evaluated_on_the_test_split_with_the_answer_format():
  model = scripted_model(BOXED_1)
  config = _config(name="arithmetic", level=1)
  config = dataclasses.replace(config, team=dataclasses.replace(
      config.team, max_new_tokens=12, last_max_new_tokens=12))
  episodes = evaluate_lib.play(config, model, num_problems=4, batch_size=4)
  assert _replies(episodes) == {("reasoner", "\\boxed{1}"), ("actor", "\\boxed{1}")}
  infos = [e.infos[-1] for e in episodes]
  assert all("-test-" in i["problem_id"] for i in infos), [i["problem_id"] for i in infos]
  summary = evaluate_lib.summarize(episodes, evaluate_lib.greedy_team(config)[0])
  assert summary["answer_format_rate/actor"] == 1.0
  assert summary["accuracy/actor"] == sum(i["gold"] == "1" for i in infos) / 4


def test_a_problem_file_is_scored_on_its_held_out_part_only(tmp_path):
  """No test file: the fixed held-out 10 % of task.path, each problem once (fewer than
  asked for), none of them a problem the training envs draw."""
  from marft_jax.envs import splits
  path = tmp_path / "problems.jsonl"
  path.write_text("".join(json.dumps({"question": f"What is {n} + 0?", "answer": f"#### {n}"})
                          + "\n" for n in range(20)))
  config = _config(name="math_jsonl", path=str(path))
  config = dataclasses.replace(config, team=dataclasses.replace(
      config.team, max_new_tokens=12, last_max_new_tokens=12))
  episodes = evaluate_lib.play(config, scripted_model(BOXED_1), num_problems=10)
  played = [e.infos[-1]["problem_id"] for e in episodes]
  train, test = splits.task_problems("math_jsonl", str(path))
  assert sorted(played) == sorted(p.id for p in test) and len(played) == 2
  assert set(played).isdisjoint(p.id for p in train)


def test_a_grpo_team_is_evaluated_one_episode_per_task():
  """GRPO trains on groups of rollouts of a task (its config refuses group_size 1); held-out
  evaluation plays each task once, greedy, like every other algorithm's."""
  model = scripted_model(ANSWER_1)
  base = _config()
  grpo = dataclasses.replace(config_lib.preset("grpo"), model=base.model, task=base.task,
                             team=base.team,
                             rollout=dataclasses.replace(config_lib.preset("grpo").rollout,
                                                         max_context=256))
  assert grpo.rollout.group_size > 1
  episodes = evaluate_lib.play(grpo, model, num_problems=6, batch_size=3)
  untuned = evaluate_lib.play(base, model, num_problems=6, batch_size=3)
  assert [e.task for e in episodes] == [e.task for e in untuned]  # the same held-out tasks
  assert len({e.task for e in episodes}) > 1  # not one task played by a group


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A workdir holding a checkpoint (as the trainer writes one) of the answer-"0" repeater,
  the scripted base saved as a Hugging Face folder, and their config."""
  root = tmp_path_factory.mktemp("eval")
  folder = str(root / "model")
  os.makedirs(folder)
  model = scripted_model(ANSWER_1)
  from safetensors.numpy import save_file
  from marft_jax.models.hf_checkpoint import hf_config_dict, hf_tensors
  save_file(hf_tensors(model.params, model.config), os.path.join(folder, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config_dict(model.config), f)
  model.tokenizer.save_pretrained(folder)
  config = _config(source=folder)
  model = model_lib.load(config)
  policy = answer_zero_adapters(config, model, adapter=1)
  workdir = str(root / "run")
  _checkpoint(workdir, config, model, policy)
  return workdir, config, model, policy


def _checkpoint(workdir, config, model, policy, record=True):
  """Writes `policy` as the trainer would: a checkpoint with its config, its data cursor
  (each environment 1 episode in) and (`record`) its training problems in the meta."""
  state = run_lib.new_state(config, model).replace(policy=policy)
  cursor = {"seed": config.seed, "episodes": [1] * config.rollout.num_envs}
  meta = {"iteration": 3, "config": to_config_dict(config).to_dict(), "envs": cursor}
  if record:
    meta[trained_problems.KEY] = trained_problems.record(config, cursor)
  with Checkpointer(workdir) as checkpointer:
    checkpointer.save(3, state, meta, force=True)


@pytest.fixture(scope="module")
def arithmetic_run(run, tmp_path_factory):
  """A checkpoint of the same base and adapters, trained (so its config says) on arithmetic:
  the math team, whose actor (adapter 1) replies "0"."""
  _, echo_config, model, policy = run
  config = dataclasses.replace(echo_config, task=config_lib.TaskSection(name="arithmetic"))
  workdir = str(tmp_path_factory.mktemp("arithmetic") / "run")
  _checkpoint(workdir, config, model, policy)
  return workdir, config, model, policy


def test_restore_policy_gives_the_checkpoint_adapters_or_names_the_differing_key(run, caplog):
  workdir, config, model, policy = run
  elsewhere = dataclasses.replace(
      config, iterations=50, seed=5, task=dataclasses.replace(
          config.task, eval_problems=3, echo_high=5),
      team=dataclasses.replace(config.team, max_new_tokens=7, temperature=0.9))
  grpo = config_lib.preset("grpo", model=config.model, task=config.task, team=config.team)
  # What the evaluation logs: the episodes' settings that changed, not the training-only ones.
  assert evaluate_lib.changed_settings(config, elsewhere) == [
      "task.echo_high: trained with 2, now 5",  # not eval_problems: training never read it
      "team.max_new_tokens: trained with 4, now 7"]  # not the temperature: played greedily
  assert evaluate_lib.changed_settings(config, grpo) == [  # the preset's, not the run's
      "rollout.max_context: trained with 256, now 0"]
  # The bf16 LoRA update's rounding shapes a bf16 run's episodes only.
  for dtype, shown in (("bfloat16", True), ("float32", False)):
    old, new = (dataclasses.replace(config, model=dataclasses.replace(
        config.model, param_dtype=dtype, lora_update_f32=v)) for v in (False, True))
    assert evaluate_lib.changed_settings(old, new) == (
        ["model.lora_update_f32: trained with False, now True"] if shown else []), dtype
  for evaluated in (elsewhere, grpo):  # another task, seed, sampling, algorithm and critic
    caplog.clear()
    with caplog.at_level(logging.WARNING):
      restored, step = evaluate_lib.restore_policy(evaluated, model, workdir)
    assert step == 3
    changed = evaluate_lib.changed_settings(config, evaluated)
    logged = [r.getMessage() for r in caplog.records]
    assert [m for m in logged if "evaluated with settings other" in m] == [
        f"{workdir}: step 3 is evaluated with settings other than it trained with: "
        + "; ".join(changed)]
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(policy)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(CheckpointMismatchError, match=r"lora.rank: saved 8, now 4"):
    evaluate_lib.restore_policy(dataclasses.replace(
        config, lora=dataclasses.replace(config.lora, rank=4)), model, workdir)
  with pytest.raises(CheckpointMismatchError, match=r"team.shared_adapter: saved False"):
    evaluate_lib.restore_policy(dataclasses.replace(
        config, team=dataclasses.replace(config.team, shared_adapter=True)), model, workdir)
  with pytest.raises(CheckpointMismatchError, match=r"team roles .*'repeater'.*'actor'"):
    evaluate_lib.restore_policy(dataclasses.replace(  # the math team: other roles
        config, task=config_lib.TaskSection(name="arithmetic")), model, workdir)
  with pytest.raises(FileNotFoundError, match="no checkpoints"):
    evaluate_lib.restore_policy(config, model, os.path.join(workdir, "nothing"))
  assert not os.path.exists(os.path.join(workdir, "nothing"))  # read only: nothing created


# `python -m launch.eval` as a user runs it, each rollout call's number of episodes printed
# first as "rollout_call=<n>": what --eval_batch must reach.
_COUNTING_EVAL = """
import runpy, sys
from marft_jax.train import run as run_lib
real = run_lib.rollout
def counting(envs, *args, **kwargs):
  print(f"rollout_call={len(envs)}", flush=True)
  return real(envs, *args, **kwargs)
run_lib.rollout = counting
sys.argv[0] = "launch/eval.py"
runpy.run_module("launch.eval", run_name="__main__")
"""


def _launch_eval(workdir, config, *flags, count_calls=False):
  """`python -m launch.eval` on `workdir`'s checkpoint with the tests' short replies (a
  `--config=` file among `flags` must come before the overrides): (the finished process, its
  eval.json); `count_calls`: through `_COUNTING_EVAL`."""
  flags = [f"--workdir={workdir}", *flags, f"--config.model.source={config.model.source}",
           "--config.team.max_new_tokens=4", "--config.team.last_max_new_tokens=4",
           "--config.rollout.max_context=256"]
  script = ["-c", _COUNTING_EVAL] if count_calls else ["-m", "launch.eval"]
  out = subprocess.run([sys.executable, *script, *flags], capture_output=True,
                       text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))  # one device, as a user's
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, f"{_results_name(flags)}.json")) as f:
    return out, json.load(f)


def _results_name(flags) -> str:
  """The file stem launch.eval writes under `flags`, spelled out: eval.json when greedy,
  eval_n<n>_t<T>.json when sampled."""
  given = dict(flag.lstrip("-").split("=", 1) for flag in flags if "=" in flag)
  n, t = given.get("samples_per_problem", "1"), given.get("temperature", "0")
  return "eval" if n == "1" and float(t) == 0 else f"eval_n{n}_t{t}"


def test_launch_eval_scores_an_arithmetic_run_on_a_math_file(arithmetic_run, tmp_path):
  """Trained on generated arithmetic, scored on a JSONL test file: the task section differs
  from the checkpoint's, the model, LoRA and team do not. Two problems of the file are ones
  the run was given (its environments' first episodes, as the trainer's envs deal them):
  they are left out."""
  workdir, config, _, _ = arithmetic_run
  golds = [0, 0, 1, 2]
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=config.seed)  # the run's: 1 episode each
  seen = [envs.reset(i)[1].task for i in (3, 11)]
  envs.close()
  test_file = tmp_path / "test.jsonl"
  test_file.write_text("".join(json.dumps({"question": f"What is {g} + 0?", "answer": f"#### {g}"})
                               + "\n" for g in golds) +
                       "".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n"
                               for q in seen))
  on_file = ("--config.task.name=math_jsonl", f"--config.task.test_path={test_file}")
  # --eval_batch=7: at most 2 problems' 3 samples a call, so the 4 problems take 2 calls.
  out, written = _launch_eval(workdir, config, *on_file, "--samples_per_problem=3",
                              "--temperature=0.05", "--pass_at=1,3", "--eval_batch=7",
                              count_calls=True)
  assert _calls(out) == [6, 6]
  assert written["episodes"] == 12 and written["checkpoint_step"] == 3  # the file, 3 times
  assert written["problems"] == 4 and written["decoding"] == "n=3 T=0.05"
  # The scripted replies hold at T = 0.05 (logit gap 10 / 0.05): every sample alike.
  assert written["accuracy"] == written["accuracy/actor"] == golds.count(0) / 4  # adapters on
  assert written["pass@1/actor"] == written["pass@3/actor"] == golds.count(0) / 4
  assert f"pass@3/actor={golds.count(0) / 4:.4g}" in out.stdout.splitlines()
  assert written["training_problems_dropped"] == 2
  assert "training_problems_dropped=2" in out.stdout.splitlines()
  # Greedy, one episode a call: the same problems in the same order, the same replies (the
  # script's at T = 0.05 too) and scores.
  sampled = _transcripts(workdir, "eval_n3_t0.05")
  out, greedy = _launch_eval(workdir, config, *on_file, "--eval_batch=1", count_calls=True)
  assert _calls(out) == [1, 1, 1, 1] and greedy["decoding"] == "greedy"
  assert _transcripts(workdir) == sampled[::3]
  assert greedy["accuracy/actor"] == written["accuracy/actor"]
  # Each wrote its own files: the greedy evaluation left the sampled one as it was.
  with open(os.path.join(workdir, "eval_n3_t0.05.json")) as f:
    assert json.load(f) == written
  assert _transcripts(workdir, "eval_n3_t0.05") == sampled
  # The finished calls kept while it ran (eval_progress) went with the results written.
  assert not [name for name in os.listdir(workdir) if name.endswith(".calls")]
  # A folder of another evaluation's calls is refused in one line naming it, and kept.
  stale = os.path.join(workdir, "eval.calls")
  os.makedirs(stale)
  with open(os.path.join(stale, "settings.json"), "w") as f:
    json.dump({"checkpoint_step": 1}, f)
  out = subprocess.run([sys.executable, "-m", "launch.eval", f"--workdir={workdir}", *on_file,
                        f"--config.model.source={config.model.source}",
                        "--config.team.max_new_tokens=4", "--config.team.last_max_new_tokens=4",
                        "--config.rollout.max_context=256"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300, env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].startswith(
      f"error: {stale}: the finished calls of an evaluation with other settings "
      "(checkpoint_step, config, envs_per_call,"), out.stderr[-2000:]
  assert os.listdir(stale) == ["settings.json"]


def _calls(out) -> list:
  """The episodes of each rollout call of a `count_calls` launch."""
  return [int(line.split("=")[1]) for line in out.stdout.splitlines()
          if line.startswith("rollout_call=")]


def _transcripts(workdir, name: str = "eval") -> list:
  """(task, the replies) of each episode of the workdir's <name>_transcripts.jsonl."""
  with open(os.path.join(workdir, f"{name}_transcripts.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return [(r["task"], [(t["role"], t["reply"]) for t in r["turns"]]) for r in records]


def test_an_eval_given_only_a_test_file_leaves_out_what_the_checkpoint_trained_on(run, tmp_path,
                                                                                 caplog):
  """A run trained on a code file, evaluated with another test file and no task.path: the
  two problems of that file the run trained on are dropped (found by their statements: other
  ids, other spacing), the other two are played; the checkpoint's record says so after the
  training file is gone. It holds the training file's ids and statement hashes (SHA-256 of
  the prompt, whitespace collapsed, computed here). A checkpoint written before the record
  gives them from its saved config while the file is there."""
  import hashlib
  _, echo_config, model, policy = run
  write = lambda path, rows: path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  problem = lambda id_, prompt: {"id": id_, "prompt": prompt,
                                 "tests": [{"input": "", "output": "1\n"}]}
  training = [problem(f"t{i}", f"Print {i} plus one.") for i in range(3)]
  write(tmp_path / "train.jsonl", training)
  write(tmp_path / "heldout.jsonl", [problem("h", "Print nothing.")])
  trained_config = dataclasses.replace(echo_config, task=config_lib.TaskSection(
      name="code", path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "heldout.jsonl")))
  workdir, old = str(tmp_path / "run"), str(tmp_path / "old")
  _checkpoint(workdir, trained_config, model, policy)
  with Checkpointer(workdir, read_only=True) as checkpointer:
    recorded = checkpointer.read_meta(3)[trained_problems.KEY]
  digest = lambda text: hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]
  assert recorded == {"task": "code",
                      "problems": [[p["id"], digest(p["prompt"])] for p in training]}
  _checkpoint(old, trained_config, model, policy, record=False)

  test_file = str(tmp_path / "test.jsonl")
  write(tmp_path / "test.jsonl", [problem("x1", "Print 1  plus\n one."), problem("new0", "Print 7."),
                                  problem("x2", " Print 2 plus one."), problem("new1", "Print 8.")])
  config = dataclasses.replace(trained_config, task=config_lib.TaskSection(
      name="code", test_path=test_file))  # no task.path: the bundled problems
  team, _ = team_lib.build_team(config)

  def played(trained):
    envs = envs_build.build_envs(config, team, seed=0, split="test", num_envs=1, group_size=1,
                               trained=trained)
    envs.close()
    return [p.id for p in envs.envs[0].problems]

  assert played(()) == ["x1", "new0", "x2", "new1"]
  with caplog.at_level(logging.WARNING):
    from_old = trained_problems.of_checkpoint(old)
  assert "records no training problems (written before" in caplog.text
  os.remove(tmp_path / "train.jsonl")
  trained = trained_problems.of_checkpoint(workdir)
  assert trained == from_old == {digest(p["prompt"]): p["id"] for p in training}
  assert played(trained) == ["new0", "new1"]
  assert trained_problems.heldout_problems("code", "", test_file, trained)[1] == 2
  with pytest.raises(ValueError, match=r"task\.test_path=.*/test\.jsonl': each of its 4 "
                                       r"held-out problems is one the checkpoint trained on"):
    trained_problems.heldout_problems("code", "", test_file,
                                      {digest("Print 7."), digest("Print 8.")} | set(trained))
  caplog.clear()
  with caplog.at_level(logging.WARNING):  # its training file gone: nothing known, said so
    assert trained_problems.of_checkpoint(old) == {}
  assert "its saved config does not give them" in caplog.text


def test_launch_eval_scores_the_checkpoint_and_writes_eval_json(run):
  workdir, config, model, policy = run
  out, written = _launch_eval(workdir, config, "--problems=6",
                              "--config=tests/train/echo_config.py", "--config.task.echo_high=2")
  with open(os.path.join(workdir, "eval_transcripts.jsonl")) as f:
    tasks = [json.loads(line)["task"] for line in f]
  zeros = sum(int(t.split(":")[-1]) == 0 for t in tasks)
  assert len(tasks) == 6 and 0 < zeros < 6, tasks and written["checkpoint_step"] == 3
  assert written["accuracy"] == written["accuracy/repeater"] == zeros / 6
  assert f"accuracy={zeros / 6:.4g}" in out.stdout.splitlines()
  # The launch takes its settings from the config file and flags. Those differ from the run's
  # only in what the evaluation does not play by (eval_problems 10 then 300, temperature 0.3
  # then 0.7 though played greedily), so it warns of nothing.
  assert "evaluated with settings other than" not in out.stderr, out.stderr
  # Its stderr is the progress bars alone (Orbax once noted "Given directory is read only"
  # at every evaluation).
  lines = out.stderr.replace("\r", "\n").splitlines()
  assert all(not line or line.startswith(("loading ", "evaluating")) for line in lines), \
      out.stderr
  # the library on the same problems agrees
  expected = evaluate_lib.evaluate(config, model, policy, num_problems=6)
  assert written["training_problems_dropped"] == 0  # no problem file
  assert {k: written[k] for k in expected} == expected
  assert written["decoding"] == "greedy" and written["pass@1/repeater"] == zeros / 6

  missing = subprocess.run([sys.executable, "-m", "launch.eval", "--workdir=/nonexistent/run"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert missing.returncode == 1 and "no checkpoints" in missing.stderr, missing.stderr
  greedy_samples = subprocess.run(
      [sys.executable, "-m", "launch.eval", "--workdir=/nonexistent/run", "--untuned",
       "--samples_per_problem=4", "--pass_at=2,5"], capture_output=True, text=True, cwd=ROOT,
      timeout=120)
  assert greedy_samples.returncode == 1 and greedy_samples.stderr.strip() == (
      "error: --pass_at=2,5: each k must be between 1 and --samples_per_problem=4"), \
      greedy_samples.stderr
  # A team that cannot play is one line before the model (whose source is missing) loads.
  unplayable = subprocess.run(
      [sys.executable, "-m", "launch.eval", f"--workdir={workdir}",
       "--config=tests/train/echo_config.py", "--config.model.source=/nonexistent",
       "--config.rollout.max_context=256", "--config.team.max_new_tokens=300"],
      capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert unplayable.returncode == 2 and unplayable.stderr.strip() == (
      "error: agent 'helper0': max_new_tokens=300 leaves no position for its prompt within "
      "max_context=256: each of its turns would end its episode as a context overflow"), \
      unplayable.stderr


def test_launch_eval_names_a_damaged_checkpoint_in_one_line(run, tmp_path):
  """Its arrays truncated on disk: one line naming the step's folder, no tracebacks (neither
  the read's nor those of tensorstore's reads still in flight), exit status 1."""
  _, config, model, policy = run
  workdir = str(tmp_path / "run")
  _checkpoint(workdir, config, model, policy)
  state_dir = os.path.join(workdir, "checkpoints", "3", "state")
  chunks = [os.path.join(root, name) for root, _, names in os.walk(state_dir)
            for name in names if os.path.basename(root) == "d"]
  assert chunks
  for path in chunks:
    os.truncate(path, 10)
  out = subprocess.run([sys.executable, "-m", "launch.eval", f"--workdir={workdir}",
                        "--config=tests/train/echo_config.py", "--config.task.echo_high=2",
                        f"--config.model.source={config.model.source}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  errors = [line for line in out.stderr.splitlines() if " checkpoint_manager.py:" not in line]
  assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
  assert errors[0].startswith(f"error: {workdir}/checkpoints/3: checkpoint of step 3 cannot be "
                              "read") and errors[0].endswith("start again in a fresh workdir")


def _collect_a_failed_task(error: Exception) -> None:
  """A task whose exception nobody retrieves, garbage-collected: asyncio then logs "Task
  exception was never retrieved", as for Orbax's reads still in flight after a failed one."""
  async def read():
    raise error

  loop = asyncio.new_event_loop()
  task = loop.create_task(read())
  loop.run_until_complete(asyncio.sleep(0.01))
  loop.close()
  del task
  gc.collect()


def test_asyncio_reports_of_failed_reads_in_flight_are_dropped_and_others_kept(caplog):
  """The damaged-checkpoint run above printed them now and then (when the garbage collector
  took the tasks before exit): its one line became 36. Only tensorstore's read errors go."""
  asyncio_log = logging.getLogger("asyncio")
  asyncio_log.addFilter(cli._drop_failed_read_task_reports)
  try:
    with caplog.at_level(logging.ERROR, logger="asyncio"):
      _collect_a_failed_task(ValueError("OUT_OF_RANGE: Error reading \"step/.zarray\" "
                                        "[tensorstore_spec='{}']"))
      _collect_a_failed_task(ValueError("some other failure"))
  finally:
    asyncio_log.removeFilter(cli._drop_failed_read_task_reports)
  reports = [r for r in caplog.records if r.name == "asyncio"]
  assert len(reports) == 1 and "some other failure" in str(reports[0].exc_info[1])
