"""`model_lib.Model`, the base a user may put together by hand for `train(model=...)`, refuses
params of another model or layout and a tokenizer with ids the embedding has no row for, when
it is made: the first rollout used to report these as adapters "of another model" or as
out-of-range token ids."""

import jax
import pytest

from marft_jax.models import layout, tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.train.build.model import Model
from marft_jax.train.build import model as model_lib


@pytest.fixture(scope="module")
def tokenizer():
  return tiny.tiny_tokenizer()


def _params(config):
  return jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))


def test_a_matching_base_is_accepted(tokenizer):
  config = tiny_config(vocab_size=len(tokenizer))
  Model(_params(config), config, tokenizer)
  fast = config.replace(layout=layout.DECODING)  # params and config in another layout agree
  Model(jax.eval_shape(lambda p: layout.convert_params(p, config.layout, fast.layout),
                       _params(config)), fast, tokenizer)


@pytest.mark.parametrize("made_for, message", [
    (dict(num_layers=3), r"Model: params hold 3 layers but config.num_layers=2"),
    (dict(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1),
     r"Model: params' embed is \(\d+, 32\) but the config's vocab_size x hidden_size is "
     r"\(\d+, 64\)"),
])
def test_params_of_another_model_are_refused_naming_the_difference(tokenizer, made_for,
                                                                   message):
  config = tiny_config(vocab_size=len(tokenizer))
  with pytest.raises(ValueError, match=message):
    Model(_params(config.replace(**made_for)), config, tokenizer)


def test_params_in_another_layout_are_refused(tokenizer):
  config = tiny_config(vocab_size=len(tokenizer))
  with pytest.raises(ValueError, match=r"Model: params hold stacked layers but config.layout"):
    Model(_params(config), config.replace(layout=layout.DECODING), tokenizer)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tokenizer):
  config = tiny_config(vocab_size=len(tokenizer) // 2)
  with pytest.raises(ValueError, match=rf"Model: the tokenizer has {len(tokenizer)} token ids "
                                       rf".* vocab_size is {len(tokenizer) // 2}"):
    Model(_params(config), config, tokenizer)
