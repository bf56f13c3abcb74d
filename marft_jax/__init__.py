"""marft_jax: Multi-Agent Reinforcement Fine-Tuning of LLM agent teams in JAX.

Subpackages, each importable on its own:
  architecture - what models, lora and sharding share: ModelConfig, Layout, the weight table.
  models  - Llama/Qwen2 decoder as a pure function of parameter pytrees, loaders, sampler.
  lora    - LoRA adapters as pytrees, stacked per agent and routed per token.
  ppo     - the RL maths: advantages, token-level backups, PPO/value/KL losses.
  envs    - host-side environments and agent graphs.
"""

__version__ = "0.1.0"


def __getattr__(name):
  """`marft_jax.restore` and `marft_jax.Restored` (train/restore.py), imported on first use:
  `import marft_jax` alone loads no JAX."""
  if name in ("restore", "Restored"):
    from marft_jax.train import restore as restore_module
    return getattr(restore_module, name)
  raise AttributeError(f"module 'marft_jax' has no attribute {name!r}")
