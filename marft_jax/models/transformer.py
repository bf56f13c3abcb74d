"""The Llama/Qwen2 decoder as a pure function of a parameter pytree.

Parameter tree (layers stacked on a leading axis L and run with `lax.scan`, so a 30-layer
model compiles as fast as a 1-layer one)::

    {"embed": [V, D],
     "layers": {"input_norm": [L, D], "post_attention_norm": [L, D],
                "q_proj": {"kernel": [L, D, H*E], "bias": [L, H*E]},   # bias: Qwen2 only
                "k_proj": {"kernel": [L, D, K*E], "bias": [L, K*E]},
                "v_proj": {"kernel": [L, D, K*E], "bias": [L, K*E]},
                "o_proj": {"kernel": [L, H*E, D]},
                "gate_proj": {"kernel": [L, D, F]}, "up_proj": {"kernel": [L, D, F]},
                "down_proj": {"kernel": [L, F, D]}},
     "final_norm": [D],
     "lm_head": [D, V]}                                                # untied models only

Kernels are `[in, out]` (the transpose of torch's `Linear.weight`). LoRA adapters
(`marft_jax.lora.Adapters`) mirror the names under "layers".

The KV cache has a fixed number of slots S. A call writes its T tokens into slots
`[index, index + T)` of every row; slots holding padding are marked invalid and never attended.
Rows therefore share one write index while their real lengths differ, and a later call (the
next agent's turn) continues the same cache.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import checkify

from marft_jax.lora.routing import Adapters, canonical_adapter_ids
from marft_jax.models.config import ModelConfig
from marft_jax.models.layers import apply_rope, attention, rms_norm
from marft_jax.models.targets import LINEARS, NORMS
from marft_jax.validation import check_ids, is_traced

Params = dict

@struct.dataclass
class KVCache:
  """Keys and values of every layer, with which slots hold real tokens."""

  k: jax.Array  # [L, B, S, K, E]
  v: jax.Array  # [L, B, S, K, E]
  valid: jax.Array  # [B, S] bool: slot holds a real (non-padding) token.
  index: jax.Array  # [] int32: the next slot to write, shared by all rows.

  @property
  def size(self) -> int:
    return self.k.shape[2]

  def next_positions(self) -> jax.Array:
    """[B] the RoPE position of each row's next token: its count of real tokens so far."""
    return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)


def init_cache(config: ModelConfig, batch: int, size: int) -> KVCache:
  """An empty cache of `size` slots for `batch` rows, in the compute dtype."""
  shape = (config.num_layers, batch, size, config.num_kv_heads, config.head_dim)
  return KVCache(k=jnp.zeros(shape, config.dtype), v=jnp.zeros(shape, config.dtype),
                 valid=jnp.zeros((batch, size), bool), index=jnp.zeros((), jnp.int32))


def init_params(config: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random parameters (normal(0, std) weights and biases, unit norms), for tests and benches."""
  dtype = jnp.dtype(config.param_dtype)
  L, D, V = config.num_layers, config.hidden_size, config.vocab_size
  keys = iter(jax.random.split(rng, 2 * len(LINEARS) + 2))
  normal = lambda shape: (std * jax.random.normal(next(keys), shape)).astype(dtype)
  layers = {norm.name: jnp.ones((L, D), dtype) for norm in NORMS}
  for linear in LINEARS:
    fan_in, fan_out = linear.shape(config)
    layers[linear.name] = {"kernel": normal((L, fan_in, fan_out))}
    if config.qkv_bias and linear.qkv:
      layers[linear.name]["bias"] = normal((L, fan_out))
  params = {"embed": normal((V, D)), "layers": layers, "final_norm": jnp.ones((D,), dtype)}
  if not config.tie_word_embeddings:
    params["lm_head"] = normal((D, V))
  return params


def check_cache_room(cache: Optional[KVCache], num_new: int) -> None:
  """Refuses to write `num_new` slots past the end of a concrete cache.

  `dynamic_update_slice` would clamp the write index and overwrite the newest slots instead.
  Under `jit` the index is traced: there the caller sizes the cache (the sampler grows it),
  and `checkify.checkify` reports an overflow.
  """
  if cache is None:
    return
  if not is_traced(cache.index):
    if int(cache.index) + num_new > cache.size:
      raise ValueError(f"cache: {num_new} new tokens at slot {int(cache.index)} do not fit its "
                       f"{cache.size} slots; make a larger cache (init_cache) or let "
                       "sampler.generate grow it")
  else:
    checkify.debug_check(cache.index + num_new <= cache.size,
                         f"cache: {num_new} new tokens overflow its {cache.size} slots")


def default_positions(mask: jax.Array, cache: Optional[KVCache]) -> jax.Array:
  """Positions counting real tokens only: left or inner padding does not shift RoPE.

  Args:
    mask: [B, T] bool. cache: positions continue from the cache's real-token count.
  Returns:
    [B, T] int32 (padding gets its row's next real position; it is never attended).
  """
  start = 0 if cache is None else cache.next_positions()[:, None]
  return start + jnp.cumsum(mask, axis=-1, dtype=jnp.int32) - mask.astype(jnp.int32)


def _dense(x, p, adapter, adapter_ids, lora_delta):
  y = jnp.einsum("btd,df->btf", x, p["kernel"].astype(x.dtype))
  if "bias" in p:
    y = y + p["bias"].astype(x.dtype)[None, None, :]
  if adapter is not None:
    y = y + lora_delta(x, adapter, adapter_ids)
  return y


def _decoder_layer(x, cache_kv, layer, adapters, layer_index, positions, allowed, kv_index,
                   adapter_ids, lora_delta, config: ModelConfig):
  """One pre-norm block. cache_kv: None or ([L, B, S, K, E], [L, B, S, K, E]) updated in place."""
  B, T, _ = x.shape
  dense = lambda h, name: _dense(h, layer[name], adapters.get(name), adapter_ids, lora_delta)
  h = rms_norm(x, layer["input_norm"], config.rms_norm_eps)
  q = dense(h, "q_proj").reshape(B, T, config.num_heads, config.head_dim)
  k = dense(h, "k_proj").reshape(B, T, config.num_kv_heads, config.head_dim)
  v = dense(h, "v_proj").reshape(B, T, config.num_kv_heads, config.head_dim)
  q, k = apply_rope(q, positions, config), apply_rope(k, positions, config)
  if cache_kv is not None:
    cache_k, cache_v = cache_kv
    start = (layer_index, 0, kv_index, 0, 0)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), start)
    cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), start)
    k, v = cache_k[layer_index], cache_v[layer_index]
    cache_kv = (cache_k, cache_v)
  q = q.reshape(B, T, config.num_kv_heads, config.num_groups, config.head_dim)
  out = attention(q, k.astype(q.dtype), v.astype(q.dtype), allowed)
  x = x + dense(out.reshape(B, T, -1), "o_proj")
  h = rms_norm(x, layer["post_attention_norm"], config.rms_norm_eps)
  x = x + dense(jax.nn.silu(dense(h, "gate_proj")) * dense(h, "up_proj"), "down_proj")
  return x, cache_kv


def hidden_states(params: Params, tokens: jax.Array, config: ModelConfig, *,
                  positions: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                  cache: Optional[KVCache] = None, lora: Optional[Adapters] = None,
                  adapter_ids: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[KVCache]]:
  """Runs the decoder stack; returns the final-normed hidden states and the updated cache.

  Args:
    params: the parameter tree above.
    tokens: [B, T] int token ids, in [0, V) where `mask` is set.
    config: static model config.
    positions: [B, T] RoPE positions; default: real tokens counted from the cache's count.
    mask: [B, T] bool, False on padding; default all True.
    cache: None for a stand-alone (training) pass; else the tokens are written into slots
      `[cache.index, cache.index + T)` (the caller sizes S so they fit).
    lora: adapters, or None for the base model.
    adapter_ids: [B, T] per-token or [B] per-sequence adapter ids in [-1, A) (-1 = base);
      default 0.

  Concrete arguments are checked (ValueError naming `tokens`, `cache` or `adapter_ids`);
  traced ones cannot be: an out-of-range token reads a clamped embedding row, an overflowing
  cache write is clamped, an out-of-range adapter id gets the base model. Wrap the call in
  `jax.experimental.checkify.checkify` to have the last two reported.
  Returns:
    h: [B, T, D] compute dtype; the new cache (None without one).
  """
  B, T = tokens.shape
  mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
  check_ids("tokens", tokens, config.vocab_size, where=mask)
  check_cache_room(cache, T)
  if positions is None:
    positions = default_positions(mask, cache)
  if cache is None:
    kv_valid, kv_index, q_slots = mask, 0, jnp.arange(T)
  else:
    kv_valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))
    kv_index, q_slots = cache.index, cache.index + jnp.arange(T)
  kv_slots = jnp.arange(kv_valid.shape[1])
  allowed = kv_valid[:, None, :] & (kv_slots[None, None, :] <= q_slots[None, :, None])

  adapter_layers, lora_delta = ({}, None) if lora is None else (lora.scan_inputs(), lora.delta_fn())
  ids = canonical_adapter_ids(0 if adapter_ids is None else adapter_ids, B, T,
                              None if lora is None else lora.num_adapters)
  x = params["embed"][tokens].astype(config.dtype)

  def body(carry, xs):
    x, cache_kv = carry
    layer, adapters, layer_index = xs
    x, cache_kv = _decoder_layer(x, cache_kv, layer, adapters, layer_index, positions, allowed,
                                 kv_index, ids, lora_delta, config)
    return (x, cache_kv), None

  cache_kv = None if cache is None else (cache.k, cache.v)
  xs = (params["layers"], adapter_layers, jnp.arange(config.num_layers))
  (x, cache_kv), _ = jax.lax.scan(body, (x, cache_kv), xs)
  h = rms_norm(x, params["final_norm"], config.rms_norm_eps)
  if cache is not None:
    cache = KVCache(k=cache_kv[0], v=cache_kv[1], valid=kv_valid, index=cache.index + T)
  return h, cache


def logits_from_hidden(params: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
  """[..., D] hidden states -> [..., V] f32 logits (tied embedding or `lm_head`)."""
  if config.tie_word_embeddings:
    w = params["embed"].astype(h.dtype).T
  else:
    w = params["lm_head"].astype(h.dtype)
  return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, config: ModelConfig, *,
            positions: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
            cache: Optional[KVCache] = None, lora: Optional[Adapters] = None,
            adapter_ids: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[KVCache]]:
  """Logits [B, T, V] (f32) and the updated cache; arguments as in `hidden_states`."""
  h, cache = hidden_states(params, tokens, config, positions=positions, mask=mask, cache=cache,
                           lora=lora, adapter_ids=adapter_ids)
  return logits_from_hidden(params, h, config), cache
