"""A 2-process job (4 virtual CPU devices each, Gloo collectives between the processes) trains
like one process on 8 devices, each process playing only its own half of the environments, and
its checkpoint restores in one process onto other meshes.

Reference: the same command in one process with 8 virtual devices, on the same 2 x 2 x 2 mesh.
Every process runs `multihost_worker.py` (launch.train recording the environments it built,
reset and stepped).
The sampled tokens are identical, and so are the first iteration's advantages (the whitening
gathers the whole batch's and runs the one-process code); the trained floats agree to ~1e-6
relative, not bitwise: Gloo sums a cross-process all-reduce in another order than XLA's
in-process CPU collectives. (The checkpoint is bit for bit that of the 2-process job in which
every process played every environment, ea9fba4^: splitting them costs no precision.)
All three processes compile at LLVM -O0 (half the compile time of the default, which
dominates here).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from marft_jax import envs, lora, sharding
from marft_jax.models.tiny import save_tiny_model
from marft_jax.rollout import read_transcripts
from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import config as config_lib
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from tests.compile_flags import FAST_COMPILE
from tests.train.echo_config import echo_config

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = config_lib.MeshSection(data=2, fsdp=2, tensor=2)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(workdir, model_dir, *flags):
  command = [sys.executable, "-m", "tests.train.multihost_worker",
             f"--config={os.path.join(REPO, 'tests', 'train', 'echo_config.py')}",
             f"--workdir={workdir}", f"--config.model.source={model_dir}",
             "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
             # What `layout.decoding()` picks on accelerators, and it compiles faster here.
             "--config.model.rollout_layout=training", *flags]
  env = dict(os.environ, JAX_PLATFORMS="cpu",  # --cpu_devices, not the session's 8 devices
             XLA_FLAGS=FAST_COMPILE,
             MARFT_ENV_RECORD=os.path.join(workdir, "env_record"))
  return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.startswith("time/") and not k.endswith("_s")}
          for row in rows]


def _env_records(workdir):
  """{process index: what it built, reset and stepped} (multihost_worker.py's files)."""
  folder = os.path.join(workdir, "env_record")
  records = {}
  for name in os.listdir(folder):
    with open(os.path.join(folder, name)) as f:
      record = json.load(f)
    records[record["process"]] = record
  return records


def _initial(config, model):
  """The state training starts from (the run's seed)."""
  return run_lib.new_state(config, model)


def _restored(config, model, workdir, mesh):
  """The latest checkpoint of `workdir`, restored onto `mesh` (the template's placement)."""
  template = _initial(config, model)
  template = jax.device_put(template, lora.follow_adapters(mesh, template))
  with checkpoint_lib.Checkpointer(workdir, read_only=True) as checkpointer:
    return checkpointer.restore(template)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(config, model, 2-process workdir, 1-process workdir)."""
  root = tmp_path_factory.mktemp("multihost")
  model_dir = save_tiny_model(root / "tiny", "qwen2")
  two, one = str(root / "two_processes"), str(root / "one_process")
  port = _free_port()
  start = time.perf_counter()
  workers = [_launch(two, model_dir, "--cpu_devices=4", f"--coordinator_address=localhost:{port}",
                     "--num_processes=2", f"--process_id={i}") for i in range(2)]
  workers.append(_launch(one, model_dir, "--cpu_devices=8"))
  try:
    outputs = [w.communicate(timeout=540)[0] for w in workers]  # a loaded host
  finally:
    for w in workers:
      if w.poll() is None:
        w.kill()
  for w, output in zip(workers, outputs):
    assert w.returncode == 0, output[-3000:]
  print("multihost test processes' wall time (s):", round(time.perf_counter() - start, 1))
  assert ["iterations=2" in output for output in outputs] == [True, False, True]  # process 0
  config = echo_config(model=config_lib.ModelSection(source=model_dir, rollout_layout="training"),
                       mesh=MESH)
  return config, model_lib.load(config), two, one


def test_each_process_plays_only_its_own_environments(runs):
  config, _, two, one = runs
  E, iterations = config.rollout.num_envs, config.iterations
  for records, processes in ((_env_records(two), 2), (_env_records(one), 1)):
    assert sorted(records) == list(range(processes))
    for p, record in records.items():
      own = list(range(p * E // processes, (p + 1) * E // processes))
      assert record["processes"] == processes
      assert record["built"] == own  # no other process's environment even exists here
      # One episode of one env step per environment and iteration (horizon 1), in env order.
      assert record["reset"] == own * iterations
      assert record["step"] == own * iterations
  with open(os.path.join(two, "checkpoints", "2", "meta", "metadata")) as a, \
      open(os.path.join(one, "checkpoints", "2", "meta", "metadata")) as b:
    got, expected = json.load(a), json.load(b)
  # The saved data cursor is the whole batch's (each process advanced only its own block).
  assert got["envs"] == expected["envs"] == {"seed": config.seed, "episodes": [2] * E,
                                              "num_tasks": None}  # generated tasks


# Sampler-vs-learner log-prob gaps: differences of f32 rounding (each about 1e-7); with π_old
# read from the rollout (loss.old_logp "auto" in f32) the first ratio's is one of them.
ROUNDING_GAPS = ("logp/sampler_learner_max_gap", "behaviour/logp_gap_max",
                 "behaviour/logp_gap_mean", "behaviour/first_ratio_max_dev",
                 "first_ratio_max_dev")


# The losses are means of signed O(1) terms (normalised advantages times ratios) that nearly
# cancel, so their rounding is absolute, not relative to the small total: measured at most
# 4.7e-7 (the policy loss of iteration 2, -0.0824, under this host's widest instruction set
# and AVX2: 5.7e-6 relative) and 2.8e-7 under SSE4_2 (of 0.0235: 1.2e-5 relative, past the
# 1e-5 the other metrics keep). The bound is four times the largest of them.
LOSS_ATOL = {"loss": 2e-6, "policy_loss": 2e-6}


def test_two_processes_train_like_one_process_on_eight_devices(runs):
  config, model, two, one = runs
  got, expected = _metrics(two), _metrics(one)  # rewards, losses, gradient norms, gaps
  assert [sorted(row) for row in got] == [sorted(row) for row in expected]
  for row, ref in zip(got, expected):
    for key in ref:
      if key in ROUNDING_GAPS:  # f32 rounding, so no ratio to compare: one process
        # encodes a shared prompt prefix once (sampler.generate), several do not
        assert row[key] < 1e-5 and ref[key] < 1e-5, (key, row[key], ref[key])
        continue
      # Measured, relative: at most 2.0e-6 (grad norms, approx_kl) under this host's widest
      # instruction set, AVX2 and SSE4_2, except the losses (`LOSS_ATOL`).
      np.testing.assert_allclose(row[key], ref[key], rtol=1e-5, atol=LOSS_ATOL.get(key, 1e-9),
                                 err_msg=key)
  for name in sorted(os.listdir(os.path.join(one, "transcripts"))):
    with open(os.path.join(one, "transcripts", name)) as a, \
        open(os.path.join(two, "transcripts", name)) as b:
      assert a.read() == b.read()  # the same tokens sampled
  expected = _restored(config, model, one, sharding.make_mesh(data=2, fsdp=2, tensor=2))
  got = _restored(config, model, two, sharding.make_mesh(data=2, fsdp=2, tensor=2))
  # Measured against how far the 2 iterations moved each leaf from where training started,
  # as norms: ‖two − one‖ / ‖one − start‖ was at most 1.8e-5 (the adapters; the moments and
  # the critic 1.3e-5) under this host's widest instruction set, AVX2 and SSE4_2. Not the
  # largest element: where a gradient is tiny, AdamW's step m / (√v + ε) turns the
  # all-reduce's rounding-level difference in m into a step of another size, and single
  # elements differed by up to 3.4e-4 of the largest move (5.1e-5 on another CPU) while the
  # leaf as a whole moved by 1e-5.
  starts = jax.tree.leaves(_initial(config, model))
  for (path, x), y, start in zip(jax.tree_util.tree_leaves_with_path(got),
                                 jax.tree.leaves(expected), starts):
    x, y, start = np.asarray(x), np.asarray(y), np.asarray(start)
    if x.dtype.kind != "f":
      np.testing.assert_array_equal(x, y)  # the step counter
      continue
    moved = np.linalg.norm((y - start).ravel())
    assert np.linalg.norm((x - y).ravel()) <= 2e-4 * moved, (jax.tree_util.keystr(path),
                                                             np.linalg.norm(x - y) / moved)
  assert os.listdir(os.path.join(two, "exports", "step_2"))  # written once, by process 0


@pytest.mark.parametrize("shape", [dict(fsdp=4, tensor=2), dict()], ids=["fsdp4_tensor2",
                                                                      "one_device"])
def test_the_two_process_checkpoint_restores_onto_another_mesh(runs, shape):
  config, model, two, _ = runs
  reference = _restored(config, model, two, sharding.make_mesh(data=2, fsdp=2, tensor=2))
  mesh = sharding.make_mesh(**shape)
  restored = _restored(config, model, two, mesh)
  layer = restored.policy.layers["q_proj"]["a"]  # [L, A, D_in, R]: D_in split over fsdp
  assert len(layer.sharding.device_set) == mesh.size
  assert layer.sharding.spec == (lora.adapter_shardings(mesh, restored.policy)
                                 .layers["q_proj"]["a"].spec)
  for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(reference)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_two_process_run_resumes_in_one_process(runs, tmp_path):
  """The saved data cursor is the whole batch's: one process continues with the tasks every
  environment would have played next, and steps all of them."""
  config, _, two, _ = runs
  resumed = str(tmp_path / "resumed")
  shutil.copytree(two, resumed, ignore=shutil.ignore_patterns("env_record"))
  worker = _launch(resumed, config.model.source, "--cpu_devices=8", "--config.iterations=3")
  output = worker.communicate(timeout=540)[0]
  assert worker.returncode == 0, output[-3000:]
  assert len(_metrics(resumed)) == 3
  E = config.rollout.num_envs
  batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["repeater"]), E, seed=config.seed,
                        group_size=config.rollout.group_size)
  seeds = [r["seed"] for r in read_transcripts(os.path.join(resumed, "transcripts"), 2)]
  assert seeds == [batch.episode_seed(i, 2) for i in range(E)]  # each env's third task
  (record,) = _env_records(resumed).values()
  assert record["built"] == list(range(E)) and record["step"] == list(range(E))
