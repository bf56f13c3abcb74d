r"""Chat with a model from the command line (the main job until the trainer lands).

  python -m launch.generate                                   # SmolLM2, default prompt
  python -m launch.generate --config.prompt="What is 12 * 7?" --config.sampling.temperature=0
  python -m launch.generate --config.model=/path/to/hf_folder_or_file.gguf

Reads `launch/configs/generate.py`, turns it into frozen dataclasses once, loads the model from
local files, and streams the progress of the jitted sampler with a tqdm bar.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

from marft_jax.configs import from_config_dict
from marft_jax.models import decode_layout, loading, sampler

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "configs", "generate.py"),
    "Generation config.", lock_config=True)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  max_new_tokens: int = 96  # tokens to generate at most.
  temperature: float = 0.7  # 0 = greedy.
  top_k: int = 0  # keep the k most probable tokens; 0 = off.
  top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off.

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be ≥ 1")
    if self.temperature < 0:
      raise ValueError(f"sampling.temperature={self.temperature} must be ≥ 0")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k={self.top_k} must be ≥ 0")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  model: str = loading.SMOLLM2  # "smollm2", a .gguf file or a Hugging Face folder.
  param_dtype: str = "float32"  # "float32" or "bfloat16".
  system_prompt: str = "You are a helpful assistant."
  prompt: str = "Hello!"
  seed: int = 0
  sampling: SamplingConfig = SamplingConfig()


def chat(config: GenerateConfig) -> str:
  """Loads the model, answers `config.prompt`, and returns the answer text."""
  with tqdm(total=2, desc=f"loading {config.model}", unit="step", file=sys.stderr) as bar:
    params, model_config, tokenizer = loading.load_model(
        config.model, param_dtype=config.param_dtype, compute_dtype=config.param_dtype)
    bar.update()
    messages = [{"role": "system", "content": config.system_prompt},
                {"role": "user", "content": config.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    params = decode_layout.to_decode_layout(params)  # the sampler's fast layout
    bar.update()

  s = config.sampling
  with tqdm(total=s.max_new_tokens, desc="generating (first step compiles)", unit="tok", file=sys.stderr) as bar:
    start = time.perf_counter()
    out = sampler.generate(
        params, np.asarray([prompt_ids]), model_config, rng=jax.random.key(config.seed),
        max_new_tokens=s.max_new_tokens, temperature=s.temperature,
        top_k=s.top_k or None, top_p=None if s.top_p >= 1 else s.top_p,
        eos_ids=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id or 0,
        on_step=lambda step: bar.update(int(step) - bar.n))
    n = int(out.lengths[0])
    bar.update(n - bar.n)
    bar.set_postfix_str(f"{n / (time.perf_counter() - start):.1f} tok/s incl. compile")
  tokens = np.asarray(out.tokens[0, :n])
  return tokenizer.decode(tokens, skip_special_tokens=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = from_config_dict(GenerateConfig, _CONFIG.value)
  print(f"user: {config.prompt}")
  print(f"assistant: {chat(config)}")


if __name__ == "__main__":
  app.run(main)
