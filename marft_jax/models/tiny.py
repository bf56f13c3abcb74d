"""A tiny model and tokenizer that ship with the package: smoke tests, examples, CI runs.

`save_tiny_model(path)` writes a Hugging Face style folder (`config.json`,
`model.safetensors`, tokenizer files with a ChatML chat template) holding a random ≈0.1 M
parameter Llama or Qwen2 and a byte-level BPE trained on a few sentences, so that every
program that takes `--config.model=<folder>` can run end to end in seconds, without torch and
without downloading anything. The weights are random: its text is gibberish.
"""

from __future__ import annotations

import json
import os
from typing import Union

import jax

from marft_jax.models.config import tiny_config
from marft_jax.models.hf_checkpoint import hf_config_dict, hf_tensors
from marft_jax.models.tokenizer import CHATML_TEMPLATE
from marft_jax.models.transformer import init_params

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = (
    "You are a helpful assistant. Solve the problem step by step.",
    "Tom has 3 apples and buys 4 more. How many apples does he have? 3 + 4 = 7. #### 7",
    "A train travels 60 miles in 2 hours. Its speed is 60 / 2 = 30 miles per hour.",
    "The answer is 12 * 7 = 84. The sky is blue because air scatters blue light.",
    "Reasoner: think first. Actor: give the final answer. Verifier: check the answer.",
)


def tiny_tokenizer(vocab_size: int = 384):
  """A byte-level BPE (≤ `vocab_size` tokens, specials `SPECIAL_TOKENS` first) with ChatML."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  backend = Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  backend.train_from_iterator(list(_CORPUS) * 4, trainer)
  return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                 eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)


def tiny_model(architecture: str = "llama", seed: int = 0, **config_changes):
  """(params, config, tokenizer): a random tiny `architecture` model, in memory (training
  layout); `config_changes` go to `tiny_config` (e.g. max_position_embeddings=1024)."""
  tokenizer = tiny_tokenizer()
  config = tiny_config(architecture, vocab_size=len(tokenizer), **config_changes)
  return init_params(config, jax.random.key(seed), std=0.1), config, tokenizer


def save_tiny_model(path: Union[str, os.PathLike], architecture: str = "llama",
                    seed: int = 0) -> str:
  """Writes a random tiny `architecture` model with its tokenizer to folder `path`."""
  from safetensors.numpy import save_file
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  params, config, tokenizer = tiny_model(architecture, seed)
  save_file(hf_tensors(params, config), os.path.join(path, "model.safetensors"),
            metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config_dict(config), f, indent=2)
  tokenizer.save_pretrained(path)
  return path
