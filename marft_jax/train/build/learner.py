"""What learns: the optimizers, the state a run starts from (adapters, critic, their optimizer
states), and a backbone's `Learner` (its jitted update and critic functions).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from marft_jax import lora as lora_lib
from marft_jax import sharding
from marft_jax.train import critic as critic_lib
from marft_jax.train import optim
from marft_jax.train.build.model import Model
from marft_jax.train.build.preflight import check_init_from
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.update import TrainState, make_update


def critic_config(config: TrainConfig) -> Optional[critic_lib.CriticConfig]:
  """The critic the config asks for (None: the algorithm has none)."""
  return config.critic.critic_config() if config.uses_critic else None


def init_state(config: TrainConfig, model: Model, num_adapters: int, num_agents: int, key,
               policy_optimizer, critic_optimizer, with_critic: bool = True) -> TrainState:
  """A fresh `TrainState` on `model`: `num_adapters` adapters of `config.lora` (`init_from`'s
  folders if given), the config's critic for `num_agents` agents (none without one, or with
  `with_critic` False), their optimizer states; adapters from fold_in(key, 1), the critic
  from fold_in(key, 2)."""
  policy = lora_lib.init_adapters(config.lora, model.config, jax.random.fold_in(key, 1),
                                  num_adapters)
  if config.init_from_folders:  # as many as adapters (`config.resolve` checks)
    check_init_from(config)
    loaded = lora_lib.load_peft_adapters(config.init_from_folders, model.config)
    # The scale as the config computes it (the check allows JSON's rounding of alpha), so a
    # checkpoint restored into `config.lora`'s adapters is these, bit for bit.
    policy = loaded.replace(scale=policy.scale, dropout_rate=policy.dropout_rate)
  critic = None
  critic_settings = critic_config(config) if with_critic else None
  if critic_settings is not None:
    critic = critic_lib.init_critic(critic_settings, model.config, num_agents,
                                    jax.random.fold_in(key, 2))
  return TrainState(policy=policy, critic=critic, policy_opt=policy_optimizer.init(policy),
                    critic_opt=None if critic is None else critic_optimizer.init(critic),
                    step=jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class Learner:
  """One base's learner: its base (training layout), update and critic functions."""

  name: str  # its backbone
  model: Model
  update: Any  # `update.make_update`'s
  critic_hidden: Any  # `critic.value_fns`' hidden, or None
  old_values: Any  # `critic.batch_values_fn`, or None
  num_rows: int  # its batch's rows, rounded up so every minibatch splits over the shards
  pad_id: int


def make_learner(config: TrainConfig, name: str, model: Model, num_adapters: int, rows: int,
                 mesh, policy_optimizer, critic_optimizer, state_shardings,
                 with_critic: bool = True) -> Learner:
  """The `Learner` of `model` (backbone `name`) training `num_adapters` adapters over
  batches of `rows` rows (padding rows added, all masked, so every minibatch splits evenly
  over the batch shards); its update keeps `state_shardings` (`lora.follow_adapters`).
  `with_critic` False: its update trains the policy alone (a split team's shared critic
  trains on its own, `shared_critic`)."""
  values, hidden = critic_lib.value_fns(critic_config(config) if with_critic else None,
                                        model.config)
  minibatches = config.optimizer.minibatches
  one_device, num_rows = update_rows(rows, minibatches, mesh)
  update = make_update(model.config, config.loss, policy_optimizer, critic_optimizer, values,
                       num_adapters, config.optimizer.epochs, minibatches,
                       out_shardings=(state_shardings, sharding.replicated(mesh)),
                       logical_rows=one_device)
  return Learner(
      name=name, model=model, update=update, critic_hidden=hidden,
      old_values=None if values is None else critic_lib.batch_values_fn(
          values, minibatches),
      num_rows=num_rows, pad_id=pad_id(model.tokenizer))


def update_rows(rows: int, minibatches: int, mesh) -> tuple[int, int]:
  """(the update's rows on one device: `rows` rounded up to the minibatches; its rows on
  `mesh`: rounded up so that every minibatch splits over the batch shards). The extra rows
  are padding that only fills the minibatches (`update.minibatch_slots`)."""
  multiple = minibatches * sharding.batch_shards(mesh)
  return -(-rows // minibatches) * minibatches, -(-rows // multiple) * multiple


def pad_id(tokenizer) -> int:
  """The token id a batch pads with: the tokenizer's pad token, else its end of sequence."""
  pad = tokenizer.pad_token_id
  return tokenizer.eos_token_id if pad is None else pad


def optimizers(config: TrainConfig):
  """(the policy's optimizer, the critic's), with the learning-rate schedule of `config`."""
  o = config.optimizer
  steps_per_iteration = o.epochs * o.minibatches
  schedule = optim.learning_rate(o.lr, o.warmup_iterations * steps_per_iteration,
                                 config.iterations * steps_per_iteration, o.decay)
  policy = optax.adamw(schedule, eps=1e-5, weight_decay=o.weight_decay)
  critic = optax.adam(config.critic.lr, eps=1e-5)
  return policy, critic
