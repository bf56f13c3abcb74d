"""The decoder again, over a layout made for generation on CPU.

`transformer.hidden_states` scans stacked `[L, in, out]` kernels over `[B, T, D]` activations:
the layout for training. Decoding a few tokens per step with it is slow on XLA:CPU, measured
on SmolLM2-135M (2 cores):

  * the scan copies each layer's weights out of the stack before its matmuls (a
    dynamic-slice is not fused into a dot): as much memory traffic as the matmuls;
  * a matmul whose rows are the few tokens ([B, D] @ [D, F]) runs at a half to two thirds of
    the speed of the same product with the weight on the left ([F, D] @ [D, B]);
  * attention over a [B, S, K, E] cache slice copies it to a heads-first layout first, and an
    update of the cache followed by a read of it makes XLA copy the whole cache.

So here each layer's weights are separate buffers (the layers are unrolled), kernels are
stored transposed (`kernel_t`, [out, in]), activations run feature-major ([D, N], N = B·T
tokens), the output projection gives vocab-major logits [V, N], and the KV cache is split
into per-layer, heads-first buffers (`LayerCaches`) that attention reads before this call's
keys are written. The maths is exactly `transformer`'s; only the layout differs (the sampler
tests check one against the other). Parameter tree (`to_decode_layout` makes it once,
outside `jit`: a copy of the weights):

    {"embed": [V, D],
     "layers": [{"input_norm": [D], "post_attention_norm": [D],
                 "q_proj": {"kernel_t": [H*E, D], "bias": [H*E]}, ...,
                 "down_proj": {"kernel_t": [D, F]}}] * L,
     "final_norm": [D],
     "lm_head_t": [V, D]}                                   # untied models only

LoRA adapters keep their `Adapters` layout; every adapter's down-projection is computed for
every token and the id's one-hot selects one (exact, and each adapter is read once per step).
Adapter dropout is a training feature and is not applied here. The price of unrolling: a
30-layer model compiles in ~10 s instead of ~2 s.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from marft_jax.lora.routing import Adapters, broadcast_adapter_ids
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig
from marft_jax.models.layers import MASK_VALUE, rms_norm, rope_inverse_frequencies
from marft_jax.models.transformer import KVCache, Params


def to_decode_layout(params: Params) -> Params:
  """The decode-layout tree of a stacked parameter tree (a copy; do it once, outside jit)."""
  layers = params["layers"]
  num_layers = jax.tree.leaves(layers)[0].shape[0]

  def layer(i):
    out = {}
    for name, value in layers.items():
      if isinstance(value, dict):
        out[name] = {"kernel_t": value["kernel"][i].T}  # eager: a new [out, in] buffer
        if "bias" in value:
          out[name]["bias"] = value["bias"][i]
      else:
        out[name] = value[i]
    return out

  tree = {"embed": params["embed"], "layers": [layer(i) for i in range(num_layers)],
          "final_norm": params["final_norm"]}
  if "lm_head" in params:
    tree["lm_head_t"] = params["lm_head"].T
  return jax.block_until_ready(tree)


def is_decode_layout(params: Params) -> bool:
  return isinstance(params["layers"], (list, tuple))


def _rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:
  """`layers.apply_rope` on x [heads, E, N] with positions [N]."""
  inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
  angles = inv_freq[:, None] * positions.astype(jnp.float32)[None, :]  # [E/2, N]
  cos, sin = jnp.cos(angles)[None], jnp.sin(angles)[None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).astype(x.dtype)


def _linear(x, p, adapter, onehot, scale):
  """x [D_in, N] -> [D_out, N]: kernel, bias and the selected adapter's update."""
  y = jnp.einsum("od,dn->on", p["kernel_t"].astype(x.dtype), x)
  if "bias" in p:
    y = y + p["bias"].astype(x.dtype)[:, None]
  if adapter is not None:
    down = jnp.einsum("adr,dn->arn", adapter["a"].astype(x.dtype), x) * onehot[:, None, :]
    y = y + jnp.einsum("aro,arn->on", adapter["b"].astype(x.dtype), down) * scale
  return y


def _attention(q, old_k, old_v, old_valid, new_k, new_v, mask):
  """Attention of T new tokens per row over the cache before this call and over themselves.

  Reading the cache as it was (and not after this call's write) keeps the write in place.

  Args:
    q: [B, K, G, T, E]. old_k: [B, K, E, S], old_v: [B, K, S, E], old_valid: [B, S].
    new_k: [B, K, E, T], new_v: [B, K, T, E], mask: [B, T] real new tokens.
  Returns:
    [B, K, G, T, E].
  """
  B, K, G, T, E = q.shape
  f32 = jnp.float32
  scale = 1.0 / math.sqrt(E)
  causal = mask[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None]  # [B, T, T]
  old = jnp.einsum("bkgte,bkes->bkgts", q, old_k, preferred_element_type=f32) * scale
  old = jnp.where(old_valid[:, None, None, None, :], old, MASK_VALUE)
  new = jnp.einsum("bkgte,bkeu->bkgtu", q, new_k, preferred_element_type=f32) * scale
  new = jnp.where(causal[:, None, None], new, MASK_VALUE)
  top = jnp.maximum(jnp.max(old, axis=-1), jnp.max(new, axis=-1))[..., None]
  p_old, p_new = jnp.exp(old - top), jnp.exp(new - top)
  total = jnp.sum(p_old, axis=-1) + jnp.sum(p_new, axis=-1)
  out = (jnp.einsum("bkgts,bkse->bkgte", p_old.astype(old_v.dtype), old_v,
                    preferred_element_type=f32)
         + jnp.einsum("bkgtu,bkue->bkgte", p_new.astype(new_v.dtype), new_v,
                      preferred_element_type=f32))
  return (out / total[..., None]).astype(q.dtype)


def _write_after(buf, new, start, read):
  """`buf` with `new` written at `start`, ordered after `read` has been computed.

  XLA updates `buf` in place only if it can see that every read of the old value comes
  first; otherwise it copies the whole buffer. A layer's keys do not depend on its attention
  output, so a data path is made: `after` is exactly 0 (never NaN), but not known to XLA.
  """
  after = (read.reshape(-1)[0] == jnp.inf).astype(buf.dtype)
  return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype) * (1 - after), start)


def _layer(x, cache_k, cache_v, valid, kv_index, layer, adapters, positions, mask, onehot, scale,
           config: ModelConfig):
  """`transformer._decoder_layer` in the decode layout.

  Args:
    x: [D, N] activations, N = B·T. cache_k [B, K, E, S], cache_v [B, K, S, E]: this layer's
      cache before this call; valid: [B, S] its valid slots. kv_index: [] where the T new
      slots start. mask: [B, T] real tokens among the new ones.
  Returns:
    x, and this layer's cache with the new keys and values written.
  """
  B, T = mask.shape
  K, G, E = config.num_kv_heads, config.num_groups, config.head_dim
  linear = lambda h, name: _linear(h, layer[name], adapters.get(name), onehot, scale)
  h = rms_norm(x, layer["input_norm"], config.rms_norm_eps, axis=0)
  q = _rope(linear(h, "q_proj").reshape(K * G, E, -1), positions, config)
  k = _rope(linear(h, "k_proj").reshape(K, E, -1), positions, config)
  v = linear(h, "v_proj").reshape(K, E, B, T)
  new_k = k.reshape(K, E, B, T).transpose(2, 0, 1, 3)  # [B, K, E, T]
  new_v = v.transpose(2, 0, 3, 1)  # [B, K, T, E]
  q = q.reshape(K, G, E, B, T).transpose(3, 0, 1, 4, 2)  # [B, K, G, T, E]
  out = _attention(q, cache_k.astype(x.dtype), cache_v.astype(x.dtype), valid, new_k, new_v, mask)
  cache_k = _write_after(cache_k, new_k, (0, 0, 0, kv_index), out)
  cache_v = _write_after(cache_v, new_v, (0, 0, kv_index, 0), out)
  x = x + linear(out.transpose(1, 2, 4, 0, 3).reshape(K * G * E, B * T), "o_proj")
  h = rms_norm(x, layer["post_attention_norm"], config.rms_norm_eps, axis=0)
  x = x + linear(jax.nn.silu(linear(h, "gate_proj")) * linear(h, "up_proj"), "down_proj")
  return x, cache_k, cache_v


@struct.dataclass
class LayerCaches:
  """A `KVCache` in the decode layout: each layer's keys and values in their own buffers
  (read in place rather than copied out of the [L, ...] stack), heads first, keys
  transposed, so that attention's products read them without a transposed copy."""

  k: list  # L × [B, K, E, S]
  v: list  # L × [B, K, S, E]
  valid: jax.Array  # [B, S] bool
  index: jax.Array  # [] int32

  def next_positions(self) -> jax.Array:
    return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)


def split_cache(cache: KVCache) -> LayerCaches:
  """[L, B, S, K, E] keys and values -> per-layer buffers in the decode layout (a copy)."""
  return LayerCaches(k=[k.transpose(0, 2, 3, 1) for k in cache.k],
                     v=[v.transpose(0, 2, 1, 3) for v in cache.v],
                     valid=cache.valid, index=cache.index)


def stack_cache(cache: LayerCaches) -> KVCache:
  """The inverse of `split_cache`."""
  return KVCache(k=jnp.stack([k.transpose(0, 3, 1, 2) for k in cache.k]),
                 v=jnp.stack([v.transpose(0, 2, 1, 3) for v in cache.v]),
                 valid=cache.valid, index=cache.index)


def hidden_states(params: Params, tokens: jax.Array, config: ModelConfig, *,
                  cache: LayerCaches, positions: Optional[jax.Array] = None,
                  mask: Optional[jax.Array] = None, lora: Optional[Adapters] = None,
                  adapter_ids: Optional[jax.Array] = None) -> tuple[jax.Array, LayerCaches]:
  """`transformer.hidden_states` for decode-layout params and a `split_cache` cache.

  Returns:
    h: [B, T, D] final-normed hidden states; the updated cache.
  """
  B, T = tokens.shape
  mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
  if positions is None:
    positions = transformer.default_positions(mask, cache)
  onehot, scale, adapter_layers = None, 1.0, {}
  if lora is not None:
    ids = broadcast_adapter_ids(0 if adapter_ids is None else adapter_ids, B, T,
                                lora.num_adapters)
    onehot = jax.nn.one_hot(ids.reshape(B * T), lora.num_adapters, dtype=config.dtype).T
    scale, adapter_layers = lora.scale, lora.layers

  x = params["embed"][tokens.reshape(B * T)].astype(config.dtype).T  # [D, N]
  new_k, new_v = [], []
  for index, layer in enumerate(params["layers"]):
    adapters = jax.tree.map(lambda a, i=index: a[i], adapter_layers)
    x, k, v = _layer(x, cache.k[index], cache.v[index], cache.valid, cache.index, layer,
                     adapters, positions.reshape(B * T), mask, onehot, scale, config)
    new_k.append(k)
    new_v.append(v)
  h = rms_norm(x, params["final_norm"], config.rms_norm_eps, axis=0).T.reshape(B, T, -1)
  valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))
  return h, LayerCaches(k=new_k, v=new_v, valid=valid, index=cache.index + T)


def vocab_major_logits(params: Params, h: jax.Array, config: ModelConfig) -> jax.Array:
  """[N, D] hidden states -> [V, N] f32 logits (`transformer.logits_from_hidden`, transposed).

  Vocab-major because [V, D] @ [D, N] is the fast orientation of this product for small N.
  """
  w = params["embed"] if config.tie_word_embeddings else params["lm_head_t"]
  return jnp.einsum("vd,nd->vn", w.astype(h.dtype), h, preferred_element_type=jnp.float32)
