"""The mesh config: sizes and -1 resolved against the devices, errors naming the key before any
model loads, and activations that keep the batch split on a mesh."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from marft_jax import sharding
from marft_jax.models import config as config_lib
from marft_jax.models import transformer
from marft_jax.train.config import MeshSection
from tests.compile_flags import FAST_COMPILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("sizes,devices,expected", [
    ((-1, 1, 1), 8, (8, 1, 1)), ((-1, 2, 2), 8, (2, 2, 2)), ((1, -1, 4), 8, (1, 2, 4)),
    ((1, 1, 1), 8, (1, 1, 1)), ((2, 1, -1), 2, (2, 1, 1))])
def test_sizes_and_fill(sizes, devices, expected):
  assert sharding.mesh_shape(*sizes, num_devices=devices) == expected


@pytest.mark.parametrize("sizes,devices,message", [
    ((0, 1, 1), 8, "mesh.data=0: use a size >= 1, or -1"),
    ((1, -1, -1), 8, "mesh.fsdp and mesh.tensor are both -1"),
    ((-1, 3, 1), 8, "mesh.data=-1: the other axes multiply to 3"),
    ((4, 4, 1), 8, "needs 16 devices, 8 available"),
    ((1, True, 1), 8, "mesh.fsdp=True")])
def test_bad_sizes_name_the_key(sizes, devices, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    sharding.mesh_shape(*sizes, num_devices=devices)


def test_the_config_section_checks_sizes_without_devices():
  assert MeshSection(data=-1, fsdp=64) == MeshSection(-1, 64, 1)  # no devices needed yet
  with pytest.raises(ValueError, match="mesh.tensor=-2"):
    MeshSection(tensor=-2)


def test_launch_refuses_a_mesh_too_big_before_loading_the_model():
  """The model source does not exist: an error about it would mean it was read first."""
  out = subprocess.run([sys.executable, "-m", "launch.train", "--config.mesh.fsdp=16",
                        "--config.model.source=/nonexistent", "--cpu_devices=8",
                        "--workdir=/tmp/never_written"],
                       capture_output=True, text=True, cwd=REPO, timeout=120,
                       env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 2, out
  assert out.stderr.strip() == ("error: config.mesh.data=1 x mesh.fsdp=16 x mesh.tensor=1 "
                                "needs 16 devices, 8 available (set one axis to -1 to fill "
                                "them)"), out.stderr
  assert not os.path.exists("/tmp/never_written")


def _shapes(hlo: str, op: str) -> list[tuple[int, ...]]:
  found = re.findall(r"= \w+\[([\d,]*)\][^=]*? " + op + r"(?:-start)?\(", hlo)
  return [tuple(int(d) for d in s.split(",") if d) for s in found]


@pytest.mark.parametrize("pinned", [True, False])
def test_activations_keep_the_batch_split(pinned, monkeypatch):
  """On a 2 x 2 x 2 mesh, with the tokens replicated (as the sampler gets them from the host),
  each device runs its B / (data x fsdp) rows through every matmul and gathers weights (FSDP),
  never activations. The reference, without the pins: every device runs the whole batch."""
  if not pinned:
    monkeypatch.setattr(sharding, "constrain", lambda x, axes: x)
  config = config_lib.tiny_config("qwen2", vocab_size=128)
  params = transformer.init_params(config, jax.random.key(0))
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  B, T = 8, 16
  tokens = jax.device_put(np.zeros((B, T), np.int32), sharding.replicated(mesh))
  params = jax.device_put(params, sharding.param_shardings(mesh, params))
  forward = jax.jit(lambda p, t: transformer.forward(p, t, config)[0])
  with jax.set_mesh(mesh):
    hlo = forward.lower(params, tokens).compile().as_text()
  rows_per_matmul = {shape[0] for shape in _shapes(hlo, "dot") if len(shape) == 2}
  activation_gathers = [s for s in _shapes(hlo, "all-gather") if len(s) == 3 and s[1] == T]
  if pinned:
    assert rows_per_matmul == {B * T // 4}, rows_per_matmul
    assert not activation_gathers, activation_gathers
    assert _shapes(hlo, "all-gather")  # the weights are gathered
  else:
    assert B * T in rows_per_matmul, rows_per_matmul
