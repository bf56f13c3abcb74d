"""`lora` and `sharding` sit on `marft_jax.architecture`, not on `models`: importing them loads
no `models` module (no models ⇄ lora or models ⇄ sharding import cycle), and the old
`marft_jax.models.config` / `.layout` / `.targets` paths name the same objects. The models
package's checkpoint loaders and tokenizers load on first use, under their usual names."""

import subprocess
import sys


def test_lora_and_sharding_import_no_models_module():
  code = ("import sys, marft_jax.lora, marft_jax.sharding, marft_jax.architecture; "
          "print(sorted(m for m in sys.modules if m.startswith('marft_jax.models')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]", out.stdout


def test_the_models_paths_re_export_the_architecture_modules():
  from marft_jax import architecture
  from marft_jax.models import config, layout, targets
  assert config.ModelConfig is architecture.config.ModelConfig
  assert layout.decoding is architecture.layout.decoding
  assert layout.DECODING_ACCELERATOR is architecture.DECODING_ACCELERATOR
  assert targets.LINEARS is architecture.targets.LINEARS


def test_the_models_package_loads_its_loaders_on_first_use():
  import importlib
  from marft_jax import models
  for name, module in models._LAZY.items():  # pylint: disable=protected-access
    assert getattr(models, name) is getattr(
        importlib.import_module(f"marft_jax.models.{module}"), name), name
  from marft_jax.models import load_model  # the `from` form goes through __getattr__ too
  assert load_model is importlib.import_module("marft_jax.models.loading").load_model
  try:
    models.no_such_name  # pylint: disable=pointless-statement
  except AttributeError as e:
    assert "no_such_name" in str(e)
  else:
    raise AssertionError("an unknown name must raise AttributeError")
