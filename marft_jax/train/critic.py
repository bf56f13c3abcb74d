"""The MARFT critic: an f32 MLP value head on the base model's hidden states, plus an optional
critic LoRA, shared by all agents or split between them.

The original critic (marft-original.md §3.1, §4.1) is the frozen base model and a head without
biases, V = W3·relu(W2·relu(W1·h)), widths D → 1024 → 512 → 1, on the final-normed hidden
state of the last position (action level) or of every position (token level). AReaL-MARFT
(marft-areal.md §4) adds a critic LoRA and ways to split the critic between agents; here they
are `CriticConfig.mode`:

  "shared"          one head, and one critic adapter with `lora`: the centralised critic
                    (AReaL's CTDE default). It applies at every position; agent ids are unused.
  "per_agent_lora"  one critic adapter per agent, routed per position, and one head.
  "per_agent_head"  one head per agent (AReaL's multi_head), one shared adapter with `lora`.

Frame. `values(...)[b, t]` is V(tokens[b, :t+1]), the value of the state in which token t+1
is decided: the action frame of `ppo.credit`, where position t is the decision that emits
token t+1. Per-agent routing follows that frame: position t uses the adapter or head of the
agent that emits token t+1 (`action_frame_ids`). So the last prompt position of an agent's
turn, where that agent's first token is decided and where the action-level critic reads
V(s), is valued by that agent's critic. The AReaL code routes with the token-frame ids: that
position is a -1 transition token there, valued 0 and trained by no adapter.

Positions whose next token belongs to no agent (prompt and transition tokens, the last
position, padding) are valued by head 0 and get no per-agent adapter; the trainer masks them
out. In "per_agent_lora" each position runs through its own agent's adapter in one forward,
so agent 1's values read agent 0's tokens as agent 0's adapter encoded them (as the sampler's
cache does for the policies); AReaL instead runs one forward per adapter over the whole
sequence (A times the cost).

Parameters (a pytree; the head is f32 whatever the base dtype), N heads = A in
"per_agent_head", else 1::

    critic = init_critic(CriticConfig(mode="per_agent_head"), model_config, 3, rng)
    critic["head"]   # [W1 [3, D, 1024], W2 [3, 1024, 512], W3 [3, 512, 1]]
    critic["lora"]   # only with CriticConfig.lora: Adapters with A = num_agents in
                     # "per_agent_lora", else A = 1 (factor b zero: starts as the base)

Gradients reach only `critic`: the base goes through `stop_gradient`. Note that
`lora.where_adapters` masks every `Adapters` node of a tree per agent, the critic's included:
apply it to the policy adapters only if the critic must train every iteration.

Frozen-base fast path. Without a critic LoRA the hidden states do not depend on any trainable
parameter, so compute them once per batch, outside the gradient, and train the head alone::

    h = critic_hidden_states(critic, base, tokens, model_config, critic_config, mask=mask)
    ids = action_frame_ids(agent_ids)                   # [B, T], once per batch

    def value_loss(head, h, ids, returns, value_mask):  # PPO epochs touch only the head
      v = values_from_hidden(head, h, ids, critic_config.mode)
      ...

    jax.grad(value_loss)(critic["head"], h, ids, ...)

That costs one base forward per batch instead of a forward (and, with LoRA, a backward) per
minibatch and epoch. `values` is the composition of the two functions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from marft_jax.lora.adapters import init_adapters
from marft_jax.lora.config import LoraConfig
from marft_jax.lora.routing import NO_ADAPTER, Adapters
from marft_jax.models.config import ModelConfig
from marft_jax.models.transformer import hidden_states
from marft_jax.ppo.credit import token_to_action_frame
from marft_jax.train.batching import over_row_chunks
from marft_jax.validation import check_ids, check_range, check_rank, check_size

MODES = ("shared", "per_agent_lora", "per_agent_head")
CriticParams = dict  # {"head": [N, ...] kernels, "lora": Adapters (optional)}


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """How the critic is built and split between agents (hashable: a static jit argument)."""

  # "shared" (one centralised critic), "per_agent_lora" (a critic adapter per agent, one
  # head) or "per_agent_head" (a head per agent); see the module docstring.
  mode: str = "shared"
  # Widths of the head's hidden layers, D → hidden[0] → ... → 1 (the original's (1024, 512));
  # () makes a linear head.
  hidden: tuple[int, ...] = (1024, 512)
  # A critic LoRA on the base (required by "per_agent_lora"); None: the base is frozen and
  # not adapted, which allows the fast path (module docstring).
  lora: Optional[LoraConfig] = None
  # The head's last kernel is U(±init_scale/√fan_in), the others U(±1/√fan_in) (PyTorch's
  # Linear default, the original's init with init_scale = 1): values start near 0.
  init_scale: float = 0.01

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode={self.mode!r}: choose one of {MODES}")
    if isinstance(self.hidden, list):
      object.__setattr__(self, "hidden", tuple(self.hidden))  # Lists would be unhashable.
    if not isinstance(self.hidden, tuple) or not all(
        isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in self.hidden):
      raise ValueError(f"hidden={self.hidden!r}: must be a tuple of positive ints")
    if self.lora is not None and not isinstance(self.lora, LoraConfig):
      raise ValueError(f"lora={self.lora!r}: must be None or a lora.LoraConfig")
    if self.mode == "per_agent_lora" and self.lora is None:
      raise ValueError("lora=None: mode='per_agent_lora' needs a critic LoRA config")
    check_range("init_scale", self.init_scale, 0.0, math.inf, high_open=True)


def init_critic(config: CriticConfig, model_config: ModelConfig, num_agents: int,
                rng: jax.Array) -> CriticParams:
  """Fresh critic parameters (module docstring), deterministic given `rng`.

  Returns:
    {"head": [[N, D, hidden[0]], ..., [N, hidden[-1], 1]] f32 kernels, N = num_agents in
     "per_agent_head" else 1; "lora": Adapters (only with `config.lora`), A = num_agents in
     "per_agent_lora" else 1, b = 0}.
  """
  num_agents = check_size("num_agents", num_agents)
  head_rng, lora_rng = jax.random.split(rng)
  num_heads = num_agents if config.mode == "per_agent_head" else 1
  sizes = (model_config.hidden_size,) + config.hidden + (1,)
  keys = jax.random.split(head_rng, len(sizes) - 1)
  head = []
  for i, (key, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:])):
    bound = (config.init_scale if i == len(sizes) - 2 else 1.0) / math.sqrt(fan_in)
    head.append(jax.random.uniform(key, (num_heads, fan_in, fan_out), jnp.float32, -bound,
                                   bound))
  params = {"head": head}
  if config.lora is not None:
    num_adapters = num_agents if config.mode == "per_agent_lora" else 1
    params["lora"] = init_adapters(config.lora, model_config, lora_rng, num_adapters)
  return params


def action_frame_ids(agent_ids: jax.Array) -> jax.Array:
  """Token-frame agent ids [B, T] (-1: no agent) -> the agent deciding at each position.

  out[b, t] = agent_ids[b, t+1], the agent that emits token t+1; out[b, T-1] = -1
  (`ppo.token_to_action_frame` on each row).
  """
  check_rank(2, agent_ids=agent_ids)
  return jax.vmap(lambda ids_t: token_to_action_frame(ids_t, -1))(jnp.asarray(agent_ids))


def critic_hidden_states(critic_params: CriticParams, base_params: Any, tokens: jax.Array,
                         model_config: ModelConfig, critic_config: CriticConfig, *,
                         mask: Optional[jax.Array] = None,
                         agent_ids: Optional[jax.Array] = None,
                         rng: Optional[jax.Array] = None) -> jax.Array:
  """The hidden states the head reads: the base (under `stop_gradient`) plus critic adapters.

  Args:
    critic_params: from `init_critic`; only its "lora" is read here.
    base_params: the model's parameter tree (in `model_config.layout`), never differentiated.
    tokens: [B, T] int. mask: [B, T] bool, False on padding (default all True).
    agent_ids: [B, T] token-frame agent ids (-1 on prompt, transition and padding tokens);
      needed in "per_agent_lora" only, where position t runs through the adapter of agent
      agent_ids[t+1] and positions with no next agent through the base.
    rng: LoRA dropout on the critic adapters (training); None: no dropout.
  Returns:
    h: [B, T, D] in the model's compute dtype.
  Raises:
    ValueError: "per_agent_lora" without agent_ids, or a concrete id outside [-1, A).
  """
  lora = critic_params.get("lora")
  adapter_ids = None
  if lora is not None:
    _check_num_adapters(lora, critic_config.mode)
    if rng is not None:
      lora = lora.with_dropout(rng)
    if critic_config.mode == "per_agent_lora":
      agent_ids = _checked_agent_ids(agent_ids, tokens.shape, lora.num_adapters)
      adapter_ids = action_frame_ids(agent_ids)
    else:  # One adapter for the whole history, per-sequence ids: the cheapest route.
      adapter_ids = jnp.zeros(tokens.shape[:1], jnp.int32)
  h, _ = hidden_states(jax.lax.stop_gradient(base_params), tokens, model_config, mask=mask,
                       lora=lora, adapter_ids=adapter_ids)
  return h


def values_from_hidden(head_params: list, h: jax.Array, action_agent_ids: Optional[jax.Array],
                       mode: str) -> jax.Array:
  """V[b, t] = W_k·relu(...relu(W_1·h[b, t])) in f32, with head n = action_agent_ids[b, t].

  Args:
    head_params: critic_params["head"], kernels [N, in, out].
    h: [B, T, D] hidden states, any float dtype (cast to f32 first).
    action_agent_ids: [B, T] action-frame agent ids (`action_frame_ids`), -1 where no agent
      decides; read in "per_agent_head" only, where ids outside [0, N) (-1, or a bad traced
      id) use head 0. May be None in the other modes.
    mode: `CriticConfig.mode` (static).
  Returns:
    [B, T] f32 values.
  Raises:
    ValueError: unknown mode, N ≠ 1 outside "per_agent_head", or (concrete) ids outside
      [-1, N) or missing in "per_agent_head".
  """
  check_rank(3, h=h)
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: choose one of {MODES}")
  num_heads = head_params[0].shape[0]
  x = h.astype(jnp.float32)
  if mode != "per_agent_head":
    if num_heads != 1:
      raise ValueError(f"head_params hold {num_heads} heads; mode={mode!r} has one")
    return _mlp([w[0] for w in head_params], x)
  ids = _checked_agent_ids(action_agent_ids, h.shape[:2], num_heads, name="action_agent_ids")
  v_n = jax.vmap(_mlp, in_axes=(0, None), out_axes=-1)(head_params, x)  # [B, T, N]
  head = jnp.where((ids >= 0) & (ids < num_heads), ids, 0)
  return jnp.take_along_axis(v_n, head[..., None], axis=-1)[..., 0]


def values(critic_params: CriticParams, base_params: Any, tokens: jax.Array,
           model_config: ModelConfig, critic_config: CriticConfig, *,
           mask: Optional[jax.Array] = None, agent_ids: Optional[jax.Array] = None,
           rng: Optional[jax.Array] = None,
           positions: Optional[jax.Array] = None) -> jax.Array:
  """V(tokens[b, :t+1]) at every position: [B, T] f32, in the action frame; or, given
  `positions` [B, K] (decisions, action frame), only there: [B, K].

  Args and routing as in `critic_hidden_states` and `values_from_hidden`; `agent_ids`
  ([B, T], token frame) is needed in the per-agent modes and ignored in "shared". Values at
  padding positions are computed but meaningless. `model_config` and `critic_config` are
  static under `jit`.
  """
  h = critic_hidden_states(critic_params, base_params, tokens, model_config, critic_config,
                           mask=mask, agent_ids=agent_ids, rng=rng)
  ids = None
  if critic_config.mode == "per_agent_head":
    num_heads = critic_params["head"][0].shape[0]
    ids = action_frame_ids(_checked_agent_ids(agent_ids, tokens.shape, num_heads))
  return values_from_hidden(critic_params["head"], at_decisions(h, positions),
                            at_decisions(ids, positions), critic_config.mode)


def at_decisions(x: Optional[jax.Array], positions: Optional[jax.Array]) -> Optional[jax.Array]:
  """x [B, T, ...] at positions [B, K]: [B, K, ...] (None: x unchanged).

  The head is a per-position MLP, so reading its input first is exact, and an action-level
  value loss (one value per turn) then runs it at K positions instead of T.
  """
  if x is None or positions is None:
    return x
  index = positions.reshape(positions.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=1)


def value_fns(critic_config: Optional[CriticConfig], model_config: ModelConfig):
  """(values, hidden) as the trainer uses them; (None, None) without a critic.

  values(critic, base_params, batch, extras, positions=None): [B, T] f32 values of a
    `TrainBatch` in the action frame, or [B, K] at `positions` [B, K].
  hidden(critic, base_params, batch, chunks=1): with a frozen base (no critic LoRA), the
    head's input [B, T, D], once per batch for `update.prepare` (`extras.critic_hidden`), in
    `chunks` blocks of rows (zeros on a block of padding rows alone); values then train the
    head alone. None with a critic LoRA: values run the base and its adapters.
  """
  if critic_config is None:
    return None, None
  if critic_config.lora is None:
    @functools.partial(jax.jit, static_argnames="chunks")
    def hidden(critic, base_params, batch, chunks=1):
      one = lambda b: critic_hidden_states(critic, base_params, b.tokens, model_config,
                                           critic_config, mask=b.mask)
      return over_row_chunks(one, batch, chunks)

    def values_of_hidden(critic, base_params, batch, extras, positions=None):
      del base_params
      return values_from_hidden(critic["head"], at_decisions(extras.critic_hidden, positions),
                                at_decisions(batch.act_agent, positions), critic_config.mode)
    return values_of_hidden, hidden

  def values_of_tokens(critic, base_params, batch, extras, positions=None):
    del extras
    token_agents = jnp.concatenate(
        [jnp.full_like(batch.act_agent[:, :1], -1), batch.act_agent[:, :-1]], axis=1)
    return values(critic, base_params, batch.tokens, model_config, critic_config,
                  mask=batch.mask, agent_ids=token_agents, positions=positions)
  return values_of_tokens, None


def batch_values_fn(values, chunks: int):
  """`values` (`value_fns`' first) over a whole padded batch, jitted, for the values at
  rollout time: `fn(critic, base_params, batch, extras)` -> [B, T], in `chunks` blocks of
  rows, zeros on a block of padding rows alone (`batching.over_row_chunks`)."""
  def batch_values(critic, base_params, batch, extras):
    block_values = lambda b, e: values(critic, base_params, b, e)
    return over_row_chunks(block_values, batch, chunks, extras)
  return jax.jit(batch_values)


def _mlp(kernels: list, x: jax.Array) -> jax.Array:
  """x [..., D] f32, kernels [D, F1], ..., [F_k, 1] -> [...]: relu between layers, no biases."""
  for w in kernels[:-1]:
    x = jax.nn.relu(jnp.einsum("...i,io->...o", x, w))
  return jnp.einsum("...i,io->...o", x, kernels[-1])[..., 0]


def _checked_agent_ids(agent_ids: Optional[jax.Array], shape: tuple, num_agents: int,
                       name: str = "agent_ids") -> jax.Array:
  """`agent_ids` as int32 of `shape` [B, T], ids in [-1, num_agents) when concrete."""
  if agent_ids is None:
    raise ValueError(f"{name}=None: the per-agent critic modes need [B, T] agent ids")
  agent_ids = jnp.asarray(agent_ids)
  if agent_ids.shape != tuple(shape):
    raise ValueError(f"{name} has shape {agent_ids.shape}; expected {tuple(shape)}")
  check_ids(name, agent_ids, num_agents, low=NO_ADAPTER)
  return agent_ids.astype(jnp.int32)


def _check_num_adapters(lora: Adapters, mode: str) -> None:
  if mode != "per_agent_lora" and lora.num_adapters != 1:
    raise ValueError(f"critic_params['lora'] holds {lora.num_adapters} adapters; "
                     f"mode={mode!r} has one")
