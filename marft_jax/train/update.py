"""One jitted PPO update: epochs × minibatches (`lax.scan`) over a `TrainBatch`.

Minibatches have a fixed size, B/minibatches rows, filled with the batch's real rows first
(`minibatch_slots`): a batch padded to the most rows its team can fill (an orchestrator's
call budget) trains in fewer steps an epoch, and a slot holding padding alone is skipped
(`lax.cond`: no forward, nothing moves).

Gradients are taken w.r.t. the policy adapters and the critic only (the base is an argument
that is never differentiated). Per minibatch:

  policy   PPO clip on the ratio π_θ / π_old, per agent turn (action level: the turn's
           log-prob summed, or averaged over its tokens) or per token; π_old is recomputed by
           this same forward before the first step, so the first ratio is 1, or, where the
           sampler's log-probs are the same numbers, read from the rollout
           (`LossConfig.old_logp`). Optional dual clip. With the behaviour correction on,
           decoupled PPO (below)
  value    clipped value loss (Huber with `huber_delta`, else squared) at the value positions
  entropy  bonus on the sampled positions' token entropy
  KL       optional penalty to the frozen base (the adapters switched off), estimator k1,
           k2 or k3 (`ppo.kl`)

Behaviour policy (`LossConfig.behaviour_correction`). The sampler records the log-prob of
each token it drew (`TrainBatch.act_behaviour_logp`); the learner's recomputed π_old can
differ from it (bf16 rounding in a differently compiled forward: up to 0.07 nats on a GPU).
With the correction on, the loss is AReaL's decoupled PPO (`ppo.decoupled_ppo_loss`) with
π_prox = the learner's π_old and π_behav = the sampler's:

    ρ = π_θ / π_prox (clipped, as plain PPO),   w = π_prox / π_behav (no gradient)
    L = (1/Σm) Σ m · 1[w ≤ cap] · w · ℓ(ρ, A)

so the advantage is weighted by π_θ / π_behav (the true ratio to the policy that sampled)
while the trust region stays centred on the learner's own π_old. At the action level a turn's
log-prob is the sum of its tokens' (or their mean), and so are π_prox's and π_behav's: the
turn weight is w_turn = Π_t w_t, the exact importance weight of the whole reply (a sequence's
probability is its tokens' product); with `action_logprob="mean"` it is the geometric mean
(Π_t w_t)^(1/n), length-normalised like the ratio it multiplies (not an unbiased weight, but
one on the ratio's scale). The cap drops (not clips) a turn or token whose weight exceeds it.

Top-p / top-k: the sampler records the log-prob under the truncated, renormalised distribution
(`models.sampler`); the learner scores the full softmax at the same temperature. Training
with truncation is refused (`check_untruncated_sampling`) rather than corrected: the learner
does not apply the truncation.

Untrained turns weigh nothing: a `base` role's (the frozen model speaks) and, under the
agent-by-agent schedule, those of the adapters not trained this iteration are left out of the
policy loss, the entropy and KL terms and every policy metric (`batching.trained_masks`); the
critic still learns their values, which their predecessors bootstrap from.

Each agent's gradient is clipped on its own; agents that are frozen (agent-by-agent
schedule, critic warm-up) or had no token in the minibatch keep their weights and optimizer
moments exactly (`optim.apply_masked`). A minibatch whose loss or gradients are not finite
changes nothing and is counted; one whose approximate KL to π_old exceeds `kl_limit` skips
its policy step ("skip") or every later policy step of the update ("stop"), counted too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from marft_jax import ppo
from marft_jax.architecture import precision
from marft_jax.lora.routing import Adapters
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig
from marft_jax.ppo.kl import KL_ESTIMATORS
from marft_jax.ppo.policy_loss import importance_weights
from marft_jax.train import optim
from marft_jax.train.batching import (TrainBatch, decision_adapters, over_row_chunks,
                                      trained_masks)
from marft_jax.validation import check_range

POLICY_LEVELS = ("action", "token")
BEHAVIOUR_CORRECTIONS = ("auto", "on", "off")
OLD_LOGPS = ("auto", "rollout", "recompute")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Loss weights and PPO settings (static under jit)."""

  # The policy ratio: "action" (one per turn) or "token" (one per token); "auto": the
  # algorithm's (config/resolve.py resolves it before the update is built)
  policy_level: str = "auto"
  # At the action level, a turn's log-prob: "sum" (the sequence's) or "mean" (per token,
  # which makes the ratio GSPO's length-normalised sequence ratio, Zheng et al. 2025)
  action_logprob: str = "sum"
  clip_eps: float = 0.2  # PPO's ε, >= 0: the ratio is clipped to [1 − ε, 1 + clip_eps_high]
  clip_eps_high: Optional[float] = None  # the upper clip (DAPO's clip-higher), >= 0; None: clip_eps
  value_coef: float = 1.0  # the value loss's weight, >= 0
  # ε_v >= 0: the value loss also scores the new value clipped to the old one ± ε_v and takes
  # the larger (AReaL's critic loss); None: the plain loss
  value_clip: Optional[float] = 0.2
  huber_delta: Optional[float] = 10.0  # the value loss's Huber δ, > 0; None: squared error
  entropy_coef: float = 0.0  # the entropy bonus's weight, >= 0 (0: reported, not trained)
  # c > 1: a negative-advantage element's loss is at most c·|A| (Ye et al. 2020); None: off
  dual_clip: Optional[float] = None
  kl_coef: float = 0.0  # the weight of a KL penalty to the frozen base model, >= 0
  kl_estimator: str = "k3"  # that penalty's estimator: "k1", "k2" or "k3" (`ppo.kl`)
  # The sampler's log-probs as the behaviour policy (decoupled PPO, train/update.py): "on",
  # "off", or "auto" = on wherever sampler and learner can differ (a bfloat16 model; always
  # with rollout.max_staleness >= 1)
  behaviour_correction: str = "auto"
  # With the correction on: drop a token (a turn, at the action level) whose weight
  # π_prox/π_behav exceeds this cap, >= 1 (AReaL's behav_imp_weight_cap in every MARFT
  # config); None: keep all
  imp_weight_cap: Optional[float] = 5.0
  # π_old, the ratio's denominator: "recompute" (a learner forward over the batch before the
  # first step, `prepare`), "rollout" (the sampler's recorded log-probs: one forward fewer an
  # iteration), or "auto" = "rollout" where the two are the same numbers to rounding (float32
  # weights, exact f32 matmuls, no behaviour correction), else "recompute"
  old_logp: str = "auto"
  # An approximate KL(π_old ‖ π) above which a policy step is not taken, > 0; None: no limit
  kl_limit: Optional[float] = None
  # Past kl_limit: "skip" this minibatch's policy step, or "stop" every later one of the update
  kl_guard: str = "skip"
  max_grad_norm: float = 1.0  # the policy gradient's clip norm, per agent, > 0
  critic_max_grad_norm: float = 1.0  # the critic gradient's clip norm, > 0

  def __post_init__(self):
    if self.policy_level not in ("auto",) + POLICY_LEVELS:
      raise ValueError(f"policy_level={self.policy_level!r}: use one of {POLICY_LEVELS}")
    if self.action_logprob not in ("sum", "mean"):
      raise ValueError(f"action_logprob={self.action_logprob!r}: use 'sum' or 'mean'")
    if self.kl_guard not in ("skip", "stop"):
      raise ValueError(f"kl_guard={self.kl_guard!r}: use 'skip' or 'stop'")
    if self.kl_estimator not in KL_ESTIMATORS:
      raise ValueError(f"kl_estimator={self.kl_estimator!r}: use one of "
                       f"{tuple(KL_ESTIMATORS)}")
    if self.behaviour_correction not in BEHAVIOUR_CORRECTIONS:
      raise ValueError(f"behaviour_correction={self.behaviour_correction!r}: use one of "
                       f"{BEHAVIOUR_CORRECTIONS}")
    if self.old_logp not in OLD_LOGPS:
      raise ValueError(f"old_logp={self.old_logp!r}: use one of {OLD_LOGPS}")
    check_range("dual_clip", self.dual_clip, 1.0, low_open=True)
    # A token's weight is about 1 wherever sampler and learner agree: a cap below 1 would
    # drop nearly every token.
    check_range("imp_weight_cap", self.imp_weight_cap, 1.0)
    check_range("value_clip", self.value_clip, 0.0)  # the ppo losses' own bounds, checked
    check_range("huber_delta", self.huber_delta, 0.0, low_open=True)  # before any rollout
    # KL(π_old ‖ π) ≥ 0: a limit ≤ 0 would stop every policy step after the first.
    check_range("kl_limit", self.kl_limit, 0.0, low_open=True)
    for key in ("clip_eps", "value_coef", "entropy_coef", "kl_coef"):
      if not getattr(self, key) >= 0:
        raise ValueError(f"{key}={getattr(self, key)!r}: must be >= 0")
    for key in ("max_grad_norm", "critic_max_grad_norm"):
      if not getattr(self, key) > 0:
        raise ValueError(f"{key}={getattr(self, key)!r}: must be > 0")


def check_untruncated_sampling(top_p: float, top_k: int, prefix: str = "team.") -> None:
  """Refuses top-p < 1 or top-k > 0 for a trained policy, naming the key.

  The sampler records each token's log-prob under the truncated, renormalised distribution;
  the learner's log-probs are of the full softmax (at the same temperature), so the ratio
  and the policy being optimised would not be the sampler's (the original MARFT's defect D9).
  Call it where the training config is resolved.
  """
  if top_p is not None and top_p < 1:
    raise ValueError(f"{prefix}top_p={top_p!r}: training needs 1.0 (the learner scores the "
                     "full softmax; the sampler's nucleus log-probs would not match it)")
  if top_k:
    raise ValueError(f"{prefix}top_k={top_k!r}: training needs 0 (the learner scores the "
                     "full softmax; the sampler's top-k log-probs would not match it)")


def resolve_behaviour_correction(config: LossConfig, param_dtype: str, top_p: float = 1.0,
                                 top_k: int = 0) -> LossConfig:
  """`config` with `behaviour_correction` "auto" decided: "on" for a bfloat16 model (the
  sampler's and the learner's differently compiled forwards round differently), else "off".
  "on" and "off" are kept. Refuses top-p/top-k first (`check_untruncated_sampling`), so
  truncation never reaches "auto". Pure; the trainer calls it when it resolves its config.
  """
  check_untruncated_sampling(top_p, top_k)
  if config.behaviour_correction != "auto":
    return config
  on = jnp.dtype(param_dtype) == jnp.bfloat16
  return dataclasses.replace(config, behaviour_correction="on" if on else "off")


def resolve_old_logp(config: LossConfig, param_dtype: str, matmul_precision: str
                     ) -> LossConfig:
  """`config` with `old_logp` "auto" decided, after `resolve_behaviour_correction`.

  "rollout" where the sampler's recorded log-probs are the learner's π_old to rounding: a
  float32 model whose matmuls resolve to exact f32 ("highest", `architecture.precision`;
  measured on CPU: 5e-6 nats at most on the tiny test model, about 1e-4 on SmolLM2-135M, the
  decoding layout's fused kernels rounding apart from the training layout's), and the
  behaviour correction off. With the correction on, π_prox (the learner's π_old) and π_behav
  (the sampler's) are distinct by design: taking π_old from the rollout would make every
  weight π_prox/π_behav exactly 1, the correction a no-op; so "auto" recomputes there, and an
  explicit "rollout" beside it is refused. Else "recompute" (bfloat16, TF32, bf16 passes: the
  two forwards round apart by up to 0.07 nats). Pure; `config.resolve` calls it.
  """
  if config.behaviour_correction == "auto":
    raise ValueError("resolve behaviour_correction first (resolve_behaviour_correction)")
  correcting = config.behaviour_correction == "on"
  if config.old_logp == "rollout" and correcting:
    raise ValueError("loss.old_logp='rollout' with loss.behaviour_correction='on': the "
                     "correction weighs π_old (the learner's) against the sampler's "
                     "log-probs, and π_old taken from the rollout makes every weight 1; use "
                     "old_logp='recompute' (or 'auto'), or turn the correction off")
  if config.old_logp != "auto":
    return config
  exact = (jnp.dtype(param_dtype) == jnp.float32
           and precision.resolve(matmul_precision, param_dtype) == "highest")
  return dataclasses.replace(config,
                             old_logp="rollout" if exact and not correcting else "recompute")


@struct.dataclass
class TrainState:
  """Everything the update changes (and a checkpoint holds, with the loop's counters)."""

  policy: Adapters  # [L, A, ...] stacked per-agent (or one shared) adapters, f32
  critic: Any  # critic parameters, or None without a critic
  policy_opt: Any
  critic_opt: Any
  step: jax.Array  # [] int32: optimizer steps taken


@struct.dataclass
class Extras:
  """Per-decision arrays computed once per batch, before the first step (no gradient)."""

  old_logp: jax.Array  # [B, T] π_old at each decision
  ref_logp: jax.Array  # [B, T] the base model's (zeros when kl_coef is 0)
  critic_hidden: Any  # [B, T, D] frozen-base hidden states for the critic head, or None


def token_logp_and_entropy(params, policy, batch: TrainBatch, model_config: ModelConfig,
                           with_entropy: bool) -> tuple[jax.Array, jax.Array]:
  """[B, T] log-prob of token t+1 at decision t under the sampling temperature, and the
  entropy of that distribution (zeros unless `with_entropy`), at the trained decisions
  (`batch.act_positions`; 0 elsewhere): `ppo.logprobs_and_entropy` of the logits gathered
  there. `policy=None`: the base."""
  h, _ = transformer.hidden_states(params, batch.tokens, model_config, mask=batch.mask,
                                   lora=policy,
                                   adapter_ids=None if policy is None else batch.adapter_ids)
  B, T = batch.tokens.shape
  valid = batch.act_positions >= 0  # [B, P]
  at = jnp.where(valid, batch.act_positions, 0)
  pick = lambda x: jnp.take_along_axis(x, at, axis=1)
  h = jnp.take_along_axis(h, at[..., None], axis=1)  # [B, P, D]
  logits = transformer.logits_from_hidden(params, h, model_config)
  next_tokens = jnp.concatenate([batch.tokens[:, 1:], batch.tokens[:, -1:]], axis=1)
  logp, entropy = ppo.logprobs_and_entropy(logits, pick(next_tokens),
                                           pick(batch.act_temperature), with_entropy)
  rows, cols = jnp.arange(B)[:, None], jnp.where(valid, at, T)  # T: dropped
  scatter = lambda x: jnp.zeros((B, T), x.dtype).at[rows, cols].set(x, mode="drop")
  return scatter(logp), scatter(entropy)


def _per_turn(x: jax.Array, batch: TrainBatch, mean: bool) -> jax.Array:
  """[B, T] per-decision values -> [B, K]: each turn's `ppo.action_log_prob` (the sum over
  its tokens) or `ppo.action_log_prob_per_token` (their mean)."""
  K = batch.turn_valid.shape[1]
  in_turn = batch.act_mask[:, None, :] & (batch.act_turn[:, None, :] ==
                                          jnp.arange(K)[None, :, None])  # [B, K, T]
  reduce = ppo.action_log_prob_per_token if mean else ppo.action_log_prob
  return jax.vmap(jax.vmap(reduce, in_axes=(None, 0)))(x, in_turn)


def _at_policy_level(x: jax.Array, batch: TrainBatch, config: LossConfig) -> jax.Array:
  """[B, T] per-decision log-probs -> the elements that carry a ratio: [B, K] per turn (their
  sum, or mean) at the action level, [B, T] unchanged at the token level."""
  if config.policy_level == "action":
    return _per_turn(x, batch, config.action_logprob == "mean")
  return x


def _policy_mask(trained: tuple, config: LossConfig) -> jax.Array:
  """The elements that carry a ratio and train: `trained`'s turns or decisions."""
  return trained[1] if config.policy_level == "action" else trained[0]


def _max_dev(log_ratio: jax.Array, mask: jax.Array) -> jax.Array:
  """max over the valid elements of |exp(log_ratio) − 1| (no gradient)."""
  log_ratio = jax.lax.stop_gradient(jnp.where(mask, log_ratio, 0.0))
  return jnp.max(jnp.abs(jnp.expm1(log_ratio)))


def behaviour_metrics(batch: TrainBatch, old_logp: jax.Array, config: LossConfig,
                      trained: Optional[tuple] = None) -> dict:
  """How far the sampler's log-probs are from the learner's π_old, over the whole batch.

  logp_gap_max / _mean: |π_old − π_behav| in log space over every sampled token (a `base`
  role's too: the same forward scores it); weight_mean / _max / _dropped: the weights
  w = π_old/π_behav at the policy level (per turn at the action level) over the elements
  that train (`trained`, `batching.trained_masks`; None: every adapter's), and the fraction
  above `imp_weight_cap` (reported whether or not the correction is on)."""
  m = batch.act_mask
  gap = jnp.where(m, jnp.abs(old_logp - batch.act_behaviour_logp), 0.0)
  valid = _policy_mask(trained_masks(batch) if trained is None else trained, config)
  weight, keep = importance_weights(
      _at_policy_level(old_logp, batch, config),
      _at_policy_level(batch.act_behaviour_logp, batch, config), valid, config.imp_weight_cap)
  return {"behaviour/logp_gap_max": jnp.max(gap),
          "behaviour/logp_gap_mean": ppo.masked_mean(gap, m),
          "behaviour/weight_mean": ppo.masked_mean(weight, valid),
          "behaviour/weight_max": jnp.max(jnp.where(valid, weight, 0.0)),
          "behaviour/weight_dropped": ppo.masked_mean((valid & ~keep).astype(jnp.float32),
                                                      valid)}


def value_objective(values, old_values, returns, mask, config: LossConfig):
  """The critic's clipped value loss (Huber with `config.huber_delta`, else squared) of
  `values` against `returns` where `mask` (every argument [B, T] or [B, K])."""
  if config.huber_delta is None:
    return ppo.clipped_value_loss(values, old_values, returns, mask, config.value_clip)
  return ppo.clipped_huber_value_loss(values, old_values, returns, mask, config.huber_delta,
                                      config.value_clip)


# The diagnostics `losses` returns, in its order.
LOSS_METRICS = ("policy_loss", "value_loss", "approx_kl", "clip_fraction", "entropy",
                "kl_to_base", "first_ratio_max_dev", "behaviour/first_ratio_max_dev")


def losses(policy, critic, params, batch: TrainBatch, extras: Extras, *,
           model_config: ModelConfig, config: LossConfig, critic_values: Optional[Callable],
           dropout_key: Optional[jax.Array] = None, trained: Optional[tuple] = None
           ) -> tuple[jax.Array, dict]:
  """The minibatch loss (to minimise) and its diagnostics. `dropout_key`: LoRA dropout on
  the learner's forward (`policy.dropout_rate`; π_old and the sampler run without it).
  `trained`: ([B, T], [B, K]) bool, the decisions and turns whose adapter trains
  (`batching.trained_masks`; None: every adapter's). The policy loss, the entropy bonus, the
  KL penalty and their diagnostics cover these alone; the value loss covers every turn."""
  if dropout_key is not None and policy.dropout_rate > 0:
    policy = policy.with_dropout(dropout_key)
  logp, entropy = token_logp_and_entropy(params, policy, batch, model_config, with_entropy=True)
  if config.entropy_coef == 0:  # reported, not trained: no gradient through it
    entropy = jax.lax.stop_gradient(entropy)
  trained = trained_masks(batch) if trained is None else trained
  m = trained[0]
  new, old = _at_policy_level(logp, batch, config), _at_policy_level(extras.old_logp, batch,
                                                                     config)
  valid = _policy_mask(trained, config)
  adv = batch.turn_advantage if config.policy_level == "action" else batch.act_advantage
  behav = _at_policy_level(batch.act_behaviour_logp, batch, config)
  if _correcting(config):
    policy_loss = ppo.decoupled_ppo_loss(new, old, behav, adv, valid, config.clip_eps,
                                         config.clip_eps_high, config.dual_clip,
                                         config.imp_weight_cap)
  else:
    policy_loss = ppo.ppo_clip_loss(new, old, adv, valid, config.clip_eps,
                                    config.clip_eps_high, config.dual_clip)
  approx_kl = ppo.approx_kl(new, old, valid)
  clipped = ppo.clip_fraction(new, old, valid, config.clip_eps, config.clip_eps_high)
  total = policy_loss - config.entropy_coef * ppo.masked_mean(entropy, m)
  kl_base = jnp.zeros(())
  if config.kl_coef > 0:
    kl_base = ppo.kl_penalty(logp, extras.ref_logp, m, KL_ESTIMATORS[config.kl_estimator])
  total = total + config.kl_coef * kl_base
  value_loss = jnp.zeros(())
  if critic_values is not None:
    if config.policy_level == "action":  # one value per turn: the head runs at K positions
      turn_values = critic_values(critic, params, batch, extras, batch.turn_value_pos)
      value_loss = value_objective(turn_values, batch.turn_old_value, batch.turn_return,
                                   batch.turn_valid, config)
    else:
      values = critic_values(critic, params, batch, extras)  # [B, T] per decision
      value_loss = value_objective(values, batch.act_old_value, batch.act_return,
                                   batch.act_mask, config)
    total = total + config.value_coef * value_loss
  aux = {"policy_loss": policy_loss, "value_loss": value_loss, "approx_kl": approx_kl,
         "clip_fraction": clipped, "entropy": ppo.masked_mean(entropy, m),
         "kl_to_base": kl_base,
         # before the first step: the clipped ratio's distance from 1 (π_prox is this
         # forward's own), and the sampler's (what an uncorrected loss takes to be 1)
         "first_ratio_max_dev": _max_dev(new - old, valid),
         "behaviour/first_ratio_max_dev": _max_dev(new - behav, valid)}
  assert tuple(aux) == LOSS_METRICS, tuple(aux)  # a skipped step reports them by name
  return total, aux


def _step_metrics(aux: dict, loss, finite, too_far, norms, critic_norm) -> dict:
  """One minibatch step's metrics, [] f32 each: `losses`' diagnostics (`LOSS_METRICS`), the
  loss, whether the step was skipped as not finite or too far (kl_limit), the gradients'
  norms (policy: all agents', and `norms` [A] each agent's) and the critic's."""
  metrics = dict(aux, loss=loss, nonfinite=(~finite).astype(jnp.float32),
                 kl_skipped=(too_far & finite).astype(jnp.float32),
                 policy_grad_norm=jnp.sqrt(jnp.sum(norms ** 2)), critic_grad_norm=critic_norm)
  for a in range(norms.shape[0]):
    metrics[f"adapter{a}/grad_norm"] = norms[a]
  return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def _correcting(config: LossConfig) -> bool:
  if config.behaviour_correction == "auto":
    raise ValueError("behaviour_correction='auto' must be resolved first "
                     "(resolve_behaviour_correction)")
  return config.behaviour_correction == "on"


def all_finite(tree) -> jax.Array:
  """[] bool: every element of every leaf of `tree` is finite."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def critic_step(critic_optimizer, grads, critic, critic_opt, max_norm: float,
                apply: jax.Array):
  """One step of the critic: `grads` clipped to global norm `max_norm`, then
  `critic_optimizer`'s update, kept only where `apply` ([] bool: the minibatch was trained
  and its loss and gradients were finite). Returns (critic, critic_opt, the gradients' norm
  before clipping)."""
  norm = optax.tree.norm(grads)
  scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-12))
  updates, new_opt = critic_optimizer.update(jax.tree.map(lambda g: g * scale, grads),
                                             critic_opt, critic)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
  return keep(optax.apply_updates(critic, updates), critic), keep(new_opt, critic_opt), norm


def make_update(model_config: ModelConfig, config: LossConfig, policy_optimizer,
                critic_optimizer, critic_values: Optional[Callable], num_adapters: int,
                epochs: int, minibatches: int, out_shardings: Any = None,
                logical_rows: Optional[int] = None):
  """The jitted update `update(state, params, batch, extras, active, train_policy, rng)`.

  `critic_values(critic, params, batch, extras, positions=None)`: the critic's [B, T] values,
  or [B, K] at the decisions `positions` [B, K] (`critic.value_fns` makes it); None: no critic.
  `out_shardings`: (state's shardings, metrics' sharding) to keep the state where it was
  placed on a mesh (`lora.follow_adapters`); None lets the compiler choose.
  `logical_rows`: the rows the batch has on one device (the team's, rounded up to the
  minibatches); a mesh pads B beyond it to split every minibatch over its shards, and those
  rows only pad the minibatches `minibatch_slots` draws over `logical_rows` (None: B).

  Args (of the returned function):
    state: TrainState. params: the frozen base. batch: B rows (B divisible by minibatches;
      rows without a real token are padding).
    extras: `prepare(...)`'s output. active: [A] bool, adapters the schedule lets train
      (the others' turns weigh nothing in the policy loss and metrics).
    train_policy: [] bool, False during critic-only warm-up. rng: shuffles the minibatches
    (and draws the LoRA dropout masks when `state.policy.dropout_rate` > 0).
  Returns:
    (new state, metrics averaged over the trained minibatches (`minibatches_trained` of
    them, `minibatch_slots`); `nonfinite` and `kl_skipped` count the minibatches whose
    step was skipped; `first_ratio_max_dev` and
    `behaviour/first_ratio_max_dev` are the first minibatch's, before any step; the other
    `behaviour/` metrics are the whole batch's, `behaviour_metrics`).

  `config.behaviour_correction` "auto" is resolved here from the model's dtypes
  (`resolve_behaviour_correction`); the trainer resolves it earlier, with its sampling
  settings, so its saved config says what ran.
  """
  config = _resolved_for_model(model_config, config)
  grad_fn = jax.value_and_grad(
      functools.partial(losses, model_config=model_config, config=config,
                        critic_values=critic_values), argnums=(0, 1), has_aux=True)

  def update(state, params, batch, extras, active, train_policy, rng):
    # --- masks: a `base` role's and a frozen adapter's turns weigh nothing ---
    trained = trained_masks(batch, active)
    # --- the scan body, bound to this batch ---
    gradients = functools.partial(_minibatch_gradients, grad_fn, params,
                                  (batch, extras, trained), num_adapters)
    step = functools.partial(
        _minibatch_step, gradients=gradients,
        no_gradients=functools.partial(_no_gradients, num_adapters),
        optimizers=(policy_optimizer, critic_optimizer), config=config, active=active,
        train_policy=train_policy)
    # --- the minibatch slots: each epoch's, real rows first ---
    indices, taken = minibatch_slots(rng, jnp.any(batch.mask, axis=1), epochs, minibatches,
                                     logical_rows)
    dropout_keys = jax.random.split(jax.random.fold_in(rng, 1), epochs * minibatches)
    # --- epochs × minibatches ---
    (state, _), metrics = jax.lax.scan(step, (state, jnp.zeros((), bool)),
                                       (indices, dropout_keys, taken))
    # --- metrics ---
    return state, _update_metrics(metrics, taken, batch, extras, config, trained)

  return jax.jit(update, out_shardings=out_shardings)


def _resolved_for_model(model_config: ModelConfig, config: LossConfig) -> LossConfig:
  """`config` with `behaviour_correction` "auto" decided from the model's dtypes (on when
  its params or compute are bfloat16, `resolve_behaviour_correction`); refuses a
  `policy_level` the algorithm has not resolved."""
  bf16 = jnp.bfloat16 in (jnp.dtype(model_config.param_dtype),
                          jnp.dtype(model_config.compute_dtype))
  config = resolve_behaviour_correction(config, "bfloat16" if bf16 else "float32")
  if config.policy_level not in POLICY_LEVELS:
    raise ValueError(f"loss.policy_level={config.policy_level!r}: resolve the config's "
                     "algorithm first (marft_jax.train.config.resolve)")
  return config


def _minibatch_gradients(grad_fn, params, data: tuple, num_adapters: int, policy, critic,
                         indices: jax.Array, dropout_key: jax.Array):
  """A minibatch with real rows: ([] f32 loss, `losses`' diagnostics ([] f32 each), the
  policy's and the critic's gradients (their parameters' trees), [A] bool: which adapters
  have tokens in it).

  `grad_fn`: `losses`' value and gradients w.r.t. (policy, critic). `data`: the whole batch's
  (TrainBatch, Extras, `trained_masks`), B rows; `indices` [B/M]: the minibatch's rows."""
  mb, ex, tr = jax.tree.map(lambda x: x[indices], data)
  (loss, aux), (g_policy, g_critic) = grad_fn(policy, critic, params, mb, ex,
                                              dropout_key=dropout_key, trained=tr)
  aux = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
  return (jnp.asarray(loss, jnp.float32), aux, g_policy, g_critic,
          _adapters_present(mb, num_adapters))


def _no_gradients(num_adapters: int, policy, critic, indices: jax.Array,
                  dropout_key: jax.Array):
  """A slot of padding rows, `_minibatch_gradients`' outputs without a forward: a [] zero
  loss, zero gradients, [A] no adapter present (its diagnostics by name, not by tracing
  `losses` again: 0.6 s a trace of the update)."""
  del indices, dropout_key
  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  return (jnp.zeros((), jnp.float32), dict.fromkeys(LOSS_METRICS, jnp.zeros(())),
          zeros(policy), zeros(critic), jnp.zeros((num_adapters,), bool))


def _minibatch_step(carry: tuple, xs: tuple, *, gradients: Callable, no_gradients: Callable,
                    optimizers: tuple, config: LossConfig, active: jax.Array,
                    train_policy: jax.Array):
  """One minibatch slot, the update's `lax.scan` body: carry (TrainState, [] bool: a
  `kl_guard` "stop" has fired), xs ([B/M] row indices, a dropout key, [] bool: the slot holds
  real rows) -> (carry, `_step_metrics`).

  `gradients` / `no_gradients`: `_minibatch_gradients` / `_no_gradients` bound to the batch.
  `optimizers`: (policy's, critic's). `active` [A] bool, `train_policy` [] bool: the
  update's. A slot of padding alone moves nothing (neither the weights nor the moments), but
  the policy optimizer's step count advances as in a taken step, so its learning-rate
  schedule follows the iterations."""
  policy_optimizer, critic_optimizer = optimizers
  state, stopped = carry
  indices, dropout_key, taken = xs
  loss, aux, g_policy, g_critic, present = jax.lax.cond(
      taken, gradients, no_gradients, state.policy, state.critic, indices, dropout_key)
  finite = jnp.isfinite(loss) & all_finite(g_policy.layers)
  if g_critic is not None:
    finite = finite & all_finite(g_critic)
  too_far = jnp.asarray(False if config.kl_limit is None else
                        aux["approx_kl"] > config.kl_limit)
  g_policy, norms = optim.clip_per_agent(g_policy, config.max_grad_norm)
  move = active & present & train_policy & finite & ~too_far & ~stopped
  policy, policy_opt = optim.apply_masked(policy_optimizer, g_policy, state.policy_opt,
                                          state.policy, move)
  critic, critic_opt, critic_norm = state.critic, state.critic_opt, jnp.zeros(())
  if g_critic is not None:
    critic, critic_opt, critic_norm = critic_step(
        critic_optimizer, g_critic, state.critic, state.critic_opt,
        config.critic_max_grad_norm, finite & taken)
  stopped = stopped | (too_far & (config.kl_guard == "stop"))
  new_state = state.replace(policy=policy, critic=critic, policy_opt=policy_opt,
                            critic_opt=critic_opt, step=state.step + 1)
  return (new_state, stopped), _step_metrics(aux, loss, finite, too_far, norms, critic_norm)


def _update_metrics(metrics: dict, taken: jax.Array, batch: TrainBatch, extras: Extras,
                    config: LossConfig, trained: tuple) -> dict:
  """The update's metrics, [] each, from the slots' [E·M] `_step_metrics` and `taken`
  [E·M] bool (the trained slots): averaged over the trained slots; the first ratio's
  deviations slot 0's (before any step); `nonfinite` and `kl_skipped` summed;
  `minibatches_trained`; and the whole batch's `behaviour_metrics`."""
  steps = jnp.sum(taken)
  out = {k: jnp.sum(v) / jnp.maximum(steps, 1) for k, v in metrics.items()}
  for key in ("first_ratio_max_dev", "behaviour/first_ratio_max_dev"):
    out[key] = metrics[key][0]  # slot 0 holds real rows whenever any row is real
  out.update(behaviour_metrics(batch, extras.old_logp, config, trained))
  out["nonfinite"] = jnp.sum(metrics["nonfinite"])
  out["kl_skipped"] = jnp.sum(metrics["kl_skipped"])
  out["minibatches_trained"] = steps.astype(jnp.float32)
  return out


def minibatch_slots(rng: jax.Array, real_rows: jax.Array, epochs: int, minibatches: int,
                    logical_rows: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
  """Each epoch's minibatches: ([epochs·minibatches, B/minibatches] row indices, [E·M] bool:
  the slot holds at least one real row and is trained; the others are skipped).

  `real_rows` [B] bool marks the rows with a real token. Each epoch shuffles the rows, then
  moves the padding rows behind the real ones (a stable sort, so both stay shuffled): the
  minibatch size is fixed at B/M rows, as in PPO's usual fixed-size minibatches, and a batch
  of R real rows takes ceil(R·M/B) steps an epoch. B is the most rows the team can fill
  (an orchestrator's call budget); spread at random, the padding rows cost a full forward
  and backward in every minibatch, and a minibatch of one real row took a step as large as
  one of many. A full batch (R = B) keeps the plain shuffle.

  The mesh must not change which rows train together: the shuffle and the minibatches are
  drawn over L = `logical_rows` slots (the batch on one device; None: B), the i-th real row
  in the batch's order standing in slot i and padding in slots R..L-1, exactly as on one
  device, wherever the rows lie (several processes' blocks each end in their padding). A
  mesh pads the batch to B > L rows so that each minibatch splits over its shards: the
  B − L extra padding rows fill each minibatch from L/M to B/M rows, and change nothing but
  the rounding.
  """
  B = real_rows.shape[0]
  L = B if logical_rows is None else logical_rows
  if B % minibatches or L % minibatches or L > B:
    raise ValueError(f"{B} rows ({L} on one device) do not split into {minibatches} "
                     "minibatches")

  def order(key, real):
    shuffled = jax.random.permutation(key, L)
    return shuffled[jnp.argsort(~real[shuffled], stable=True)]

  # Slot -> row: the real rows in the batch's order, then its padding rows (the identity for
  # one device's batch, real rows first; several processes' blocks each end in padding).
  row_of_slot = jnp.argsort(~real_rows, stable=True)
  real_slots = jnp.arange(L) < jnp.sum(real_rows)
  slots = jax.vmap(order, (0, None))(jax.random.split(rng, epochs), real_slots)
  slots = slots.reshape(epochs * minibatches, -1)
  extra = (B - L) // minibatches  # each minibatch's own padding slots among L..B-1
  fill = L + jnp.arange(minibatches * extra).reshape(minibatches, extra)
  slots = jnp.concatenate([slots, jnp.tile(fill, (epochs, 1))], axis=1)
  indices = row_of_slot[slots]
  return indices, jnp.any(real_rows[indices], axis=1)


def _adapters_present(batch: TrainBatch, num_adapters: int) -> jax.Array:
  """[A] bool: adapters that sampled at least one of the minibatch's trained tokens."""
  act_adapter = decision_adapters(batch)
  ids = jnp.where(act_adapter >= 0, act_adapter, num_adapters)
  counts = jnp.zeros((num_adapters + 1,), jnp.int32).at[ids.reshape(-1)].add(1)
  return counts[:num_adapters] > 0


@functools.partial(jax.jit, static_argnames=("model_config", "with_old", "with_ref",
                                             "minibatches"))
def _old_and_ref_logp(params, policy, batch, model_config, with_old, with_ref, minibatches):
  """([B, T] π_old: the learner's forward, or with `with_old` False the sampler's recorded
  log-probs at the trained decisions; [B, T] the base's, or zeros without `with_ref`)."""
  logp = lambda pol: lambda b: token_logp_and_entropy(params, pol, b, model_config, False)[0]
  old = over_row_chunks(logp(policy), batch, minibatches) if with_old else jnp.where(
      batch.act_mask, batch.act_behaviour_logp, 0.0)  # 0 elsewhere, as the forward's
  ref = over_row_chunks(logp(None), batch, minibatches) if with_ref else jnp.zeros_like(old)
  return old, ref


def prepare(params, policy, batch: TrainBatch, model_config: ModelConfig, config: LossConfig,
            critic_hidden_fn: Optional[Callable] = None, minibatches: int = 1,
            with_ref: bool = False) -> Extras:
  """π_old, the base's log-probs (if a KL penalty is on, or `with_ref`: KL-in-reward) and
  the frozen critic's hidden states (if its base is not adapted), computed once per batch
  without gradients, minibatch by minibatch with the update's own shapes (so the first ratio
  is 1), skipping blocks of padding rows (`batching.over_row_chunks`). With
  `config.old_logp` "rollout", π_old is the batch's `act_behaviour_logp` and no policy
  forward runs (the first ratio is then 1 to the sampler's rounding); "auto" left unresolved
  here recomputes, as before the key existed (`resolve_old_logp` decides it for the trainer).
  `critic_hidden_fn(params, batch, chunks=...)`: `critic.value_fns`' hidden, its critic bound."""
  old, ref = _old_and_ref_logp(params, policy, batch, model_config,
                               config.old_logp != "rollout", config.kl_coef > 0 or with_ref,
                               minibatches)
  hidden = None if critic_hidden_fn is None else critic_hidden_fn(params, batch,
                                                                   chunks=minibatches)
  return Extras(old_logp=old, ref_logp=ref, critic_hidden=hidden)
