"""The Llama/Qwen2 decoder as a pure function of a parameter pytree, in any `Layout`.

One decoder layer (`decoder_layer`), run either under `lax.scan` over stacked weights or by
an unrolled loop over per-layer weights, with activations token-major or feature-major: the
choice is `config.layout` (see `layout.py` for what each buys). Parameter tree in the
training layout (`layout.TRAINING`, what the loaders return)::

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

Kernels are `[in, out]` (the transpose of torch's `Linear.weight`). Without `scan_layers`,
"layers" is a list of L such dicts without the leading axis; with `feature_major`, kernels
and `lm_head` are transposed (`[out, in]`, `[V, D]`). `layout.convert_params` converts.
LoRA adapters (`marft_jax.lora.Adapters`) mirror the names under "layers", stacked, in every
layout.

The KV cache has a fixed number of slots S. A call writes its T tokens into slots
`[index, index + T)` of every row; slots holding padding are marked invalid and never attended.
Rows therefore share one write index while their real lengths differ, and a later call (the
next agent's turn) continues the same cache.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import checkify

from marft_jax import sharding
from marft_jax.lora import fused
from marft_jax.lora.routing import Adapters, canonical_adapter_ids
from marft_jax.models.config import ModelConfig
from marft_jax.models.layers import apply_rope, attention, rms_norm
from marft_jax.models.layout import check_params_layout
from marft_jax.models.targets import LINEARS, NORMS, linear_shapes
from marft_jax.validation import (check_ids, check_int, check_rank, check_same_shape,
                                  checking_traced_values, is_traced)

Params = dict
# Without a cache, attention runs its queries in blocks of this many, each against the keys up
# to its last query (`layers.attention`; exact: the mask built here is causal). On XLA:CPU,
# 128 took a SmolLM2 forward + backward's attention (8 × 256 tokens, 30 layers) from 0.71 s to
# 0.51 s; 64 was slower than 128 (more, smaller products).
QUERY_BLOCK = 128


@struct.dataclass
class KVCache:
  """Keys and values of every layer, with which slots hold real tokens."""

  k: Any  # [L, B, K, E, S] (keys transposed), or a list of L [B, K, E, S] (unrolled layout)
  v: Any  # [L, B, K, S, E], or a list of L [B, K, S, E]
  valid: jax.Array  # [B, S] bool: slot holds a real (non-padding) token.
  index: jax.Array  # [] int32: the next slot to write, shared by all rows.

  @property
  def size(self) -> int:
    return self.valid.shape[1]

  def next_positions(self) -> jax.Array:
    """[B] the RoPE position of each row's next token: its count of real tokens so far."""
    return jnp.sum(self.valid, axis=-1, dtype=jnp.int32)


def init_cache(config: ModelConfig, batch: int, size: int) -> KVCache:
  """An empty cache of `size` slots for `batch` rows, in the compute dtype and config.layout."""
  batch, size = check_int("batch", batch, low=0), check_int("size", size, low=0)
  k_shape = (batch, config.num_kv_heads, config.head_dim, size)
  v_shape = (batch, config.num_kv_heads, size, config.head_dim)
  if config.layout.scan_layers:
    k = jnp.zeros((config.num_layers,) + k_shape, config.dtype)
    v = jnp.zeros((config.num_layers,) + v_shape, config.dtype)
  else:
    k = [jnp.zeros(k_shape, config.dtype) for _ in range(config.num_layers)]
    v = [jnp.zeros(v_shape, config.dtype) for _ in range(config.num_layers)]
  return KVCache(k=k, v=v, valid=jnp.zeros((batch, size), bool), index=jnp.zeros((), jnp.int32))


def grow_cache(cache: KVCache, size: int) -> KVCache:
  """`cache` with `size` ≥ cache.size slots (the new ones empty and invalid): a copy."""
  pad = lambda x, axis: jnp.pad(x, [(0, size - cache.size if a == x.ndim + axis else 0)
                                    for a in range(x.ndim)])
  return cache.replace(k=jax.tree.map(lambda k: pad(k, -1), cache.k),
                       v=jax.tree.map(lambda v: pad(v, -2), cache.v),
                       valid=jnp.pad(cache.valid, ((0, 0), (0, size - cache.size))))


def init_params(config: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random parameters in the training layout (normal(0, std) weights and biases, unit norms),
  for tests and benches."""
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


def check_cache_fits(cache: Optional[KVCache], config: ModelConfig, batch: int) -> None:
  """Refuses a cache made for another model, layout, batch size or dtype. Shapes are static,
  so this holds under `jit` too. Unchecked, a cache of more layers than the model was read
  in part without a word, one of another batch size failed deep in a broadcast, and one in
  bfloat16 rounded an f32 model's keys and values."""
  if cache is None:
    return
  stacked = not isinstance(cache.k, (list, tuple))
  if stacked != config.layout.scan_layers:
    found = "stacked layers" if stacked else "a list of layers"
    raise ValueError(f"cache: holds {found} but config.layout={config.layout} "
                     "(convert it with layout.convert_cache)")
  S = cache.size
  K, E, L = config.num_kv_heads, config.head_dim, config.num_layers
  want = {"keys": (batch, K, E, S), "values": (batch, K, S, E)}
  for what, layers in (("keys", cache.k), ("values", cache.v)):
    shapes = [tuple(layers.shape[1:])] * layers.shape[0] if stacked else [
        tuple(jnp.shape(x)) for x in layers]
    dtypes = {jnp.dtype(layers.dtype)} if stacked else {jnp.dtype(x.dtype) for x in layers}
    if len(shapes) != L or set(shapes) != {want[what]}:
      raise ValueError(f"cache: {what} of {len(shapes)} layers shaped {sorted(set(shapes))}; "
                       f"this model and batch need {L} of {want[what]} "
                       f"(init_cache(config, {batch}, {S}))")
    if dtypes != {jnp.dtype(config.dtype)}:
      found = "/".join(sorted(str(d) for d in dtypes))
      raise ValueError(f"cache: {what} are {found} but the model computes in "
                       f"{jnp.dtype(config.dtype)} (init_cache with this config)")
  if tuple(cache.valid.shape) != (batch, S):
    raise ValueError(f"cache: valid has shape {tuple(cache.valid.shape)}, expected "
                     f"{(batch, S)}")


def check_adapters_fit(lora: Optional[Adapters], config: ModelConfig) -> None:
  """Refuses adapters made for another model (static shapes: also under `jit`). Unchecked,
  adapters of more layers than an unrolled model were read in part without a word, and other
  widths failed deep in a concatenation or a broadcast."""
  if lora is None:
    return
  shapes = linear_shapes(config)
  unknown = sorted(set(lora.layers) - set(shapes))
  if unknown:
    raise ValueError(f"lora: targets {unknown} are not linear layers of this model "
                     f"({sorted(shapes)})")
  L, A, R = config.num_layers, lora.num_adapters, lora.rank
  for name, (d_in, d_out) in shapes.items():  # the model's order: q_proj first
    if name not in lora.layers:
      continue
    want = {"a": (L, A, d_in, R), "b": (L, A, R, d_out)}
    for factor in ("a", "b"):
      got = tuple(jnp.shape(lora.layers[name][factor]))
      if got != want[factor]:
        raise ValueError(f"lora: {name}.{factor} has shape {got}; this model needs "
                         f"{want[factor]} ([layers, adapters, ...]): adapters of another model")


def check_cache_room(cache: Optional[KVCache], num_new: int) -> None:
  """Refuses to write `num_new` slots past the end of a concrete cache.

  `dynamic_update_slice` would clamp the write index and overwrite the newest slots instead.
  Under `jit` the index is traced: there the caller sizes the cache (the sampler grows it),
  and `checkify.checkify` reports an overflow (traced inside `validation.traced_checks()`).
  """
  if cache is None:
    return
  if not is_traced(cache.index):
    if int(cache.index) + num_new > cache.size:
      raise ValueError(f"cache: {num_new} new tokens at slot {int(cache.index)} do not fit its "
                       f"{cache.size} slots; make a larger cache (init_cache) or let "
                       "sampler.generate grow it")
  elif checking_traced_values():
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


@jax.custom_jvp
def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) · up, with its derivative written out: d/dg silu(g) = σ(g)·(1 + g·(1 - σ(g))).

  Autodiff's derivative of silu goes through the logistic function's own rules; this form
  shares σ(g) between the value and both gradients (about 1 % of a SmolLM2 update on XLA:CPU).
  """
  return jax.nn.silu(gate) * up


@_swiglu.defjvp
def _swiglu_jvp(primals, tangents):
  gate, up = primals
  d_gate, d_up = tangents
  sigmoid = jax.nn.sigmoid(gate)
  silu = gate * sigmoid
  return silu * up, (up * sigmoid * (1 + gate * (1 - sigmoid))) * d_gate + silu * d_up


# --- one decoder layer, in either activation orientation -------------------------------------


@struct.dataclass
class _Call:
  """What every layer of one call shares (static: shapes and config)."""

  positions: jax.Array  # [B, T]
  allowed: jax.Array  # [B, T, T] new key u visible to query t
  valid: Optional[jax.Array]  # [B, S] cached slots, or None without a cache
  adapter_ids: jax.Array  # [B] or [B, T]
  select: Optional[jax.Array]  # [B·T, A] one-hot adapter per token: LoRA fused, else None
  lora_delta: Optional[Callable] = struct.field(pytree_node=False)
  config: ModelConfig = struct.field(pytree_node=False)
  lora_scale: float = struct.field(pytree_node=False, default=1.0)


def _dense(x: jax.Array, p: dict, adapter: Optional[dict], call: _Call) -> jax.Array:
  """A linear layer plus its LoRA update, in the layout's orientation.

  Token-major: x [B, T, D_in] @ kernel [D_in, D_out]. Feature-major: kernel [D_out, D_in] @
  x [D_in, N], the weight on the left (the fast orientation for few tokens on XLA:CPU).
  """
  feature_major = call.config.layout.feature_major
  kernel = p["kernel"].astype(x.dtype)
  in_f32 = adapter is not None and call.config.lora_update_f32 and x.dtype != jnp.float32
  accumulate = jnp.float32 if in_f32 else None
  if feature_major:
    y = jnp.matmul(kernel, x, preferred_element_type=accumulate)
    bias = None if "bias" not in p else p["bias"].astype(x.dtype)[:, None]
  else:
    y = jnp.einsum("btd,df->btf", x, kernel, preferred_element_type=accumulate)
    bias = None if "bias" not in p else p["bias"].astype(x.dtype)[None, None, :]
  if in_f32:
    # What `lora.fused` computes: bf16 x and down factor, products accumulated in f32, the
    # update added to the f32 output and rounded once, the bias after (ModelConfig).
    rounded = dict(adapter, a=jnp.asarray(adapter["a"], x.dtype).astype(jnp.float32))
    y = (y + call.lora_delta(x.astype(jnp.float32), rounded, call.adapter_ids)).astype(x.dtype)
    return y if bias is None else y + bias
  if bias is not None:
    y = y + bias
  if adapter is not None:
    y = y + call.lora_delta(x, adapter, call.adapter_ids)
  return y


def _linears(inputs: tuple, prologue: Callable[..., jax.Array], names: tuple[str, ...],
             layer: dict, adapters: dict, call: _Call) -> list[jax.Array]:
  """The linear layers `names`, all reading x = prologue(*inputs), with their LoRA updates.

  Token-major with adapters and no dropout (training, and generation off CPU), they run as
  one matmul fused with their adapters' down projections (`lora.fused`) when that pays, and
  the backward recomputes the element-wise prologue (a norm, the SwiGLU product) instead of
  keeping x; otherwise x is formed and each linear is one `_dense`.
  """
  present = [n for n in names if n in adapters]
  if call.select is not None and present:
    a = adapters[present[0]]["a"]
    widths = [layer[n]["kernel"].shape[-1] for n in present]
    if fused.use_fused(widths, a.shape[0], a.shape[-1]):
      B, T = call.positions.shape
      factors = [(adapters[n]["a"], adapters[n]["b"]) if n in adapters else None for n in names]
      ys = fused.fused_linears(inputs, prologue, [layer[n]["kernel"] for n in names], factors,
                               call.select, call.lora_scale)
      out = []
      for n, y in zip(names, ys):
        if "bias" in layer[n]:
          y = y + layer[n]["bias"].astype(y.dtype)[None, :]
        out.append(y.reshape(B, T, -1))
      return out
  x = prologue(*inputs)
  return [_dense(x, layer[n], adapters.get(n), call) for n in names]


def _split_heads(y: jax.Array, num_heads: int, call: _Call) -> jax.Array:
  """Projection output -> [B, heads, T, E]."""
  B, T = call.positions.shape
  E = call.config.head_dim
  if call.config.layout.feature_major:  # [heads·E, B·T]
    return y.reshape(num_heads, E, B, T).transpose(2, 0, 3, 1)
  return y.reshape(B, T, num_heads, E).transpose(0, 2, 1, 3)


def _merge_heads(out: jax.Array, call: _Call) -> jax.Array:
  """[B, heads, T, E] -> activations in the layout's orientation."""
  B, H, T, E = out.shape
  if call.config.layout.feature_major:
    return out.transpose(1, 3, 0, 2).reshape(H * E, B * T)
  return out.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def _pin(x: jax.Array, feature_major: bool = False) -> jax.Array:
  """Activations keep the batch split at a layer boundary (a no-op outside a mesh): without
  the pin the partitioner may gather a whole [B, T, D] onto every device of a mesh."""
  if feature_major:  # [D, B·T]
    return sharding.constrain(x, ("act_embed", "act_tokens"))
  return sharding.constrain(x, ("batch", "time", "act_embed"))


def decoder_layer(x: jax.Array, layer: dict, adapters: dict,
                  cached: Optional[tuple[jax.Array, jax.Array]],
                  call: _Call) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array]:
  """One pre-norm block: attention, then the SwiGLU MLP, each with a residual connection.

  Args:
    x: activations, [B, T, D] (token-major) or [D, B·T] (feature-major).
    layer: this layer's weights; adapters: its LoRA factors ({} without LoRA).
    cached: this layer's (keys [B, K, E, S], values [B, K, S, E]) before this call, or None.
  Returns:
    x; this call's (keys, values) [B, K, T, E], for the caller to write into the cache; and
    the attention output, which the cache write is ordered after (see `_write_after`).
  """
  config = call.config
  axis = 0 if config.layout.feature_major else -1
  linears = lambda inputs, prologue, *names: _linears(inputs, prologue, names, layer,
                                                      adapters, call)
  norm = lambda x, weight: rms_norm(x, weight, config.rms_norm_eps, axis=axis)
  q, k, v = linears((x, layer["input_norm"]), norm, "q_proj", "k_proj", "v_proj")
  q = apply_rope(_split_heads(q, config.num_heads, call), call.positions, config)
  k = apply_rope(_split_heads(k, config.num_kv_heads, call), call.positions, config)
  v = _split_heads(v, config.num_kv_heads, call)
  B, _, T, E = q.shape
  q = q.reshape(B, config.num_kv_heads, config.num_groups, T, E)
  old = None if cached is None else (cached[0], cached[1], call.valid)
  out = attention(q, k, v, call.allowed, old, query_block=QUERY_BLOCK)
  # Merging the heads inside o_proj's prologue: the fused backward then keeps `out`, which
  # attention's backward keeps too, instead of a second copy of it in the merged layout.
  merge = lambda out: _merge_heads(out.reshape(B, config.num_heads, T, E), call)
  x = x + linears((out,), merge, "o_proj")[0]
  gate, up = linears((x, layer["post_attention_norm"]), norm, "gate_proj", "up_proj")
  x = x + linears((gate, up), _swiglu, "down_proj")[0]
  return _pin(x, config.layout.feature_major), (k, v), out


# --- running the layers: scanned or unrolled ------------------------------------------------


def _write_after(buffer: jax.Array, new: jax.Array, start: tuple, read: jax.Array) -> jax.Array:
  """`buffer` with `new` written at `start`, ordered after `read` has been computed.

  XLA updates `buffer` in place only if it can see that every read of the old value comes
  first; otherwise it copies the whole buffer. The attention output does not depend on this
  call's keys being in the cache, so a data path is made: `after` is exactly 0 (never NaN),
  but not known to XLA.
  """
  after = (read.reshape(-1)[0] == jnp.inf).astype(buffer.dtype)
  return jax.lax.dynamic_update_slice(buffer, new.astype(buffer.dtype) * (1 - after), start)


def _keys_for_cache(k: jax.Array) -> jax.Array:
  """[B, K, T, E] -> [B, K, E, T]: the cache stores keys transposed (see `layers.attention`)."""
  return jnp.swapaxes(k, -1, -2)


def _scanned_layers(x, params, adapter_layers, cache, call):
  """Stacked [L, ...] weights (and cache) under `lax.scan`: one layer compiled."""
  def body(carry, xs):
    x, cache_kv = carry
    layer, adapters, index = xs
    cached = None if call.valid is None else (cache_kv[0][index], cache_kv[1][index])
    x, (k, v), out = decoder_layer(x, layer, adapters, cached, call)
    if cache_kv is not None:
      cache_kv = (_write_after(cache_kv[0], _keys_for_cache(k)[None],
                               (index, 0, 0, 0, cache.index), out),
                  _write_after(cache_kv[1], v[None], (index, 0, 0, cache.index, 0), out))
    return (x, cache_kv), None

  if call.config.layout.remat:  # prevent_cse=False: a scan body needs no CSE barrier
    body = jax.checkpoint(body, prevent_cse=False)
  num_layers = call.config.num_layers
  cache_kv = None if cache is None else (cache.k, cache.v)
  xs = (params["layers"], adapter_layers, jnp.arange(num_layers))
  (x, cache_kv), _ = jax.lax.scan(body, (x, cache_kv), xs)
  return x, cache_kv


def _unrolled_layers(x, params, adapter_layers, cache, call):
  """A list of per-layer weights and cache buffers, run by an unrolled loop."""
  new_k, new_v = [], []
  for index, layer in enumerate(params["layers"]):
    adapters = jax.tree.map(lambda a, i=index: a[i], adapter_layers)
    cached = None if call.valid is None else (cache.k[index], cache.v[index])
    x, (k, v), out = decoder_layer(x, layer, adapters, cached, call)
    if cache is not None:
      new_k.append(_write_after(cache.k[index], _keys_for_cache(k), (0, 0, 0, cache.index), out))
      new_v.append(_write_after(cache.v[index], v, (0, 0, cache.index, 0), out))
  return x, (None if cache is None else (new_k, new_v))


def hidden_states(params: Params, tokens: jax.Array, config: ModelConfig, *,
                  positions: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                  cache: Optional[KVCache] = None, lora: Optional[Adapters] = None,
                  adapter_ids: Optional[jax.Array] = None,
                  cache_is_empty: bool = False) -> tuple[jax.Array, Optional[KVCache]]:
  """Runs the decoder stack; returns the final-normed hidden states and the updated cache.

  Args:
    params: the parameter tree in `config.layout`.
    tokens: [B, T] int token ids, in [0, V) where `mask` is set.
    config: static model config (its `layout` says how params and cache are stored).
    positions: [B, T] RoPE positions; default: real tokens counted from the cache's count.
    mask: [B, T] bool, False on padding; default all True.
    cache: None for a stand-alone (training) pass; else the tokens are written into slots
      `[cache.index, cache.index + T)` (the caller sizes S so they fit).
    lora: adapters, or None for the base model.
    adapter_ids: [B, T] per-token or [B] per-sequence adapter ids in [-1, A) (-1 = base);
      default 0.
    cache_is_empty: static; the caller knows `cache` holds no valid slot (a fresh one), so
      attention skips reading it (a prompt's attention over S empty slots costs as much as
      over its own T tokens). The tokens are still written into it.

  Concrete arguments are checked (ValueError naming `tokens`, `mask`, `positions`, `cache`,
  `lora`, `adapter_ids`, or params of another layout or model; shapes also when traced: a
  cache, adapters or params made for another model are refused). Traced values cannot be:
  an out-of-range token reads a clamped embedding row, an overflowing cache write is
  clamped, an out-of-range adapter id gets the base model. Wrap the call in
  `jax.experimental.checkify.checkify`, traced inside `validation.traced_checks()`, to have
  the last two reported.
  Returns:
    h: [B, T, D] compute dtype; the new cache (None without one).
  """
  layout = config.layout
  check_params_layout(params, layout, config)
  check_rank(2, tokens=tokens)
  given = {"mask": mask, "positions": positions}
  check_same_shape(tokens=tokens, **{k: v for k, v in given.items() if v is not None})
  B, T = tokens.shape
  mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
  check_ids("tokens", tokens, config.vocab_size, where=mask)
  check_cache_fits(cache, config, B)
  check_cache_room(cache, T)
  check_adapters_fit(lora, config)
  if positions is None:
    positions = default_positions(mask, cache)
  allowed = mask[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None]
  adapter_layers, lora_delta = ({}, None) if lora is None else (
      lora.scan_inputs(), lora.delta_fn(layout.feature_major))
  ids = canonical_adapter_ids(0 if adapter_ids is None else adapter_ids, B, T,
                              None if lora is None else lora.num_adapters)
  fuse = lora is not None and not layout.feature_major and (
      lora.dropout_rng is None or lora.dropout_rate == 0.0)
  select = fused.adapter_select(ids, lora.num_adapters, T, config.dtype) if fuse else None
  call = _Call(positions=positions, allowed=allowed,
               valid=None if cache is None or cache_is_empty else cache.valid, adapter_ids=ids,
               select=select, lora_delta=lora_delta, config=config,
               lora_scale=1.0 if lora is None else lora.scale)

  # The table's width is split over fsdp like every weight's; gathered whole for the lookup
  # (FSDP's per-use weight gather), rows come out split like the batch, not like the width.
  embed = sharding.constrain(params["embed"], ("vocab", None))
  x = _pin(embed[tokens].astype(config.dtype))  # [B, T, D]
  if layout.feature_major:
    x = x.reshape(B * T, -1).T
  run = _scanned_layers if layout.scan_layers else _unrolled_layers
  x, cache_kv = run(x, params, adapter_layers, cache, call)
  if layout.feature_major:
    x = x.T.reshape(B, T, -1)
  h = _pin(rms_norm(x, params["final_norm"], config.rms_norm_eps))
  if cache is not None:
    valid = jax.lax.dynamic_update_slice(cache.valid, mask, (0, cache.index))
    cache = KVCache(k=cache_kv[0], v=cache_kv[1], valid=valid, index=cache.index + T)
  return h, cache


def logits_from_hidden(params: Params, h: jax.Array, config: ModelConfig,
                       vocab_major: bool = False) -> jax.Array:
  """Hidden states -> f32 logits: [..., D] -> [..., V], or [N, D] -> [V, N] (`vocab_major`).

  Vocab-major is the fast orientation of this product for few tokens on XLA:CPU ([V, D] @
  [D, N]); the sampler works vocab-major throughout.
  """
  if config.tie_word_embeddings:
    w, spec = params["embed"], "vd"  # [V, D]
  else:
    w, spec = params["lm_head"], "vd" if config.layout.feature_major else "dv"
  out = "vn" if vocab_major else "...v"
  lhs = "nd" if vocab_major else "...d"
  return jnp.einsum(f"{lhs},{spec}->{out}", h, w.astype(h.dtype),
                    preferred_element_type=jnp.float32)


def forward(params: Params, tokens: jax.Array, config: ModelConfig, *,
            positions: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
            cache: Optional[KVCache] = None, lora: Optional[Adapters] = None,
            adapter_ids: Optional[jax.Array] = None,
            cache_is_empty: bool = False) -> tuple[jax.Array, Optional[KVCache]]:
  """Logits [B, T, V] (f32) and the updated cache; arguments as in `hidden_states`."""
  h, cache = hidden_states(params, tokens, config, positions=positions, mask=mask, cache=cache,
                           lora=lora, adapter_ids=adapter_ids, cache_is_empty=cache_is_empty)
  return logits_from_hidden(params, h, config), cache
