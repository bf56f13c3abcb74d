"""ConfigDict -> dataclass conversion names the bad key."""

import dataclasses
from typing import Optional

import ml_collections
import pytest

from marft_jax.configs import from_config_dict, to_config_dict


@dataclasses.dataclass(frozen=True)
class Inner:
  clip_eps: float = 0.2
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not 0 < self.clip_eps < 1:
      raise ValueError(f"clip_eps={self.clip_eps} must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class Outer:
  name: str = "x"
  steps: int = 1
  seed: Optional[int] = None
  ppo: Inner = Inner()


def _config(**ppo):
  return ml_collections.ConfigDict(dict(name="run", steps=3, seed=None, ppo=dict(ppo)))


def test_nested_conversion_and_int_to_float():
  out = from_config_dict(Outer, _config(clip_eps=0.5, stop_ids=[1, 2]))
  assert out == Outer(name="run", steps=3, seed=None, ppo=Inner(clip_eps=0.5, stop_ids=(1, 2)))
  assert from_config_dict(Outer, dict(seed=7)) == Outer(seed=7)
  with pytest.raises(ValueError, match=r"config\.ppo: clip_eps=1\.0"):  # int 1 became 1.0
    from_config_dict(Outer, _config(clip_eps=1))


@pytest.mark.parametrize("ppo,message", [
    (dict(clip_epss=0.1), r"config\.ppo: unknown key\(s\) config\.ppo\.clip_epss"),
    (dict(clip_eps="big"), r"config\.ppo\.clip_eps: expected float, got 'big'"),
    (dict(clip_eps=3.0), r"config\.ppo: clip_eps=3\.0 must be in \(0, 1\)"),
])
def test_errors_name_the_key(ppo, message):
  with pytest.raises(ValueError, match=message):
    from_config_dict(Outer, _config(**ppo))


def test_bool_is_not_an_int():
  with pytest.raises(ValueError, match=r"config\.steps: expected int, got True"):
    from_config_dict(Outer, dict(steps=True))


@dataclasses.dataclass(frozen=True)
class Required:
  rank: int  # no default: required
  steps: int = 1


def test_missing_required_key_is_named():
  with pytest.raises(ValueError, match=r"config: missing required key\(s\) config\.rank"):
    from_config_dict(Required, dict(steps=2))
  assert from_config_dict(Required, dict(rank=4)) == Required(rank=4)


def test_union_fields_take_either_type():
  """`LoraConfig.targets: Union[str, tuple[str, ...]]`, the documented tuple form included."""
  from marft_jax.lora import LoraConfig
  assert from_config_dict(LoraConfig, dict(targets=("q_proj", "v_proj"))).targets == (
      "q_proj", "v_proj")
  assert from_config_dict(LoraConfig, dict(targets=["q_proj"])).targets == ("q_proj",)
  assert from_config_dict(LoraConfig, dict(targets="q_proj|v_proj")).targets == "q_proj|v_proj"
  with pytest.raises(ValueError, match=r"config\.targets: 3 matches none of"):
    from_config_dict(LoraConfig, dict(targets=3))
  with pytest.raises(ValueError, match=r"config\.targets\[1\]: expected str, got 2"):
    from_config_dict(LoraConfig, dict(targets=("q_proj", 2)))
  with pytest.raises(ValueError, match=r"config: targets=\('x_proj',\): unknown"):
    from_config_dict(LoraConfig, dict(targets=("x_proj",)))


def test_to_config_dict_round_trips_and_types_none_defaults():
  config = to_config_dict(Outer())
  assert from_config_dict(Outer, config) == Outer()
  config.seed = 3  # an int placeholder: typed, so a command-line override parses as int
  assert from_config_dict(Outer, config).seed == 3
  with pytest.raises(TypeError):
    config.seed = "three"
