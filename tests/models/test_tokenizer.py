"""GGUF tokenizers against transformers' GGUF tokenizer and against llama.cpp's pre-tokenizer.

The reference for the pre-tokenizer is llama.cpp's (llama-vocab.cpp): for `smollm` it splits
text with the regex `\\p{N}` and then each piece with the GPT-2 regex; `_llama_cpp_pieces`
re-implements that split with the `regex` module, and the pieces are then encoded with the BPE
model of transformers' tokenizer. transformers 5.23 has no `smollm` entry and splits with the
GPT-2 regex alone, so it differs exactly on whitespace runs before digits ("a  12"); everywhere
else ours must equal it token for token.
"""

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import regex

from marft_jax.models import smollm2, tokenizer as tokenizer_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp `LLAMA_VOCAB_PRE_TYPE_SMOLLM` (shared with starcoder, refact, ...).
_SMOLLM_REGEXES = (r"\p{N}", _GPT2_REGEX)

TEXTS = [
    "Hello world", "The year 2024 had 366 days.", "3.14159 + 2,718 = 5.86", "  leading spaces",
    "trailing spaces   ", "a  b   c", "tabs\tand\nnewlines\n\n  x",
    "I'm sure it's fine; they'll see",
    "Ünïcödé 日本語 emoji 🙂 ok", "x=1\ny=22\nz = 333", "mixed\r\nline endings\r\n",
]
# Whitespace runs before a digit: where transformers' GGUF tokenizer is wrong for SmolLM2.
DIGIT_AFTER_SPACES = ["a  12", "x   345 y", "line\n  42\n", "I'm 99% sure it's  1 or  22", "\t 7"]


def _llama_cpp_pieces(text, regexes=_SMOLLM_REGEXES):
  """llama.cpp's `unicode_regex_split`: each regex cuts every piece into matches and the text
  between them, in turn."""
  pieces = [text]
  for pattern in regexes:
    cut = []
    for piece in pieces:
      start = 0
      for match in regex.finditer(pattern, piece):
        cut += [piece[start:match.start()]] if match.start() > start else []
        cut.append(match.group())
        start = match.end()
      cut += [piece[start:]] if start < len(piece) else []
    pieces = cut
  return pieces


def _reference_ids(reference, text):
  """llama.cpp's pre-tokenization, then the BPE model of `reference` on each piece."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  spell = bytes_to_unicode()
  model = reference.backend_tokenizer.model
  return [t.id for piece in _llama_cpp_pieces(text)
          for t in model.tokenize("".join(spell[b] for b in piece.encode("utf-8")))]


def _random_texts(count, seed=0):
  atoms = ["a", "bc", "The", " ", "  ", "   ", "\n", "\n\n", "\t", "1", "23", "456", ".", ",",
           "'s", "é", "日本", "🙂", "-", "$", "%"]
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(atoms, size=rng.integers(1, 12))) for _ in range(count)]


# --- tiny GGUF files (fast) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vocab():
  """A byte-level BPE trained on a few strings: (tokens, merges), specials first."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator((TEXTS + DIGIT_AFTER_SPACES) * 10, trainer)
  model = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  return tokens, [" ".join(m) for m in model["merges"]]


def write_tokenizer_gguf(path, tokens, merges, pre="gpt2", model="gpt2", chat_template=None,
                         add_bos=False):
  writer = gguf.GGUFWriter(str(path), arch="llama")
  writer.add_context_length(128)
  writer.add_tokenizer_model(model)
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(2)
  writer.add_unk_token_id(0)
  writer.add_add_bos_token(add_bos)
  if chat_template:
    writer.add_chat_template(chat_template)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


@pytest.mark.parametrize("pre", ["gpt2", "qwen2", "llama-bpe"])
def test_tiny_gguf_matches_transformers_gguf_tokenizer(tmp_path, tiny_vocab, pre):
  import transformers
  path = write_tokenizer_gguf(tmp_path / "tok.gguf", *tiny_vocab, pre=pre)
  ours = tokenizer_lib.load_tokenizer(path)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
  for text in TEXTS + DIGIT_AFTER_SPACES + _random_texts(100):
    assert ours(text)["input_ids"] == ref(text)["input_ids"], repr(text)
    assert ours.decode(ours(text)["input_ids"]) == text


def test_tiny_gguf_smollm_pre_tokenizer_splits_digits_like_llama_cpp(tmp_path, tiny_vocab):
  import transformers
  path = write_tokenizer_gguf(tmp_path / "tok.gguf", *tiny_vocab, pre="smollm")
  ours = tokenizer_lib.gguf_tokenizer(path)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
  for text in TEXTS + DIGIT_AFTER_SPACES + _random_texts(200):
    assert ours(text)["input_ids"] == _reference_ids(ref, text), repr(text)
  assert ours.tokenize("a  12") == ["a", "ĠĠ", "1", "2"]


def test_bos_flag_chatml_fallback_and_special_tokens(tmp_path, tiny_vocab):
  ours = tokenizer_lib.gguf_tokenizer(
      write_tokenizer_gguf(tmp_path / "tok.gguf", *tiny_vocab, add_bos=True))
  assert ours("hi")["input_ids"][0] == ours.bos_token_id == 1
  assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
      "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
  ours = tokenizer_lib.gguf_tokenizer(write_tokenizer_gguf(tmp_path / "t2.gguf", *tiny_vocab))
  chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
  assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  ids = ours("<|im_start|>user\nhi<|im_end|>")["input_ids"]
  assert ids[0] == 1 and ids[-1] == 2 and len(ours) == len(tiny_vocab[0])


def test_errors_name_file_and_key(tmp_path, tiny_vocab):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    tokenizer_lib.load_tokenizer(tmp_path / "nowhere")
  path = write_tokenizer_gguf(tmp_path / "spm.gguf", *tiny_vocab, model="llama")
  with pytest.raises(ValueError, match=r"spm\.gguf: tokenizer\.ggml\.model='llama' is not supp"):
    tokenizer_lib.gguf_tokenizer(path)
  path = write_tokenizer_gguf(tmp_path / "pre.gguf", *tiny_vocab, pre="mystery")
  with pytest.raises(ValueError, match=r"pre\.gguf: tokenizer\.ggml\.pre='mystery' is not supp"):
    tokenizer_lib.gguf_tokenizer(path)


def _save_tiny_folder(folder, tiny_vocab):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  tokens, merges = tiny_vocab
  backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                 [tuple(m.split(" ")) for m in merges]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                          chat_template=tokenizer_lib.CHATML_TEMPLATE).save_pretrained(folder)
  return folder


def _declare_class(folder, name):
  path = os.path.join(folder, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  config["tokenizer_class"] = name
  with open(path, "w") as f:
    json.dump(config, f)


@pytest.mark.parametrize("declared", [None, "PreTrainedTokenizerFast", "GPT2Tokenizer"])
def test_hf_folder_loads_as_auto_tokenizer_does(tmp_path, tiny_vocab, declared):
  """The class AutoTokenizer picks (the generic one without importing it; a named model class
  through it), with the same ids, special tokens and chat template."""
  from transformers import AutoTokenizer
  folder = _save_tiny_folder(tmp_path, tiny_vocab)
  if declared:
    _declare_class(folder, declared)
  loaded = tokenizer_lib.load_tokenizer(folder)
  reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
  assert type(loaded) is type(reference)
  assert loaded.eos_token == reference.eos_token == "<|im_end|>"
  assert loaded.chat_template == reference.chat_template == tokenizer_lib.CHATML_TEMPLATE
  text = "Hello world <|im_end|> 12 + 34"
  assert loaded(text)["input_ids"] == reference(text)["input_ids"]
  assert loaded.decode(loaded("Hello world")["input_ids"]) == "Hello world"
  chat = [{"role": "user", "content": "hi"}]
  assert (loaded.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) ==
          reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_a_generic_tokenizer_folder_loads_without_torch(tmp_path, tiny_vocab):
  """What a launch script pays for a saved tokenizer: AutoTokenizer's module imports torch."""
  folder = _save_tiny_folder(tmp_path, tiny_vocab)
  code = ("import sys; from marft_jax.models.tokenizer import load_tokenizer; "
          f"load_tokenizer({str(folder)!r}); print('torch' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       cwd=ROOT)
  assert out.stdout.strip() == "False", out.stderr[-2000:]


# --- SmolLM2 (slow: transformers' GGUF tokenizer takes ≈10 s to build) -------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizers(smollm2_reader):
  import transformers
  from tests.models.hf_fixtures import transformers_reading
  path = smollm2.smollm2_gguf_path()
  with transformers_reading(smollm2_reader):  # the session's parse of the file
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
  return tokenizer_lib.gguf_tokenizer(smollm2_reader), ref


@pytest.mark.slow
def test_smollm2_matches_transformers_except_spaces_before_digits(smollm2_tokenizers):
  ours, ref = smollm2_tokenizers
  assert len(ours) == len(ref) == 49152
  for text in TEXTS + ["<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n"]:
    ids = ours(text)["input_ids"]
    assert ids == ref(text)["input_ids"], repr(text)
    assert ours.decode(ids) == ref.decode(ids) == text
  assert (ours.eos_token, ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
      "<|im_end|>", 2, 1, 2)


@pytest.mark.slow
def test_smollm2_spaces_before_digits_follow_smollm2_pre_tokenizer(smollm2_tokenizers):
  """The resolved difference: ours follows llama.cpp's `smollm` split (SmolLM2's tokenizer.json:
  Digits(individual_digits=True) then ByteLevel), transformers' converter does not."""
  ours, ref = smollm2_tokenizers
  for text in TEXTS + DIGIT_AFTER_SPACES + _random_texts(300):
    ids = ours(text)["input_ids"]
    assert ids == _reference_ids(ref, text), repr(text)
    assert ours.decode(ids) == text
  assert ours.tokenize("a  12") == ["a", "ĠĠ", "1", "2"]
  assert ours.tokenize("line\n  42") == ["line", "ĊĠĠ", "4", "2"]


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_tokenizers):
  ours, ref = smollm2_tokenizers
  for messages in ([{"role": "user", "content": "Hi there!"}],
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "assistant", "content": "Blue."},
                    {"role": "user", "content": "Another?"}]):
    for generation_prompt in (False, True):
      kwargs = dict(add_generation_prompt=generation_prompt)
      text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
      assert text == ref.apply_chat_template(messages, tokenize=False, **kwargs)
      assert ours(text)["input_ids"] == ref(text)["input_ids"]
  assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
  assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_gguf_loaders_do_not_import_torch(tmp_path, tiny_vocab):
  """Weights and tokenizer load in a fresh process without torch (a test-only package)."""
  from tests.models.hf_fixtures import save_tiny_model, write_gguf
  weights = write_gguf(tmp_path / "m.gguf", save_tiny_model(tmp_path, "llama"))
  vocab = write_tokenizer_gguf(tmp_path / "tok.gguf", *tiny_vocab, pre="smollm")
  script = (
      "import sys\n"
      "from marft_jax.models import gguf_checkpoint, smollm2, tokenizer\n"
      f"gguf_checkpoint.load_gguf_checkpoint({weights!r})\n"
      f"tok = tokenizer.gguf_tokenizer({vocab!r})\n"
      "tok.apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
      "assert 'torch' not in sys.modules, 'torch was imported'\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
  subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ, PYTHONPATH=path))
