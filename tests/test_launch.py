"""`python -m launch.generate` as a user runs it: --help, bad overrides, a tiny end-to-end run."""

import os
import subprocess
import sys

import numpy as np
import pytest

from marft_jax.models import tiny
from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=300, **env_changes):
  # One CPU device, as a user's machine has.
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE, **env_changes)
  return subprocess.run([sys.executable, "-m", "launch.generate", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return tiny.save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_help_lists_every_config_field_and_exits_0():
  out = _run("--help")
  assert out.returncode == 0, out.stderr
  for line in ("model = 'smollm2'", "prompt = 'Explain in two sentences why the sky is blue.'",
               "sampling.max_new_tokens = 96", "sampling.temperature = 0.7",
               "sampling.top_k = 0", "sampling.top_p = 0.95", "seed = 0"):
    assert line in out.stdout, out.stdout


@pytest.mark.parametrize("arg,message", [
    ("--config.xyz=3", "error: --config.xyz: unknown key 'xyz' in config; allowed: "
     "adapter, matmul_precision, model, param_dtype, prompt, sampling, seed, system_prompt"),
    ("--config.sampling.tmp=1", "error: --config.sampling.tmp: unknown key 'tmp' in "
     "config.sampling; allowed: max_new_tokens, temperature, top_k, top_p"),
    ("--config.sampling.top_p=1.5", "error: config.sampling: top_p=1.5: must be in (0, 1]"),
    ("--config.seed=abc", "error: flag --config.seed=abc: invalid literal for int()"),
    ("--config=missing.py", "error: --config=missing.py: no such config file"),
])
def test_bad_override_is_one_line_naming_the_key(arg, message):
  out = _run(arg)
  assert out.returncode == 2
  assert out.stderr.strip().startswith(message) and len(out.stderr.strip().splitlines()) == 1, \
      out.stderr


def test_a_model_file_that_does_not_load_is_one_line_naming_it(tmp_path):
  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"not a gguf file")
  out = _run(f"--config.model={bad}")
  assert out.returncode == 2, out.stderr
  # The loading bar is closed first, so the error is the last line, and the only one.
  assert out.stderr.splitlines()[-1] == (f"error: {bad}: not a readable GGUF file, truncated "
                                         "or corrupt (GGUF magic invalid)"), out.stderr
  assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr, out.stderr
  # The traceback is one flag away (a loader's own bug raises the same types).
  verbose = _run(f"--config.model={bad}", "--verbosity=1")
  assert verbose.returncode == 2 and verbose.stderr.splitlines()[-1] == out.stderr.splitlines()[-1]
  assert "Traceback" in verbose.stderr and "in open_gguf" in verbose.stderr, verbose.stderr


def test_tiny_model_run_prints_only_the_answer_and_the_bar(tiny_model):
  out = _run(f"--config.model={tiny_model}", "--config.prompt=What is 3 + 4?",
             "--config.sampling.max_new_tokens=4")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 2 and lines[0] == "user: What is 3 + 4?"
  assert lines[1].startswith("assistant: ") and "<|im_end|>" not in lines[1]
  # stderr holds the progress bars and nothing else (no absl/JAX log lines inside them).
  for segment in out.stderr.replace("\r", "\n").splitlines():
    assert not segment.strip() or segment.startswith(("loading ", "generating ")), segment


def test_a_reply_longer_than_the_model_allows_is_one_line_naming_the_key(tiny_model):
  """Was the sampler's ValueError as a traceback, under the generation bar."""
  out = _run(f"--config.model={tiny_model}", "--config.sampling.max_new_tokens=100000")
  assert out.returncode == 2, out.stderr
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("error: config.sampling.max_new_tokens=100000: the prompt takes "), last
  assert last.endswith(" of the model's 512 positions, leaving " + str(512 - int(
      last.split("takes ")[1].split()[0]))), last
  assert "Traceback" not in out.stderr


def test_an_adapter_answers_as_the_library_does_with_it(tiny_model, tmp_path):
  """--config.adapter: an agent's PEFT folder (the launch folds it into the f32 weights).
  The reference is the library's sampler with the adapter routed, not merged, greedy; the
  base model answers otherwise."""
  import jax
  from launch.configs.generate import GenerateConfig
  from marft_jax import lora
  from marft_jax.architecture import precision
  from marft_jax.models import layout, loading, sampler
  params, config, tokenizer = loading.load_model(tiny_model)
  strong = lora.init_adapters(lora.LoraConfig(rank=4, alpha=32.0), config, jax.random.key(1), 1)
  strong = strong.replace(layers=jax.tree.map(  # b != 0: the adapter changes the answer
      lambda x: 0.3 * jax.random.normal(jax.random.key(2), x.shape), strong.layers))
  lora.save_peft_adapter(tmp_path / "agent", strong)
  prompt, n = "What is 3 + 4?", 6
  out = _run(f"--config.model={tiny_model}", f"--config.prompt={prompt}",
             f"--config.adapter={tmp_path / 'agent'}", f"--config.sampling.max_new_tokens={n}",
             "--config.sampling.temperature=0")
  assert out.returncode == 0, out.stderr
  messages = [{"role": "system", "content": GenerateConfig().system_prompt},
              {"role": "user", "content": prompt}]
  ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
  fast = config.replace(layout=layout.decoding())
  fast_params = layout.convert_params(params, config.layout, fast.layout)
  loaded = lora.load_peft_adapters([tmp_path / "agent"], config)

  def answer(**adapter):
    with precision.scope("auto", "float32"):
      got = sampler.generate(fast_params, np.asarray([ids["input_ids"]]), fast,
                             rng=jax.random.key(0), max_new_tokens=n, temperature=0.0,
                             eos_ids=tokenizer.eos_token_id, merge_lora=False, **adapter)
    tokens = np.asarray(got.tokens[0, :int(got.lengths[0])])
    return tokenizer.decode(tokens, skip_special_tokens=True)

  tuned = answer(lora=loaded, adapter_ids=[0])
  assert out.stdout.splitlines()[1] == f"assistant: {tuned}", (out.stdout, tuned)
  assert answer() != tuned, tuned


def test_compilation_cache_is_written_then_reused(tiny_model, tmp_path):
  """The second launch finds the first launch's programs in the cache and adds none."""
  cache = tmp_path / "xla"
  args = [f"--config.model={tiny_model}", "--config.prompt=Hi",
          "--config.sampling.max_new_tokens=4", f"--compilation_cache={cache}"]
  first = _run(*args, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # tiny: fast compiles
  assert first.returncode == 0, first.stderr
  written = sorted(os.listdir(cache))
  assert written, "no program was cached"
  second = _run(*args, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_LOG_COMPILES="1")
  assert second.returncode == 0, second.stderr
  assert "Persistent compilation cache hit" in second.stderr  # logged under JAX_LOG_COMPILES
  assert sorted(os.listdir(cache)) == written
  assert second.stdout == first.stdout  # same seed, same program: the same answer
