"""Every shipped launch config loads and converts to its typed dataclass."""

import glob
import importlib.util
import os

import pytest

from marft_jax.configs import from_config_dict

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "launch", "configs")
# config file name -> (module defining its top-level config dataclass, the dataclass)
TYPED = {"generate.py": ("launch.configs.generate", "GenerateConfig")}


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py")) if not p.endswith("__init__.py")))
def test_shipped_config_converts(path):
  name = os.path.basename(path)
  assert name in TYPED, f"{name}: add it to TYPED so that its conversion is tested"
  module_name, cls_name = TYPED[name]
  cls = getattr(importlib.import_module(module_name), cls_name)
  typed = from_config_dict(cls, _load(path))
  assert isinstance(typed, cls)


def test_generate_config_rejects_bad_values():
  from launch.configs.generate import GenerateConfig
  config = _load(os.path.join(CONFIG_DIR, "generate.py"))
  config.sampling.top_p = 1.5
  with pytest.raises(ValueError, match=r"config\.sampling: top_p=1\.5: must be in"):
    from_config_dict(GenerateConfig, config)


def test_generate_config_file_holds_the_dataclass_defaults():
  """One source of defaults: the file is `GenerateConfig()` as a ConfigDict."""
  from launch.configs.generate import GenerateConfig
  typed = from_config_dict(GenerateConfig, _load(os.path.join(CONFIG_DIR, "generate.py")))
  assert typed == GenerateConfig()
  assert typed.sampling.top_p == 0.95
