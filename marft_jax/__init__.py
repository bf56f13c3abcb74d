"""marft_jax: Multi-Agent Reinforcement Fine-Tuning of LLM agent teams in JAX.

Subpackages, each importable on its own:
  architecture - what models, lora and sharding share: ModelConfig, Layout, the weight table.
  models  - Llama/Qwen2 decoder as a pure function of parameter pytrees, loaders, sampler.
  lora    - LoRA adapters as pytrees, stacked per agent and routed per token.
  ppo     - the RL maths: advantages, token-level backups, PPO/value/KL losses.
  envs    - host-side environments and agent graphs.
"""

__version__ = "0.1.0"
