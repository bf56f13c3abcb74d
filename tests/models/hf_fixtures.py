"""Tiny random transformers models saved to disk: the reference for parity tests."""

import torch
import transformers

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)


def save_tiny_model(path, architecture: str, seed: int = 0, **overrides):
  """Saves a random tiny `architecture` ("llama"/"qwen2") model to `path`; returns it (eval)."""
  torch.manual_seed(seed)
  kwargs = dict(TINY, **overrides)
  if architecture == "llama":
    config = transformers.LlamaConfig(tie_word_embeddings=True, **kwargs)
    model = transformers.LlamaForCausalLM(config)
  else:
    config = transformers.Qwen2Config(tie_word_embeddings=False, **kwargs)
    model = transformers.Qwen2ForCausalLM(config)
  # Default init makes biases zero and norms one: randomise them so parity covers them.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.eval()
  model.save_pretrained(path)
  return model
