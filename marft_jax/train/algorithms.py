"""The training algorithms, each declared once: what `--config.algorithm=X` trains.

An `Algorithm` says which advantages the trainer computes (`advantage_level`: the arrays of
`ppo.turn_chain_advantages` at one position a turn or one a token, or GRPO's normalised
returns), which policy loss it optimises (one ratio per turn or per token), whether a critic
exists (and so where it is read: at each turn's first decision, or at every decision), what
the rollout must be (team size, context mode, rollouts per task) and its defaults.

Config keys that an algorithm decides default to "auto" (or 0 / None) in `TrainConfig`:

  advantage.level, advantage.normalize, loss.policy_level, critic.mode,
  rollout.group_size, rollout.context_mode, team.num_roles

and one the model decides: loss.behaviour_correction ("auto": on for a bfloat16 model, whose
sampler and learner round differently; `update.resolve_behaviour_correction`; always on
with rollout.max_staleness >= 1, `async_rollout.resolve_loss`). Top-p below 1
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

Adding an algorithm: one `Algorithm` entry below (and, if its advantages or loss are new, the
function behind them in `ppo` and the branch that calls it in `advantages.py` or
`update.py`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from marft_jax.train import async_rollout
from marft_jax.train import update
from marft_jax.train.advantages import AdvantageConfig

if TYPE_CHECKING:  # config.py imports this module for the algorithms' names
  from marft_jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One algorithm's choices (see the module docstring)."""

  name: str
  summary: str
  advantage_level: str  # "action", "token" or "grpo" (advantages.compute_advantages)
  policy_level: str  # "action": one PPO ratio per turn; "token": one per token
  critic: bool  # a learned critic; its values are read per turn (action) or per token
  normalize: bool = True  # whiten the advantages over the batch (the default; GRPO: never)
  num_roles: Optional[int] = None  # a fixed team size; None: any (default 2)
  context_mode: Optional[str] = None  # a required context mode; None: any (default per_agent)
  min_group_size: int = 1  # rollouts of each task
  group_size: int = 1  # the default

  @property
  def value_positions(self) -> Optional[str]:
    """Where the critic is read: "turn" (the state before each turn), "token", or None."""
    if not self.critic:
      return None
    return "turn" if self.advantage_level == "action" else "token"


ALGORITHMS = {a.name: a for a in (
    Algorithm("marft_a", "action-level PPO (one ratio per agent turn), action-level critic and "
              "the agent-chain GAE (MARFT §4.1)", advantage_level="action",
              policy_level="action", critic=True),
    Algorithm("marft_t", "token-level PPO with the token/agent/env-step Bellman backup and a "
              "token-level critic (MARFT §4.2)", advantage_level="token", policy_level="token",
              critic=True),
    Algorithm("ppo", "single-agent PPO: a team of one, action level (the baseline)",
              advantage_level="action", policy_level="action", critic=True, num_roles=1),
    Algorithm("grpo", "no critic: G rollouts of each task, returns normalised per task and "
              "agent, token-level clipped loss", advantage_level="grpo", policy_level="token",
              critic=False, normalize=False, min_group_size=2, group_size=4),
    Algorithm("shared_stream_ppo", "the AReaL form: one token stream per episode, token-level "
              "PPO with a centralised token-level critic", advantage_level="token",
              policy_level="token", critic=True, context_mode="shared_stream"),
)}
DEFAULT_NUM_ROLES = 2
DEFAULT_CONTEXT_MODE = "per_agent"


def get(name: str) -> Algorithm:
  if name not in ALGORITHMS:
    raise ValueError(f"algorithm={name!r}: use one of {tuple(ALGORITHMS)}")
  return ALGORITHMS[name]


def resolve(config: TrainConfig) -> TrainConfig:
  """`config` with every algorithm-owned "auto" key filled in from `config.algorithm`, and
  a profile file's roles as team.roles (`team.profiles`: `profile_files.expand`).

  Raises:
    ValueError: naming `algorithm` and the contradicting key, e.g. "loss.policy_level='token'
      contradicts algorithm='marft_a' (one ratio per turn: 'action')".
  """
  from marft_jax.train import profile_files  # it imports train.config, which imports this
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
  loss = async_rollout.resolve_loss(loss, config.rollout.max_staleness)
  async_rollout.check_split(config)
  loss = update.resolve_behaviour_correction(loss, config.run_dtype)
  loss = update.resolve_old_logp(loss, config.run_dtype, config.model.matmul_precision)
  critic = _resolve_critic(a, config)
  rollout = _resolve_rollout(a, config, pick)
  team = dataclasses.replace(config.team, num_roles=_team_size(a, config.team, pick))
  resolved = dataclasses.replace(config, advantage=advantage, loss=loss, critic=critic,
                                 rollout=rollout, team=team)
  _check_init_from(resolved)
  _check_read(resolved)
  from marft_jax.train.backbones import check_backbones  # it imports this module
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
  from marft_jax.train.config import TrainConfig  # config.py imports this module
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
