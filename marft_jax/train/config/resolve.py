"""`resolve(config)`: every "auto" of a `TrainConfig` decided in one place, and the checks that
need only the config (`preset(algorithm, ...)`: a resolved config for library use).

Config keys that an algorithm decides default to "auto" (or 0 / None) in `TrainConfig`:

  advantage.level, advantage.normalize, loss.policy_level, critic.mode,
  rollout.group_size, rollout.context_mode, team.num_roles

and one the model decides: loss.behaviour_correction ("auto": on for a bfloat16 model, whose
sampler and learner round differently; `update.resolve_behaviour_correction`; always on
with rollout.max_staleness >= 1, `_resolve_async_loss`). Top-p below 1
is refused for training (the learner does not apply the sampler's truncation).

`resolve(config)` fills each "auto" from the algorithm, and refuses, naming both keys, a value
set explicitly that contradicts it (a token-level loss under MARFT-A, a critic under GRPO,
rollout.group_size=1 under GRPO, team.num_roles=3 under single-agent PPO, ...), and a key set
where the run would not read it (`READ_ONLY_WHEN`: a critic's keys without a critic, the
token-level discounts at the action level, `loss.action_logprob` at the token level, ...).
GRPO's λ is 1 (Monte Carlo returns): another λ is refused, and the resolved config records 1.
The launch scripts resolve before any model loads; `train` resolves again (a no-op on a
resolved config); checkpoints and `config.json` in the run folder hold the resolved config,
the algorithm that actually ran. So a config file that names no algorithm-owned key runs as
any algorithm: `--config.algorithm=marft_t` on the default file trains MARFT-T.
"""

from __future__ import annotations

import dataclasses

from marft_jax.train import update
from marft_jax.train.advantages import AdvantageConfig
from marft_jax.train.config import profile_files
from marft_jax.train.config.algorithms import (DEFAULT_CONTEXT_MODE, DEFAULT_NUM_ROLES,
                                               Algorithm, get)
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.sections import MAIN_BACKBONE


def resolve(config: TrainConfig) -> TrainConfig:
  """`config` with every algorithm-owned "auto" key filled in from `config.algorithm`, and
  a profile file's roles as team.roles (`team.profiles`: `profile_files.expand`).

  Raises:
    ValueError: naming `algorithm` and the contradicting key, e.g. "loss.policy_level='token'
      contradicts algorithm='marft_a' (one ratio per turn: 'action')".
  """
  config = profile_files.expand(config)  # team.profiles: the file's roles, read once
  a = get(config.algorithm)

  def pick(key: str, value, auto, wanted, why: str):
    if value == auto or value is None:
      return wanted
    if value != wanted:
      raise ValueError(f"{key}={value!r} contradicts algorithm={a.name!r} ({why}: "
                       f"{wanted!r}); leave {key} unset to get the algorithm's")
    return value

  advantage = dataclasses.replace(
      config.advantage,
      level=pick("advantage.level", config.advantage.level, "auto", a.advantage_level,
                 "its advantages"),
      normalize=_normalize(a, config.advantage.normalize))
  advantage = _grpo_lambdas(a, advantage)
  loss = dataclasses.replace(config.loss, policy_level=pick(
      "loss.policy_level", config.loss.policy_level, "auto", a.policy_level,
      "its policy loss"))
  _check_sampling(config.team)
  loss = _resolve_async_loss(loss, config.rollout.max_staleness)
  _check_async_split(config)
  loss = update.resolve_behaviour_correction(loss, config.run_dtype)
  loss = update.resolve_old_logp(loss, config.run_dtype, config.model.matmul_precision)
  critic = _resolve_critic(a, config)
  rollout = _resolve_rollout(a, config, pick)
  team = dataclasses.replace(config.team, num_roles=_team_size(a, config.team, pick))
  resolved = dataclasses.replace(config, advantage=advantage, loss=loss, critic=critic,
                                 rollout=rollout, team=team)
  _check_init_from(resolved)
  _check_read(resolved)
  check_backbones(resolved)
  return resolved


def _has_critic(c) -> bool:
  return c.critic.mode != "none"


# Keys a run reads only in some configurations (of the resolved config): a value other than
# the default where the run would not read it is refused, naming the key, rather than
# recorded in config.json and the checkpoints as if it had been used.
# (key, whether the run reads it, what reads it)
READ_ONLY_WHEN = (
    *((key, _has_critic, "a critic (the algorithm has none, or critic.mode='none')")
      for key in ("critic.lr", "critic.hidden", "critic.lora_rank", "critic.warmup_iterations",
                  "loss.value_coef", "loss.value_clip", "loss.huber_delta",
                  "loss.critic_max_grad_norm")),
    *((key, lambda c: c.advantage.level == "token",
       "the token-level backup between the tokens of a reply (advantage.level='token')")
      for key in ("advantage.gamma_token", "advantage.lambda_token")),
    *((key, lambda c: c.team.num_roles > 1 or c.team.graph == "orchestrator",
       "two turns or more in an env step (two roles, or an orchestrator)")
      for key in ("advantage.gamma_agent", "advantage.lambda_agent", "advantage.credit")),
    ("critic.backbone", lambda c: c.critic.mode == "shared",
     "critic.mode='shared' (a per-agent critic lives on its role's backbone)"),
    ("loss.action_logprob", lambda c: c.loss.policy_level == "action",
     "one ratio per turn (loss.policy_level='action')"),
    ("advantage.credit_discount", lambda c: c.advantage.credit == "step_discount",
     "advantage.credit='step_discount'"),
    ("advantage.kl_reward_estimator", lambda c: c.advantage.kl_reward_coef > 0,
     "advantage.kl_reward_coef > 0"),
    ("loss.kl_estimator", lambda c: c.loss.kl_coef > 0, "loss.kl_coef > 0"),
    ("loss.kl_guard", lambda c: c.loss.kl_limit is not None, "a loss.kl_limit"),
    ("team.transition", lambda c: c.rollout.context_mode == "shared_stream",
     "rollout.context_mode='shared_stream' (its hand-overs)"),
    ("team.max_new_tokens", lambda c: c.team.num_roles > 1,
     "two roles or more (a team of one speaks with team.last_max_new_tokens)"),
    ("team.shared_adapter", lambda c: c.team.num_roles > 1 or c.team.graph == "orchestrator"
     or any(r.adapter == "base" for r in c.team.roles),
     "two roles or more, an orchestrator or a 'base' role (one role has one adapter)"),
    ("mesh.sampler_devices", lambda c: c.rollout.max_staleness > 0,
     "rollout.max_staleness >= 1 (a sampler running beside the learner)"),
    ("optimizer.agent_iteration_interval",
     lambda c: c.num_adapters > 1 and not c.team.shared_adapter,
     "two adapters or more (and no team.shared_adapter)"),
)


def _check_read(config: TrainConfig) -> None:
  """Refuses a key set where the run would not read it (`READ_ONLY_WHEN`)."""
  defaults = TrainConfig()
  for key, reads, reader in READ_ONLY_WHEN:
    value = _get(config, key)
    if value != _get(defaults, key) and not reads(config):
      raise ValueError(f"{key}={value!r} is read with {reader} only, not in this run "
                       f"(algorithm={config.algorithm!r}); leave {key} unset")
  mode = config.critic.mode
  if mode.startswith("per_agent") and config.team.num_roles == 1 and \
      config.team.graph != "orchestrator":
    raise ValueError(f"critic.mode={mode!r}: a team of one role is one agent, whose critic "
                     f"is the 'shared' one (algorithm={config.algorithm!r}); use 'shared'")


def _get(config, key: str):
  for part in key.split("."):
    config = getattr(config, part)
  return config


def _grpo_lambdas(a: Algorithm, advantage):
  """GRPO's λ is 1 (Monte Carlo returns, no critic to bootstrap from): a λ the user set to
  anything else is refused, and the resolved config records the λ = 1 that runs."""
  if a.advantage_level != "grpo":
    return advantage
  default = AdvantageConfig()
  for key in ("lambda_", "lambda_agent"):
    value = getattr(advantage, key)
    if value not in (getattr(default, key), 1.0):
      raise ValueError(f"advantage.{key}={value!r} contradicts algorithm={a.name!r} (its "
                       "returns are Monte Carlo, no critic to bootstrap from: λ = 1); leave "
                       f"advantage.{key} unset")
  return dataclasses.replace(advantage, lambda_=1.0, lambda_agent=None)


def _check_init_from(config) -> None:
  """One PEFT folder per policy adapter, refused here rather than after the model loads."""
  folders = config.init_from_folders
  if folders and len(folders) != config.num_adapters:
    raise ValueError(f"init_from={config.init_from!r}: {len(folders)} adapter folder(s) for "
                     f"the team's {config.num_adapters} adapters (one per adapter, "
                     "comma-separated, in adapter order)")


def _normalize(a: Algorithm, normalize: Optional[bool]) -> bool:
  """Whitening is a free choice (default the algorithm's), except on top of GRPO's own
  per-group normalisation."""
  if normalize is None:
    return a.normalize
  if normalize and a.advantage_level == "grpo":
    raise ValueError(f"advantage.normalize=True contradicts algorithm={a.name!r} (its "
                     "advantages are normalised per group already); leave it unset")
  return normalize


def _check_sampling(team) -> None:
  """Top-p below 1 anywhere in the team is refused, naming the key (`update.
  check_untruncated_sampling`: the learner does not apply the sampler's truncation); so is
  temperature 0: a greedy reply has no sampling distribution for the learner to score at its
  temperature (its log-probs would divide by 0). Evaluation is greedy whatever the config."""
  update.check_untruncated_sampling(team.top_p, 0, prefix="team.")
  keys = [("team.temperature", team.temperature)] + [
      (f"team.roles.{r.name}.temperature", r.temperature) for r in team.roles]
  for key, temperature in keys:
    if temperature == 0:
      raise ValueError(f"{key}=0: training scores each sampled token at its sampling "
                       "temperature, and greedy replies have none; use a temperature > 0 "
                       "(held-out evaluation decodes greedily anyway)")
  for role in team.roles:
    if role.top_p:
      update.check_untruncated_sampling(role.top_p, 0, prefix=f"team.roles.{role.name}.")


def _team_size(a: Algorithm, team, pick) -> int:
  """team.num_roles: the declared roles' count, else the algorithm's (or the default) size."""
  declared = len(team.role_order)
  if declared:
    if a.num_roles and declared != a.num_roles:
      raise ValueError(f"team.order={team.order!r} has {declared} roles: contradicts "
                       f"algorithm={a.name!r} (its team size: {a.num_roles})")
    return declared
  return pick("team.num_roles", team.num_roles, 0, a.num_roles or team.num_roles or
              DEFAULT_NUM_ROLES, "its team size")


def _resolve_critic(a: Algorithm, config: TrainConfig):
  c = config.critic
  if not a.critic:
    if c.mode not in ("auto", "none"):
      raise ValueError(f"critic.mode={c.mode!r} contradicts algorithm={a.name!r} (it has no "
                       "critic); leave critic.mode unset or set it to 'none'")
    return dataclasses.replace(c, mode="none")
  if c.mode == "none":
    raise ValueError(f"critic.mode='none' contradicts algorithm={a.name!r} (it needs a "
                     "critic: 'shared', 'per_agent_lora' or 'per_agent_head')")
  return dataclasses.replace(c, mode="shared" if c.mode == "auto" else c.mode)


def _resolve_rollout(a: Algorithm, config: TrainConfig, pick):
  r = config.rollout
  group_size = r.group_size or a.group_size
  if group_size < a.min_group_size:
    raise ValueError(f"rollout.group_size={group_size} contradicts algorithm={a.name!r} (it "
                     f"needs >= {a.min_group_size} rollouts of each task)")
  if r.num_envs % group_size:
    raise ValueError(f"rollout.num_envs={r.num_envs} is not a multiple of "
                     f"rollout.group_size={group_size}"
                     + ("" if r.group_size else f" (algorithm={a.name!r}'s default)"))
  context_mode = pick("rollout.context_mode", r.context_mode, "auto",
                      a.context_mode or (DEFAULT_CONTEXT_MODE if r.context_mode == "auto"
                                         else r.context_mode), "its context mode")
  return dataclasses.replace(r, group_size=group_size, context_mode=context_mode)


def _resolve_async_loss(loss, max_staleness: int):
  """`loss` (a `LossConfig`) with the behaviour correction on for η ≥ 1; refuses, naming the
  keys, a correction switched off or π_old read from the rollout (the samples come from an
  older policy than the learner's: π_old must be the learner's own, π_behav the sampler's)."""
  if not max_staleness:
    return loss
  if loss.behaviour_correction == "off":
    raise ValueError(f"loss.behaviour_correction='off' with rollout.max_staleness="
                     f"{max_staleness}: stale samples need the decoupled-PPO correction; leave "
                     "loss.behaviour_correction unset (or 'on'), or use max_staleness=0")
  if loss.old_logp == "rollout":
    raise ValueError(f"loss.old_logp='rollout' with rollout.max_staleness={max_staleness}: "
                     "the sampler's log-probs are an older policy's, not the learner's π_old; "
                     "leave loss.old_logp unset (or 'recompute')")
  return dataclasses.replace(loss, behaviour_correction="on")


def _check_async_split(config) -> None:
  """Refuses, naming the keys, an LLM judge beside a sampler on its own devices (the judge's
  weights stay on the learner's, and the sampler thread runs it), and asynchronous rollouts
  of a team on several backbones (its sampler thread would play every backbone's model)."""
  if config.rollout.max_staleness and len(config.used_backbones) > 1:
    raise ValueError(f"rollout.max_staleness={config.rollout.max_staleness} with team.roles on "
                     f"the backbones {list(config.used_backbones)}: a team on several backbones "
                     "trains synchronously; use rollout.max_staleness=0")
  if config.mesh.sampler_devices and config.reward.judge:
    raise ValueError(f"reward.judge=True with mesh.sampler_devices="
                     f"{config.mesh.sampler_devices}: the judge runs on the learner's mesh; "
                     "use mesh.sampler_devices=0 with a judge")


def check_backbones(config: TrainConfig) -> None:
  """Refuses, naming the key, what a team split over several backbones cannot run (of a
  resolved config; one backbone: nothing). Replies pass between backbones as text, so each
  turn is its own sequence (the per-agent view); an adapter, a critic and an orchestrator
  live on one backbone each."""
  used = config.used_backbones
  if len(used) == 1:
    return
  where = f"with the roles on backbones {used}"
  if config.rollout.context_mode != "per_agent":  # named first: the split is the file's choice
    raise ValueError(f"model.backbones={sorted(config.model.backbones)} {where}, but "
                     f"rollout.context_mode={config.rollout.context_mode!r} (algorithm="
                     f"{config.algorithm!r}): one token stream cannot hold two vocabularies; "
                     "use an algorithm of the per-agent view")
  if config.team.graph == "orchestrator":
    raise ValueError(f"team.graph='orchestrator' {where}: not supported (a chain or a DAG)")
  if config.team.shared_adapter:
    raise ValueError(f"team.shared_adapter=True {where}: an adapter fits one backbone")
  by_backbone = config.role_backbones
  shared = sorted({by_backbone[r.name] for r in config.team.roles if r.adapter == "shared"})
  if len(shared) > 1:
    raise ValueError(f"team.roles: adapter='shared' on roles of backbones {shared}: an "
                     "adapter fits one backbone (share it within one)")
  for name in used:
    roles = [r for r in config.team.roles if (r.backbone or MAIN_BACKBONE) == name]
    if all(r.adapter == "base" for r in roles):
      raise ValueError(f"team.roles {[r.name for r in roles]}: every role on backbone "
                       f"{name!r} has adapter='base': nothing on it would train")
  unsupported = (("init_from", config.init_from, ""),
                 ("reward.judge", config.reward.judge, False))
  for key, value, off in unsupported:
    if value != off:
      raise ValueError(f"{key}={value!r} {where}: not supported with several backbones yet")


def preset(algorithm: str, **changes) -> TrainConfig:
  """The resolved `TrainConfig` of `algorithm` with `changes` (library use and tests; config
  files build an unresolved `TrainConfig(algorithm=...)`, so that `--config.algorithm`
  still chooses)."""
  return resolve(TrainConfig(algorithm=algorithm, **changes))
