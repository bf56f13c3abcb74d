"""Tokenizers with chat templates, from a local Hugging Face folder or from a GGUF file.

A folder goes to transformers' `AutoTokenizer` (no hub access). A GGUF file holds no
`tokenizer.json`, only llama.cpp's description of one: the vocabulary, the merges, the token
types, the special ids, a pre-tokenizer *name* (`tokenizer.ggml.pre`) and usually a chat template.
`gguf_tokenizer` rebuilds the byte-level BPE tokenizer it describes with the `tokenizers` library
and wraps it in `transformers.PreTrainedTokenizerFast` without importing torch (transformers'
own GGUF path, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, is the test reference only).

The pre-tokenizer (how text is cut before BPE) is named, not stored, so each name llama.cpp
knows is mapped here to the `tokenizers` pipeline of the original `tokenizer.json`
(`PRE_TOKENIZERS`). SmolLM2 says `smollm`: llama.cpp splits every digit off first (regex
`\\p{N}`) and then applies the GPT-2 regex to the rest, exactly what SmolLM2's own
`tokenizer.json` does with `Sequence([Digits(individual_digits=True), ByteLevel(use_regex=True)])`.

transformers 5.23's GGUF converter has no entry for `smollm` and falls back to the GPT-2 regex
alone, which keeps a space glued to the number after it. Single spaces come out the same (no
merge joins `Ġ` to a digit, since digits were split off in training), but a whitespace run ending
in a space before a digit does not: for `"a  1"` GPT-2's `\\s+(?!\\S)` leaves one space on its
own and glues the other to the digit, giving `a`, `Ġ`, `Ġ`, `1`, while SmolLM2's tokenizer (and
llama.cpp) give `a`, `ĠĠ`, `1` (likewise `"\\n  42"`: `ĊĠĠ`, `4`, `2`, not `ĊĠ`, `Ġ`, ...).
That is the known "double space before digits" difference: transformers' side is the wrong
one, and this module follows the real tokenizer (tests/models/test_tokenizer.py checks ours
against llama.cpp's split on every text, and against transformers wherever it is right).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, Optional, Union

from marft_jax.models.gguf_checkpoint import GGUFSource, _reader_and_source

# Plain ChatML, used when a GGUF carries no `tokenizer.chat_template`.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# The GPT-2 regex, as llama.cpp and `ByteLevel(use_regex=True)` use it.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 / cl100k: numbers in groups of up to three.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2: single digits.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _gpt2_pre():
  from tokenizers import pre_tokenizers
  return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2_pre():
  from tokenizers import pre_tokenizers
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str) -> Callable:
  def build():
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
  return build


# `tokenizer.ggml.pre` -> the pre-tokenizer of the original tokenizer.json (llama.cpp groups the
# names the same way in `llama_vocab::impl::load`).
PRE_TOKENIZERS: dict[str, Callable] = {
    **{name: _gpt2_pre for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{name: _digits_then_gpt2_pre
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{name: _split_pre(_LLAMA3_SPLIT) for name in ("llama3", "llama-v3", "llama-bpe")},
    **{name: _split_pre(_QWEN2_SPLIT) for name in ("qwen2", "deepseek-r1-qwen")},
}


# The names transformers' AutoTokenizer resolves to its generic `tokenizer.json` class (in
# transformers 5, `PreTrainedTokenizerFast` is `TokenizersBackend`), as `save_pretrained` of
# that class writes them. A folder naming one is loaded with that class directly: importing
# AutoTokenizer imports the model configurations and with them torch (3-4 s per process).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_tokenizer_class(folder: str) -> Optional[str]:
  """`tokenizer_class` of the folder's tokenizer_config.json (None: none readable)."""
  try:
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
      declared = json.load(f).get("tokenizer_class")
  except (OSError, ValueError, AttributeError):
    return None  # AutoTokenizer reads it again and reports what is wrong
  return declared if isinstance(declared, str) else None


def load_tokenizer(path: Union[str, os.PathLike]):
  """The tokenizer (with chat template) of a local Hugging Face folder or a `.gguf` file.

  A folder goes to transformers' `AutoTokenizer`, which picks the class its
  tokenizer_config.json names; the generic class is loaded as AutoTokenizer would, without
  its imports."""
  path = os.fspath(path)
  if os.path.isdir(path):
    if _declared_tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
      from transformers import PreTrainedTokenizerFast
      return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such tokenizer folder or GGUF file")
  return gguf_tokenizer(path)


def gguf_tokenizer(path: GGUFSource):
  """Rebuilds the byte-level BPE tokenizer a GGUF file describes (`tokenizer.ggml.model=gpt2`).

  Args:
    path: the `.gguf` file, or an open `gguf.GGUFReader`.
  Returns:
    a `transformers.PreTrainedTokenizerFast` with the file's special tokens (control tokens are
    special, user-defined ones are added tokens), bos/eos/unk/pad from the file's ids, and the
    file's chat template (`CHATML_TEMPLATE` if it has none). BOS is prepended only when the file
    sets `tokenizer.ggml.add_bos_token`.
  Raises:
    ValueError naming the file and key for another tokenizer model or an unknown pre-tokenizer.
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors
  from transformers import PreTrainedTokenizerFast

  reader, source = _reader_and_source(path)
  fields = reader.fields
  value = lambda key, default=None: fields[key].contents() if key in fields else default

  kind = value("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{source}: tokenizer.ggml.model={kind!r} is not supported; "
                     "supported: 'gpt2' (byte-level BPE)")
  pre = value("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; "
                     f"supported: {sorted(PRE_TOKENIZERS)}")
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
    if key not in fields:
      raise ValueError(f"{source}: missing metadata key {key!r}")
  tokens = value("tokenizer.ggml.tokens")
  merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
  types = value("tokenizer.ggml.token_type", [1] * len(tokens))

  vocab = {_byte_level_spelling(t): i for i, t in enumerate(tokens)}
  backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  # Whole-word matches, never cut by BPE. A control token spelled outside the byte alphabet is
  # a llama.cpp mislabel (transformers skips those too): adding it would grow the vocabulary.
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, ty in zip(tokens, types) if ty == _CONTROL and t in vocab])
  backend.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

  special = {}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    token_id = value(f"tokenizer.ggml.{key}")
    if token_id is not None:
      special[name] = tokens[token_id]
  if value("tokenizer.ggml.add_bos_token", False) and "bos_token" in special:
    bos = special["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokens.index(bos))])
  arch = value("general.architecture")
  return PreTrainedTokenizerFast(
      tokenizer_object=backend, chat_template=value("tokenizer.chat_template", CHATML_TEMPLATE),
      model_max_length=value(f"{arch}.context_length", int(1e30)),
      clean_up_tokenization_spaces=False, **special)


def check_tokenizer_fits(tokenizer, vocab_size: int, source: str) -> None:
  """Refuses a tokenizer that can produce ids the model's embedding has no row for.

  Such ids would be clamped silently inside `jit` (gathers clamp out-of-range indices). A
  smaller tokenizer is fine: embeddings are often padded (Qwen2: 151,936 rows, ~151,665 tokens).

  Args:
    tokenizer: a transformers tokenizer; its size counts added tokens (`len(tokenizer)`).
    vocab_size: the model's embedding rows (`ModelConfig.vocab_size`).
    source: the model file or folder, named in the error.
  Raises:
    ValueError naming `source` and both sizes.
  """
  size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
  if size > vocab_size:
    raise ValueError(f"{source}: the tokenizer has {size} token ids (added tokens included) but "
                     f"the model's vocab_size is {vocab_size}: ids >= {vocab_size} have no "
                     "embedding row")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset]:
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  spelling = bytes_to_unicode()
  return spelling, frozenset(spelling.values())


def _byte_level_spelling(token: str) -> str:
  """A vocabulary entry in GPT-2's byte alphabet (`Ġ` for a space); llama.cpp writes most so."""
  spelling, alphabet = _byte_alphabet()
  if set(token) <= alphabet:
    return token
  return "".join(spelling[b] for b in token.encode("utf-8"))
