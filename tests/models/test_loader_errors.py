"""Bad checkpoints, configs and tokenizers are refused with errors that name the file and the
tensor or key (issue 8, §2): never a truncated model, NaN from a neighbouring tensor, or ids
clamped at generation. Every file here is a tiny one written in `tmp_path`."""

import json
import logging
import math
import pathlib
import re

import gguf
import numpy as np
import pytest

from marft_jax.models import gguf_checkpoint, hf_checkpoint, loading
from marft_jax.models.config import ModelConfig, RopeScaling, tiny_config
from tests.models.hf_fixtures import byte_vocab, save_tiny_model, save_tokenizer, write_gguf

def _at(file) -> str:
  """Regex: a message that starts by naming `file`."""
  return "^" + re.escape(f"{file}: ")


HF_TINY = dict(model_type="llama", vocab_size=160, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

# --- config values ----------------------------------------------------------------------------


@pytest.mark.parametrize("key,value,expected", [
    ("num_key_value_heads", 0, "num_key_value_heads=0: must be a positive int"),
    ("hidden_size", "64", "hidden_size='64': must be a positive int"),
    ("num_hidden_layers", 2.0, "num_hidden_layers=2.0: must be a positive int"),
    ("intermediate_size", -96, "intermediate_size=-96: must be a positive int"),
    ("vocab_size", True, "vocab_size=True: must be a positive int"),
    ("num_attention_heads", 0, "num_attention_heads=0: must be a positive int"),
    ("head_dim", 0, "head_dim=0: must be a positive int"),
    ("max_position_embeddings", 0, "max_position_embeddings=0: must be a positive int"),
    ("rms_norm_eps", math.nan, "rms_norm_eps=nan: must be a finite positive number"),
    ("rope_theta", math.nan, "rope_theta=nan: must be a finite positive number"),
    ("rope_theta", "1e4", "rope_theta='1e4': must be a finite positive number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false': must be true or false"),
    ("rope_scaling", {"rope_type": "linear", "factor": "2"},
     "rope_scaling.factor='2': must be a finite positive number"),
    ("rope_parameters", {"rope_theta": -1.0}, "rope_parameters.rope_theta=-1.0: must be"),
    ("rope_scaling", [8.0], "rope_scaling=[8.0]: must be an object"),
])
def test_hf_config_values_name_the_key_and_file(key, value, expected):
  with pytest.raises(ValueError) as error:
    ModelConfig.from_hf_config({**HF_TINY, key: value}, "some/config.json")
  assert str(error.value).startswith(f"some/config.json: {expected}")


def test_absent_optional_keys_take_transformers_defaults():
  config = ModelConfig.from_hf_config({**HF_TINY, "num_key_value_heads": None})
  assert (config.num_kv_heads, config.head_dim, config.max_position_embeddings) == (4, 16, 2048)
  config = ModelConfig.from_hf_config({**HF_TINY, "max_position_embeddings": 4096})
  assert config.max_position_embeddings == 4096


@pytest.mark.parametrize("field,value", [
    ("num_kv_heads", 0), ("num_layers", -1), ("hidden_size", 64.0), ("vocab_size", "256"),
    ("head_dim", None), ("max_position_embeddings", 0), ("rope_theta", math.inf),
    ("rms_norm_eps", 0.0), ("qkv_bias", 1), ("tie_word_embeddings", "yes"),
])
def test_model_config_checks_every_field_by_name(field, value):
  with pytest.raises(ValueError, match=rf"^{field}={value!r}: must be"):
    tiny_config(**{field: value})


def test_rope_scaling_fields_are_checked():
  with pytest.raises(ValueError, match=r"rope_scaling\.factor=0: must be"):
    RopeScaling(rope_type="linear", factor=0)
  with pytest.raises(ValueError, match=r"rope_scaling\.high_freq_factor=1\.0 must exceed"):
    RopeScaling(rope_type="llama3", factor=8.0, high_freq_factor=1.0)
  with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='yarn' is not supported"):
    RopeScaling(rope_type="yarn")


# --- Hugging Face folders: layer counts, unused tensors, safetensors, index ------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
  """A tiny llama folder: config.json + model.safetensors (2 layers, vocab 160)."""
  path = tmp_path_factory.mktemp("hf")
  save_tiny_model(path, "llama")
  return path


def _copy_folder(src, dst, config_changes=None):
  dst.mkdir(exist_ok=True)
  config = json.loads((src / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
  (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
  return dst


def test_fewer_config_layers_than_the_file_are_refused_unless_requested(hf_folder, tmp_path,
                                                                        caplog):
  path = _copy_folder(hf_folder, tmp_path / "m", {"num_hidden_layers": 1})
  with pytest.raises(ValueError) as error:
    hf_checkpoint.load_hf_checkpoint(path)
  message = str(error.value)
  assert message.startswith(f"{path / 'model.safetensors'}: 9 tensor(s) in the file would be "
                            "left unused: 'model.layers.1.")
  assert "and 4 more; the file has layers beyond the config's num_layers=1" in message
  with caplog.at_level(logging.INFO, logger="marft_jax.models.hf_checkpoint"):
    params, config = hf_checkpoint.load_hf_checkpoint(path, num_layers=1)
  assert config.num_layers == 1 and params["layers"]["q_proj"]["kernel"].shape[0] == 1
  assert "num_layers=1 requested: leaving out the 9 tensors of deeper layers" in caplog.text


def test_unused_tensor_is_refused_even_with_a_layer_override(hf_folder, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy_folder(hf_folder, tmp_path / "m")
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # harmless
  save_file(tensors, path / "model.safetensors")
  for overrides in ({}, {"num_layers": 1}):
    with pytest.raises(ValueError, match=r"model\.safetensors: \d+ tensor\(s\) in the file would "
                                         r"be left unused: 'model\.layers\.0\.self_attn\.q_norm"):
      hf_checkpoint.load_hf_checkpoint(path, **overrides)


def test_more_config_layers_than_the_file_list_the_missing_tensors(hf_folder, tmp_path):
  path = _copy_folder(hf_folder, tmp_path / "m", {"num_hidden_layers": 3})
  with pytest.raises(ValueError, match=r"model\.safetensors: 9 tensor\(s\) the config needs are "
                                       r"missing: 'model\.layers\.2\..*' and 4 more$"):
    hf_checkpoint.load_hf_checkpoint(path)


def test_tied_head_stored_anyway_must_equal_the_embedding(hf_folder, tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy_folder(hf_folder, tmp_path / "m")
  tensors = load_file(path / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, path / "model.safetensors")
  hf_checkpoint.load_hf_checkpoint(path)
  tensors["lm_head.weight"][0, 0] += 1
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'lm_head\.weight' differs "
                                       r"from 'model\.embed_tokens\.weight' but config\.json ties"):
    hf_checkpoint.load_hf_checkpoint(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_bad_safetensors_file_is_named(hf_folder, tmp_path, damage):
  path = _copy_folder(hf_folder, tmp_path / "m")
  data = (path / "model.safetensors").read_bytes()
  broken = {"truncated": data[:-100], "garbage": b"\x07" * 64, "empty": b""}[damage]
  (path / "model.safetensors").write_bytes(broken)
  with pytest.raises(ValueError, match=_at(path / "model.safetensors")
                     + "not a readable safetensors file, truncated or corrupt"):
    hf_checkpoint.load_hf_checkpoint(path)


def _sharded_folder(hf_folder, tmp_path):
  """The tiny model split into two shards with an index."""
  from safetensors.numpy import load_file, save_file
  path = tmp_path / "sharded"
  path.mkdir()
  (path / "config.json").write_text((hf_folder / "config.json").read_text())
  tensors = load_file(hf_folder / "model.safetensors")
  names = sorted(tensors)
  shards = {"a.safetensors": names[:10], "b.safetensors": names[10:]}
  for shard, shard_names in shards.items():
    save_file({n: tensors[n] for n in shard_names}, path / shard)
  weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return path, weight_map


def test_sharded_checkpoint_loads_and_bad_index_or_shard_is_named(hf_folder, tmp_path):
  path, weight_map = _sharded_folder(hf_folder, tmp_path)
  index = path / "model.safetensors.index.json"
  reference, _ = hf_checkpoint.load_hf_checkpoint(hf_folder)
  params, _ = hf_checkpoint.load_hf_checkpoint(path)
  np.testing.assert_array_equal(params["embed"], reference["embed"])

  index.write_text('{"weight_map": {')
  with pytest.raises(ValueError, match=_at(index) + r"invalid JSON at line 1"):
    hf_checkpoint.load_hf_checkpoint(path)
  index.write_text(json.dumps({"weight_map": list(weight_map)}))
  with pytest.raises(ValueError, match=_at(index) + r"no 'weight_map' object"):
    hf_checkpoint.load_hf_checkpoint(path)
  index.write_text(json.dumps([weight_map]))
  with pytest.raises(ValueError, match=_at(index) + r"no 'weight_map' object"):
    hf_checkpoint.load_hf_checkpoint(path)
  name = next(iter(weight_map))
  index.write_text(json.dumps({"weight_map": {**weight_map, name: 3}}))
  with pytest.raises(ValueError, match=_at(index) + rf"weight_map\['{name}'\]=3: must be a file"):
    hf_checkpoint.load_hf_checkpoint(path)
  index.write_text(json.dumps({"weight_map": {**weight_map, name: "c.safetensors"}}))
  with pytest.raises(FileNotFoundError, match=_at(index)
                     + rf"shard 'c\.safetensors' \(listed for tensor '{name}'\) is missing"):
    hf_checkpoint.load_hf_checkpoint(path)

  index.write_text(json.dumps({"weight_map": weight_map}))
  (path / "b.safetensors").write_bytes((path / "b.safetensors").read_bytes()[:-8])
  with pytest.raises(ValueError, match=_at(path / "b.safetensors")
                     + "not a readable safetensors file, truncated or corrupt"):
    hf_checkpoint.load_hf_checkpoint(path)


def test_index_listing_a_tensor_its_shard_lacks_names_both(hf_folder, tmp_path):
  path, weight_map = _sharded_folder(hf_folder, tmp_path)
  moved = next(n for n, shard in weight_map.items() if shard == "a.safetensors")
  weight_map[moved] = "b.safetensors"
  (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  with pytest.raises(ValueError, match=_at(path / "b.safetensors") + "cannot read tensor "
                     + re.escape(repr(moved))):
    hf_checkpoint.load_hf_checkpoint(path)


def test_bad_config_json_names_the_file_and_key(hf_folder, tmp_path):
  path = _copy_folder(hf_folder, tmp_path / "m", {"num_key_value_heads": 0})
  with pytest.raises(ValueError, match=_at(path / "config.json") + r"num_key_value_heads=0: must"):
    hf_checkpoint.load_hf_checkpoint(path)
  (path / "config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match=_at(path / "config.json") + r"expected a JSON object"):
    hf_checkpoint.load_hf_checkpoint(path)


# --- GGUF: every tensor's extent against the file ---------------------------------------------


def _small_gguf(path) -> str:
  """Three tensors in file order: 'a' F32 [8, 4], 'b' F16 [2, 32], 'c' Q8_0 [2, 64]."""
  writer = gguf.GGUFWriter(str(path), arch="llama")
  writer.add_tensor("a", np.arange(32, dtype=np.float32).reshape(8, 4))
  writer.add_tensor("b", np.ones((2, 32), np.float16))
  q8 = gguf.GGMLQuantizationType.Q8_0
  writer.add_tensor("c", gguf.quants.quantize(np.ones((2, 64), np.float32), q8), raw_dtype=q8)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def _edit_tensor_info(path, name, ne0=None, ne1=None, type_id=None):
  """Rewrites a tensor's declared shape (ggml order) or type in place, as a corrupt file has."""
  reader = gguf.GGUFReader(path, "r+")
  parts = next(t for t in reader.tensors if t.name == name).field.parts
  for index, value in ((0, ne0), (1, ne1)):
    if value is not None:
      parts[3][index] = value
  if type_id is not None:
    parts[4][0] = type_id
  reader.data.flush()
  del reader


def test_small_gguf_reads_back(tmp_path):
  reader = gguf_checkpoint.open_gguf(_small_gguf(tmp_path / "s.gguf"))
  assert [t.name for t in reader.tensors] == ["a", "b", "c"]
  np.testing.assert_array_equal(reader.tensors[0].data.reshape(-1), np.arange(32))


@pytest.mark.parametrize("edit,expected", [
    (dict(name="a", ne1=16), r"corrupt: tensor 'a' \(bytes \d+\.\.\d+\) runs into tensor 'b'"),
    (dict(name="b", type_id=int(gguf.GGMLQuantizationType.F32)),
     r"corrupt: tensor 'b' .* runs into tensor 'c'"),
    (dict(name="c", ne1=4), r"truncated: tensor 'c' .* runs past the end of the file"),
    (dict(name="a", type_id=99), r"corrupt: tensor 'a' has unknown ggml type 99"),
    (dict(name="c", ne0=48), r"corrupt: tensor 'c' has rows of 48 values, not a multiple of its "
                             r"type's block of 32"),
])
def test_gguf_tensor_running_past_its_data_is_named(tmp_path, edit, expected):
  path = _small_gguf(tmp_path / "s.gguf")
  _edit_tensor_info(path, **edit)
  with pytest.raises(ValueError, match=_at(path) + expected):
    gguf_checkpoint.open_gguf(path)


def test_truncated_gguf_names_the_tensor_or_the_header(tmp_path):
  path = _small_gguf(tmp_path / "s.gguf")
  data = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(data[:-40])  # 'c' is the last 136 bytes, then 24 of padding
  with pytest.raises(ValueError, match=_at(path) + r"truncated: tensor 'c' \(bytes \d+\.\.\d+\) "
                     rf"runs past the end of the file \({len(data) - 40} bytes"):
    gguf_checkpoint.open_gguf(path)
  pathlib.Path(path).write_bytes(data[:30])
  with pytest.raises(ValueError, match=_at(path) + "not a readable GGUF file, truncated or"):
    gguf_checkpoint.open_gguf(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return save_tiny_model(tmp_path_factory.mktemp("ref"), "llama", vocab_size=260)


def test_truncated_model_gguf_is_refused_by_the_loader_with_the_tensor(tiny_model, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", tiny_model)
  data = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(data[:-1000])
  with pytest.raises(ValueError, match=_at(path) + r"truncated: tensor 'blk\.1\.[a-z_]+\.weight'"):
    gguf_checkpoint.load_gguf_checkpoint(path)


def test_reader_opened_by_the_caller_is_checked_too(tmp_path):
  path = _small_gguf(tmp_path / "s.gguf")
  _edit_tensor_info(path, name="a", ne1=16)
  reader = gguf.GGUFReader(path)  # gguf itself reads 'b's bytes into 'a' without a word
  with pytest.raises(ValueError, match=_at(path) + r"corrupt: tensor 'a' .* runs into tensor 'b'"):
    gguf_checkpoint.load_gguf_checkpoint(reader)


def _edit_metadata(path, key, value):
  reader = gguf.GGUFReader(path, "r+")
  reader.fields[key].parts[-1][0] = value
  reader.data.flush()
  del reader


def test_gguf_block_count_edited_down_is_refused_unless_requested(tiny_model, tmp_path, caplog):
  path = write_gguf(tmp_path / "m.gguf", tiny_model)
  _edit_metadata(path, "llama.block_count", 1)
  with pytest.raises(ValueError, match=_at(path) + r"9 tensor\(s\) in the file would be left "
                     r"unused: 'blk\.1\..* and 4 more; the file has layers beyond the config's "
                     r"num_layers=1"):
    gguf_checkpoint.load_gguf_checkpoint(path)
  with caplog.at_level(logging.INFO, logger="marft_jax.models.hf_checkpoint"):
    _, config = gguf_checkpoint.load_gguf_checkpoint(path, num_layers=1)
  assert config.num_layers == 1 and "leaving out the 9 tensors of deeper layers" in caplog.text


def test_gguf_tensor_we_do_not_read_is_refused(tiny_model, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", tiny_model,
                    extra={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
  for overrides in ({}, {"num_layers": 1}):
    with pytest.raises(ValueError, match=_at(path) + r"1 tensor\(s\) in the file would be "
                       r"left unused: 'blk\.0\.attn_q_norm\.weight'$"):
      gguf_checkpoint.load_gguf_checkpoint(path, **overrides)


@pytest.mark.parametrize("key,value,expected", [
    ("llama.attention.head_count_kv", 0, "llama.attention.head_count_kv=0: must be a positive"),
    ("llama.context_length", 0, "llama.context_length=0: must be a positive int"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan,
     "llama.attention.layer_norm_rms_epsilon=nan: must be a finite positive number"),
])
def test_gguf_metadata_values_name_the_key(tiny_model, tmp_path, key, value, expected):
  path = write_gguf(tmp_path / "m.gguf", tiny_model)
  _edit_metadata(path, key, value)
  with pytest.raises(ValueError, match=_at(path) + expected):
    gguf_checkpoint.load_gguf_checkpoint(path)


def test_gguf_context_length_is_the_max_positions(tiny_model, tmp_path):
  _, config = gguf_checkpoint.load_gguf_checkpoint(write_gguf(tmp_path / "m.gguf", tiny_model))
  assert config.max_position_embeddings == tiny_model.config.max_position_embeddings == 256


# --- load_model: path types, suffix case, tokenizer against the embedding ---------------------


def test_load_model_takes_str_or_path_and_any_case_of_gguf(tiny_model, tmp_path):
  path = write_gguf(tmp_path / "model.GGUF", tiny_model, vocab=byte_vocab())
  for source in (path, pathlib.Path(path)):
    params, config, tokenizer = loading.load_model(source)
    assert config.vocab_size == len(tokenizer) == 260 and params["embed"].shape == (260, 64)
  folder = tmp_path / "hf"
  tiny_model.save_pretrained(folder)
  save_tokenizer(folder, byte_vocab())
  for source in (str(folder), folder):
    _, config, tokenizer = loading.load_model(source)
    assert config.vocab_size == len(tokenizer) == 260
  with pytest.raises(FileNotFoundError, match=r"nowhere\.gguf: GGUF file not found"):
    loading.load_model(tmp_path / "nowhere.gguf")
  with pytest.raises(FileNotFoundError, match=r"model '.*nowhere': not 'smollm2', an existing"):
    loading.load_model(tmp_path / "nowhere")
  with pytest.raises(TypeError, match=r"source=3: expected 'smollm2' or a path"):
    loading.load_model(3)


def test_source_kind_names_the_loader_without_reading_the_file(tmp_path):
  """What a launch checks of a second model (the judge's) before the first loads."""
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
  (tmp_path / "folder").mkdir()
  assert loading.source_kind("smollm2") == "smollm2"
  assert loading.source_kind(tmp_path / "junk.gguf") == "gguf"  # its bytes are the load's
  assert loading.source_kind(str(tmp_path / "folder")) == "hf"
  with pytest.raises(ValueError, match=r"junk\.gguf: not a readable GGUF file"):
    loading.load_model(tmp_path / "junk.gguf")
  for source, message in [(tmp_path / "nowhere.gguf", r"nowhere\.gguf: GGUF file not found"),
                          (tmp_path / "nowhere", r"model '.*nowhere': not 'smollm2'")]:
    with pytest.raises(FileNotFoundError, match=message):
      loading.source_kind(source)


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
  small = save_tiny_model(tmp_path / "hf", "llama")  # vocab_size 160 < 260 token ids
  save_tokenizer(tmp_path / "hf", byte_vocab())
  with pytest.raises(ValueError, match=_at(tmp_path / "hf") + r"the tokenizer has 260 token ids "
                     r"\(added tokens included\) but the model's vocab_size is 160"):
    loading.load_model(tmp_path / "hf")
  path = write_gguf(tmp_path / "m.gguf", small, vocab=byte_vocab())
  with pytest.raises(ValueError, match=_at(path) + r"the tokenizer has 260 token ids"):
    loading.load_model(path)


def test_added_tokens_count_against_the_embedding(tmp_path):
  save_tiny_model(tmp_path, "llama", vocab_size=260)
  save_tokenizer(tmp_path, byte_vocab())
  loading.load_model(tmp_path)
  from transformers import AutoTokenizer
  tokenizer = AutoTokenizer.from_pretrained(tmp_path)
  tokenizer.add_tokens(["<tool>"])
  tokenizer.save_pretrained(tmp_path)
  with pytest.raises(ValueError, match=r"the tokenizer has 261 token ids .* vocab_size is 260"):
    loading.load_model(tmp_path)
