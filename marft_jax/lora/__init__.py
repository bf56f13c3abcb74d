"""marft_jax.lora: LoRA adapters as pytrees, stacked per agent and routed per token.

  config     LoraConfig (rank, alpha, targets, dropout, rsLoRA).
  routing    Adapters, select_adapter, per-sequence / per-token routing inside the forward,
             NO_ADAPTER.
  adapters   init_adapters, stack_adapters.
  merge      merge_adapter / unmerge_adapter into the base kernels.
  training   gradients w.r.t. adapters only; per-agent selection of updates.
  peft_io    Hugging Face PEFT folders (save / load, one per agent).
  sharding   adapter_shardings: factors split like their base kernels; follow_adapters:
             a train or optimizer state placed like the adapters it holds.
"""

from marft_jax.lora.routing import (NO_ADAPTER, Adapters, adapter_ids_for_agents,
                                    broadcast_adapter_ids, canonical_adapter_ids,
                                    routed_lora_delta, select_adapter)
from marft_jax.lora.config import ALL_LINEAR, LoraConfig
from marft_jax.lora.adapters import init_adapters, stack_adapters
from marft_jax.lora.merge import adapter_kernel_deltas, merge_adapter, unmerge_adapter
from marft_jax.lora.training import trainable_value_and_grad, where_adapters
from marft_jax.lora.peft_io import (check_peft_folder, load_peft_adapter, load_peft_adapters,
                                    peft_key, peft_tensors, read_peft_lora_config,
                                    save_peft_adapter, save_peft_adapters)
from marft_jax.lora.sharding import adapter_logical_axes, adapter_shardings, follow_adapters
