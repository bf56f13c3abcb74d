"""The sampler's host-side progress hook reports every decode step, in order."""

import jax
import numpy as np

from marft_jax.models import config as config_lib
from marft_jax.models import sampler, transformer


def test_on_step_reports_each_decode_step():
  config = config_lib.tiny_config()
  params = transformer.init_params(config, jax.random.key(0))
  seen = []
  out = sampler.generate(params, np.ones((2, 5), np.int32), config, rng=jax.random.key(1),
                         max_new_tokens=[7, 4], temperature=1.0, on_step=seen.append)
  jax.block_until_ready(out.tokens)
  steps = [int(s) for s in seen]
  # One report per loop iteration: steps 1..7 sample, the last one only writes the cache.
  assert steps == list(range(1, 8)), steps
  np.testing.assert_array_equal(out.lengths, [7, 4])
