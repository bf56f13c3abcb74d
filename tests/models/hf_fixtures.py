"""Tiny random transformers models saved to disk, as Hugging Face folders or llama.cpp-style GGUF
files: the reference for parity tests and the raw material of the loader-error tests."""

import contextlib
import functools

import gguf
import numpy as np
import pytest
import torch
import transformers

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)
_GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}


def save_tiny_model(path, architecture: str, seed: int = 0, **overrides):
  """Saves a random tiny `architecture` ("llama"/"qwen2") model to `path`; returns it (eval)."""
  torch.manual_seed(seed)
  kwargs = dict(TINY, **overrides)
  if architecture == "llama":
    config = transformers.LlamaConfig(tie_word_embeddings=True, **kwargs)
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.Qwen2Config(tie_word_embeddings=False, **kwargs)
    model = transformers.Qwen2ForCausalLM(config)
  # Default init makes biases zero and norms one: randomise them so parity covers them.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(path)
  return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (Hugging Face -> GGUF row order)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def byte_vocab() -> tuple[list[str], list[str]]:
  """(tokens, merges) of a minimal byte-level BPE: 3 ChatML specials, the 256 byte symbols and
  one merge, 260 ids in all."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  return specials + list(bytes_to_unicode().values()) + ["Ġt"], ["Ġ t"]


def write_gguf(path, model, arch="llama", qtype=gguf.GGMLQuantizationType.F32, drop=(),
               replace=None, gguf_arch=None, extra=None, vocab=None):
  """Writes a transformers model as llama.cpp would; `drop`/`replace` corrupt named tensors,
  `extra` adds tensors (name -> array), `vocab` (tokens, merges) adds a GPT-2 style tokenizer."""
  cfg = model.config
  writer = gguf.GGUFWriter(str(path), arch=gguf_arch or arch)
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_attention_heads)
  writer.add_head_count_kv(cfg.num_key_value_heads)
  writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_vocab_size(cfg.vocab_size)
  if vocab is not None:
    tokens, merges = vocab
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_eos_token_id(2)
  names = gguf.get_tensor_name_map(_GGUF_ARCH[arch], cfg.num_hidden_layers)
  for hf_name, tensor in model.state_dict().items():
    if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    w = tensor.numpy().astype(np.float32)
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
      w = llama_cpp_permute(w, heads)
    if name in drop:
      continue
    w = (replace or {}).get(name, w)
    if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(name, w)
  for name, w in (extra or {}).items():
    writer.add_tensor(name, w)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def save_tokenizer(path, vocab) -> None:
  """Saves a byte-level BPE `PreTrainedTokenizerFast` over `vocab` (tokens, merges) to `path`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  tokens, merges = vocab
  backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                 [tuple(m.split(" ")) for m in merges]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                       eos_token="<|im_end|>").save_pretrained(path)


@contextlib.contextmanager
def transformers_reading(reader: gguf.GGUFReader):
  """transformers' GGUF loading (a model or a tokenizer) given `reader`, an open parse of its
  file, instead of parsing the file again (twice, for a model), and gguf's tensor-name table
  built once per (architecture, layers) instead of once per tensor: about 20 of its 26 s for
  SmolLM2. `reader` is gguf's own reader, as our loader uses; what transformers computes from
  it (dequantizing, un-permuting, naming, the tokenizer) stays its own."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
    patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    yield
