"""`marft_jax.restore`: a run trained by `python -m launch.train` (the tiny model, two
iterations, its team from a profile file that is deleted afterwards) restored in Python, with
the greedy replies `python -m launch.eval` gives on the same problems; `launch.generate
--workdir` built on it; and the run's PEFT exports loaded into Hugging Face PEFT on the tiny
model's transformers checkpoint, with our logits.

PEFT loading of `save_peft_adapters`' folders in general: tests/lora/test_peft_io.py
(test_our_adapters_load_in_peft_with_equal_logits). Here: the folders a trained run exports."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import marft_jax
from marft_jax import lora as lora_lib
from marft_jax.models import tiny, transformer
from marft_jax.rollout.transcripts import episode_record
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import restore as restore_lib
from marft_jax.train.checkpoint import UnreadableCheckpointError
from tests.compile_flags import FAST_COMPILE
from tests.train.echo_config import echo_flags, from_default_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = [{"role": "speaker", "prompt": "Say it.", "with_answer": False, "device": "cuda:1"},
            {"role": "repeater", "prompt": "Repeat it.", "with_answer": True}]
PROBLEMS = 6


def _launch(module, *args):
  out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 0, out.stderr[-3000:]
  return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(workdir, the launch's overrides, launch.eval's transcripts, launch.train's stderr)."""
  root = tmp_path_factory.mktemp("restore")
  source = tiny.save_tiny_model(root / "model")
  profiles = root / "team.json"
  profiles.write_text(json.dumps(PROFILES))
  overrides = {**echo_flags("marft_a", num_envs=4, iterations=2), "model.source": source,
               "team.profiles": str(profiles)}
  flags = [f"--config.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
           for k, v in overrides.items()]
  workdir = str(root / "run")
  trained = _launch("launch.train", f"--workdir={workdir}", *flags)
  _launch("launch.eval", f"--workdir={workdir}", f"--problems={PROBLEMS}", *flags)
  with open(os.path.join(workdir, "eval_transcripts.jsonl")) as f:
    transcripts = [json.loads(line) for line in f]
  os.remove(profiles)  # the checkpoint holds the roles: nothing below reads the file
  return workdir, overrides, transcripts, trained.stderr


def test_restore_gives_the_run_and_its_greedy_replies_equal_launch_eval(run, tmp_path):
  workdir, overrides, transcripts, train_log = run
  assert "'device' is ignored (entries 0)" in train_log  # the launch read the profile file
  restored = marft_jax.restore(workdir)
  assert isinstance(restored, marft_jax.Restored) and restored.step == 2
  assert restored.config.team.order == "speaker,repeater" and not restored.config.team.profiles
  assert [(p.role, p.system_prompt, p.graded) for p in restored.team] == [
      ("speaker", "Say it.", False), ("repeater", "Repeat it.", True)]
  assert restored.critic is not None and restored.structure is None
  # The adapters are the checkpoint's (what launch.eval restores), trained away from zero B.
  again = tmp_path / "team.json"  # launch.eval's config, as it read it (the file is gone)
  again.write_text(json.dumps(PROFILES))
  launch_config = from_default_file({**overrides, "team.profiles": str(again)})
  policy, step = evaluate_lib.restore_policy(launch_config, restored.model, workdir)
  assert step == 2
  for got, want in zip(jax.tree.leaves(restored.policy), jax.tree.leaves(policy)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.abs(restored.policy.layers["q_proj"]["b"]).max()) > 0
  # Greedy, the same problems: launch.eval's transcripts, and its library path's tokens.
  episodes = restored.play(num_problems=PROBLEMS)
  turn_keys = ("env_step", "agent", "role", "prompt", "reply", "num_tokens", "stopped")
  as_played = lambda records: [(r["task"], r["seed"], [tuple(t[k] for k in turn_keys)
                                                       for t in r["turns"]]) for r in records]
  assert as_played([episode_record(e) for e in episodes]) == as_played(transcripts)
  launched = evaluate_lib.play(launch_config, restored.model, policy, PROBLEMS, batch_size=40,
                               trained=restored.trained_problems)
  for ours, theirs in zip(episodes, launched, strict=True):
    for a, b in zip(ours.sequences, theirs.sequences, strict=True):
      assert a.tokens == b.tokens and a.adapter_ids == b.adapter_ids
  with open(os.path.join(workdir, "eval.json")) as f:
    written = json.load(f)
  assert restored.evaluate(num_problems=PROBLEMS)["accuracy"] == written["accuracy"]


def test_each_role_replies_through_its_own_adapter_and_no_other(run):
  """Two trained adapters of a tiny model can give the same greedy tokens, so the PEFT
  comparison below cannot tell which adapter a role used. Here the repeater's adapter alone
  is pushed far from where training left it: the repeater's reply must change and the
  speaker's must not (kills "every role uses adapter 0" and "every role uses adapter 1")."""
  workdir, _, _, _ = run
  restored = restore_lib.restore(workdir)
  task, seen = "Repeat: 0", [("speaker", "0 0")]
  rng = np.random.default_rng(0)

  def pushed(x):  # [L, A=2, ...]: a large random B for adapter 1 only
    x = np.array(x)
    x[:, 1] += rng.normal(0.0, 5.0, x[:, 1].shape).astype(x.dtype)
    return jnp.asarray(x)

  layers = {target: {**factors, "b": pushed(factors["b"])}
            for target, factors in restored.policy.layers.items()}
  moved = dataclasses.replace(restored, policy=dataclasses.replace(restored.policy,
                                                                   layers=layers))
  assert moved.reply("speaker", task) == restored.reply("speaker", task)
  assert moved.reply("repeater", task, seen) != restored.reply("repeater", task, seen)


def test_a_role_replies_with_its_own_adapter_as_launch_generate_does(run, tmp_path):
  workdir, overrides, _, _ = run
  restored = restore_lib.restore(workdir)
  task = "Repeat: 0"
  answer = restored.reply("speaker", task)
  second = restored.reply("repeater", task, replies=[("speaker", answer)])
  # The reference: the sampler with each role's exported PEFT adapter, on the prompt the
  # rollout's per-agent view gives it (the repeater sees the speaker's reply).
  from marft_jax.models import layout, sampler
  from marft_jax.rollout import context
  model = restored.model
  fast = model.config.replace(layout=layout.decoding())
  params = layout.convert_params(model.params, model.config.layout, fast.layout)
  for role, prompt, user, got in (
      ("speaker", "Say it.", task, answer),
      ("repeater", "Repeat it.", f"{task}\n\nSpeaker: {answer.strip()}", second)):
    folder = os.path.join(workdir, "exports", "step_2", role)
    adapter = lora_lib.load_peft_adapters([folder], model.config)
    ids = context.chat_prompt(model.tokenizer, [{"role": "system", "content": prompt},
                                                {"role": "user", "content": user}])
    out = sampler.generate(params, np.asarray([ids]), fast, rng=jax.random.key(0),
                           max_new_tokens=3, temperature=0.0,
                           eos_ids=model.tokenizer.eos_token_id, lora=adapter, adapter_ids=[0])
    tokens = np.asarray(out.tokens[0, :int(out.lengths[0])])
    assert got == model.tokenizer.decode(tokens, skip_special_tokens=True), role
  with pytest.raises(ValueError, match=r"role 'actor': not a role of the run .* speaker, "
                                       r"repeater"):
    restored.reply("actor", task)
  # The command line: the same reply, greedy.
  out = _launch("launch.generate", f"--workdir={workdir}", "--role=speaker",
                f"--config.prompt={task}", "--config.sampling.max_new_tokens=3",
                "--config.sampling.temperature=0")
  assert out.stdout.splitlines() == [f"user: {task}", f"assistant: {answer}"]
  refused = subprocess.run([sys.executable, "-m", "launch.generate", f"--workdir={workdir}",
                            "--role=actor"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
  assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
      f"error: --role=actor: not a role of the run in {workdir} (its roles: speaker, "
      "repeater)"), refused.stderr


def test_errors_name_the_workdir_and_the_step(run, tmp_path):
  workdir, _, _, _ = run
  empty = str(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match=rf"^{empty}/checkpoints: no checkpoint to "
                                              r"restore \(train first\)$"):
    marft_jax.restore(empty)
  assert not os.path.exists(empty)  # read only: nothing made
  with pytest.raises(FileNotFoundError, match=rf"^{workdir}/checkpoints: no checkpoint for "
                                              r"step 7 \(steps present: \[2\]\)$"):
    marft_jax.restore(workdir, step=7)
  damaged = str(tmp_path / "damaged")
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(damaged, "checkpoints"))
  state_dir = os.path.join(damaged, "checkpoints", "2", "state")
  for root, _, names in os.walk(state_dir):
    for name in names:
      if os.path.basename(root) == "d":
        os.truncate(os.path.join(root, name), 10)
  with pytest.raises(UnreadableCheckpointError, match=rf"^{damaged}/checkpoints/2: checkpoint "
                                                      r"of step 2 cannot be read"):
    marft_jax.restore(damaged)


def test_the_runs_peft_exports_load_in_peft_with_our_logits(run):
  """workdir/exports/step_2/<role>: each loads with PeftModel.from_pretrained on the
  transformers checkpoint of the run's base, and its logits are ours with that role's
  adapter (restored from the checkpoint)."""
  import torch
  from peft import PeftModel
  from transformers import AutoModelForCausalLM
  workdir, overrides, _, _ = run
  restored = restore_lib.restore(workdir)
  params, config = restored.model.params, restored.model.config
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 9))
  exports = os.path.join(workdir, "exports", "step_2")
  assert sorted(os.listdir(exports)) == ["repeater", "speaker"]
  for adapter_id, role in enumerate(["speaker", "repeater"]):
    base = AutoModelForCausalLM.from_pretrained(overrides["model.source"],
                                                dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, os.path.join(exports, role))
    with torch.no_grad():
      theirs = peft_model(input_ids=torch.tensor(tokens)).logits.numpy()
    ours = transformer.forward(params, jnp.asarray(tokens), config, lora=restored.policy,
                               adapter_ids=jnp.full((2,), adapter_id, jnp.int32))[0]
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)
    base_logits = transformer.forward(params, jnp.asarray(tokens), config)[0]
    assert not np.allclose(np.asarray(base_logits), theirs, atol=1e-5), role  # trained
