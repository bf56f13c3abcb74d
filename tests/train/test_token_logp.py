"""The learner's per-decision log-probs and entropies against NumPy on the model's logits."""

import jax
import numpy as np

from marft_jax.models import config as config_lib
from marft_jax.models import transformer
from marft_jax.train.batching import TrainBatch, act_positions, padding_fields
from marft_jax.train.update import token_logp_and_entropy


def test_logp_and_entropy_at_the_trained_decisions_equal_numpy():
  config = config_lib.tiny_config("llama")
  params = transformer.init_params(config, jax.random.key(0), std=0.3)  # peaked distributions
  rng = np.random.default_rng(1)
  B, T = 3, 10
  fields = padding_fields(B, T, 1, 0, pad_id=0)
  fields["tokens"] = rng.integers(1, config.vocab_size, (B, T)).astype(np.int32)
  fields["mask"][:] = np.arange(T) < np.array([10, 7, 4])[:, None]
  fields["act_mask"][:] = fields["mask"] & (np.arange(T) >= 2)
  fields["act_mask"][:, -1] = False  # the last real token emits nothing
  fields["act_mask"][1, 6] = fields["act_mask"][2, 3] = False
  fields["act_temperature"][:] = rng.uniform(0.5, 1.5, (B, T)).astype(np.float32)
  fields["act_positions"] = act_positions(fields["act_mask"])
  batch = TrainBatch(**fields)
  logp, entropy = token_logp_and_entropy(params, None, batch, config, with_entropy=True)

  logits, _ = transformer.forward(params, fields["tokens"], config, mask=fields["mask"])
  z = np.asarray(logits, np.float64) / fields["act_temperature"][..., None]
  log_softmax = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - z.max(-1, keepdims=True)
  for b, t in zip(*np.nonzero(fields["act_mask"])):
    np.testing.assert_allclose(logp[b, t], log_softmax[b, t, fields["tokens"][b, t + 1]],
                               atol=2e-5)
    p = np.exp(log_softmax[b, t])
    np.testing.assert_allclose(entropy[b, t], -(p * log_softmax[b, t]).sum(), atol=2e-5)
  untrained = ~fields["act_mask"]
  assert np.all(np.asarray(logp)[untrained] == 0) and np.all(np.asarray(entropy)[untrained] == 0)
