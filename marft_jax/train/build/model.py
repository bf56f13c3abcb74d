"""The frozen bases a run loads, and the copies of them it computes with: the sampler's (in
the decoding layout), the learner's (its remat and LoRA precision), the judge's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax

from marft_jax import lora as lora_lib
from marft_jax import sharding
from marft_jax.models import layout as layout_lib
from marft_jax.models import loading
from marft_jax.models.tokenizer import check_tokenizer_fits
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.sections import ModelSection


@dataclasses.dataclass
class Model:
  """The frozen base: params (in `config.layout`), config, tokenizer.

  Checked when made, for a base put together by hand (`train(model=...)`): params of another
  model or layout, or a tokenizer with ids the embedding has no row for, are a ValueError
  naming them here, not a message about adapters or token ids in the first rollout."""

  params: Any
  config: Any
  tokenizer: Any

  def __post_init__(self):
    try:
      layout_lib.check_params_layout(self.params, self.config.layout, self.config)
    except ValueError as e:
      raise ValueError(f"Model: {e}") from None
    check_tokenizer_fits(self.tokenizer, self.config.vocab_size, "Model")


def load(config: TrainConfig, backbone: Optional[str] = None) -> Model:
  """The base model of `backbone` (default: the roles' first, `used_backbones`; the main
  one: model.source, param_dtype)."""
  declared = config.model.backbone(backbone or config.used_backbones[0])
  params, model_config, tokenizer = loading.load_model(
      declared.source, param_dtype=declared.param_dtype, compute_dtype=declared.param_dtype)
  return Model(params, model_config, tokenizer)


def rollout_model(model: Model, config: TrainConfig, backbone: Optional[str] = None):
  """(params, model config) in `backbone`'s rollout_layout (default: the roles' first
  backbone's; model.rollout_layout for the main one): what the sampler runs (a copy of the
  weights in the decoding layout on CPU; made once per run), with model.lora_update_f32."""
  choice = config.model.backbone(backbone or config.used_backbones[0]).rollout_layout
  layout = {"auto": layout_lib.decoding(), "decoding": layout_lib.DECODING,
            "training": layout_lib.TRAINING}[choice]
  fast = model.config.replace(layout=layout, lora_update_f32=config.model.lora_update_f32)
  return layout_lib.convert_params(model.params, model.config.layout, layout), fast


def learner_model(model: Model, section: ModelSection) -> Model:
  """`model` with the model section's numerics: the learner's forward recomputes each layer
  in the backward pass (`Layout.remat`), and its LoRA update's precision
  (`lora_update_f32`, which the sampler's copy made from it keeps)."""
  layout = dataclasses.replace(model.config.layout, remat=section.remat)
  return dataclasses.replace(model, config=model.config.replace(
      layout=layout, lora_update_f32=section.lora_update_f32))


def place_model(model: Model, mesh) -> Model:
  """`model` with its weights split over `mesh` (`sharding.param_shardings`)."""
  return dataclasses.replace(model, params=jax.device_put(
      model.params, sharding.param_shardings(mesh, model.params)))


def build_judge(config: TrainConfig, model: Model, weights) -> Optional[rewards_lib.Judge]:
  """The LLM judge of `config.reward` (None when off): the policy's base in the rollout's
  layout (`weights`), or a second model's, with its adapter if one is given."""
  r = config.reward
  if not r.judge:
    return None
  params, model_config, tokenizer = *weights, model.tokenizer
  if r.judge_model:
    judge_model = Model(*loading.load_model(r.judge_model, param_dtype=config.model.param_dtype,
                                            compute_dtype=config.model.param_dtype))
    params, model_config = rollout_model(judge_model, config)
    tokenizer = judge_model.tokenizer
  adapter = None
  if r.judge_adapter:
    adapter = lora_lib.load_peft_adapters([r.judge_adapter], model_config)
  return rewards_lib.Judge(params, model_config, tokenizer, adapter, prompt=r.judge_prompt,
                           max_new_tokens=r.judge_max_new_tokens, weight=r.judge_weight,
                           parse=rewards_lib.parse_verdict)
