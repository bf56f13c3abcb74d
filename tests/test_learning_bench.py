"""bench/learning.py and its aggregator: mean ± 95 % interval from hand-computed inputs, the
results files, and every printed command parsing into the config its arm names."""

import json
import math
import os

import pytest
from absl import flags
from ml_collections import config_flags

from bench import learning, learning_results
from marft_jax.configs import from_config_dict
from marft_jax.train import algorithms
from marft_jax.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T_0975_DF2 = 4.302652729911275  # Student's t, 97.5 % quantile, 2 degrees of freedom


def test_ci95_by_hand():
  mean, half = learning_results.ci95([0.2, 0.3, 0.4])  # s = 0.1
  assert mean == pytest.approx(0.3)
  assert half == pytest.approx(T_0975_DF2 * 0.1 / math.sqrt(3))  # 0.24841
  assert learning_results.ci95([0.25]) == (0.25, None)
  mean, half = learning_results.ci95([0.5, 0.7])  # s = 0.1414, t(1) = 12.706
  assert half == pytest.approx(12.706204736 * math.sqrt(0.02) / math.sqrt(2))


def _cell(results, arm, seed, **fields):
  folder = os.path.join(results, arm, f"seed{seed}")
  os.makedirs(folder)
  with open(os.path.join(folder, "eval.json"), "w") as f:
    json.dump(dict(episodes=300, **fields), f)
  return folder


def test_aggregate_writes_the_table_json_and_curves(tmp_path):
  results, docs = str(tmp_path / "results"), str(tmp_path / "docs")
  os.makedirs(docs)
  for seed, (acc, fmt) in enumerate([(0.2, 0.5), (0.3, 0.7), (0.4, 0.9)]):
    folder = _cell(results, "marft_a_2agent", seed, accuracy=acc,
                   **{"answer_format_rate/actor": fmt, "reply_tokens/reasoner": 40.0 + seed,
                      "reply_tokens/actor": 8.0, "train_wall_s": 600.0 * (seed + 1)})
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
      f.write(json.dumps({"step": 0, "reward": 0.1 * seed}) + "\n")
    with open(os.path.join(folder, "heldout.jsonl"), "w") as f:
      f.write(json.dumps({"iteration": 32, "accuracy": acc}) + "\n")
  _cell(results, "untuned_2agent", 0, accuracy=0.25, driver_wall_s=120.0,
        **{"answer_format_rate/actor": 0.1, "reply_tokens/reasoner": 48.0,
           "reply_tokens/actor": 16.0})
  with open(os.path.join(docs, "results.md"), "w") as f:
    f.write(f"# title\n\nhand-written\n\n{learning_results.BEGIN}\nold\n"
            f"{learning_results.END}\n\nnotes kept\n")

  summary = learning_results.write_all(results, docs, "/runs")

  with open(os.path.join(docs, "results.json")) as f:
    written = json.load(f)
  assert set(written) == set(learning.ARMS)
  assert written["marft_a_2agent"]["mean"] == pytest.approx(0.3)
  assert written["marft_a_2agent"]["ci95"] == pytest.approx(0.2484138, abs=1e-6)
  assert written["marft_a_2agent"]["seeds"] == 3
  assert written["untuned_2agent"] == {"mean": 0.25, "ci95": None, "seeds": 1}
  assert written["grpo_2agent"] == {"mean": None, "ci95": None, "seeds": 0}
  a = summary["marft_a_2agent"]
  assert a["answer_format_rate"] == pytest.approx(0.7)
  assert a["reply_tokens"] == {"actor": 8.0, "reasoner": pytest.approx(41.0)}
  assert a["wall_s"] == pytest.approx(1200.0)
  md = open(os.path.join(docs, "results.md")).read()
  assert md.startswith("# title\n\nhand-written") and md.rstrip().endswith("notes kept")
  assert "old" not in md
  assert "| marft_a_2agent | 30.0 ± 24.8 | 3 | 70.0 | actor 8.0, reasoner 41.0 | 20.0 min |" in md
  assert "| untuned_2agent | 25.0 n/a (1 seed) | 1 | 10.0 |" in md
  assert "| grpo_2agent | pending | 0 |" in md
  assert os.path.getsize(os.path.join(docs, learning_results.CURVES_PNG)) > 1000
  curves = learning_results.curves(results)["marft_a_2agent"]
  assert curves["reward"] == [(0, pytest.approx(0.1))]  # mean of 0, 0.1, 0.2
  assert curves["heldout"] == [(0, 0.25), (32, pytest.approx(0.3))]  # untuned at iteration 0


def _parse(command):
  """The typed config a printed command gives, parsed and resolved as the launch scripts do."""
  words = command.split()
  assert words[0] == "python" and words[1] == "-m" and words[2] in ("launch.train", "launch.eval")
  values = flags.FlagValues()
  path = next(w for w in words if w.startswith("--config="))[len("--config="):]
  argv = ["prog", f"--config={os.path.join(ROOT, path)}"] + [
      w for w in words if w.startswith("--config.")]
  config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  others = [w for w in words[3:] if not w.startswith("--config")]
  # resolved as both launch scripts resolve it (the team's size, the algorithm's auto keys)
  return algorithms.resolve(from_config_dict(TrainConfig, values.config)), words[2], others


@pytest.mark.parametrize("arm", sorted(learning.ARMS))
def test_printed_commands_parse_into_the_arm(arm):
  spec = learning.ARMS[arm]
  commands = [learning.shell(c) for c in learning.cell_commands(arm, 2, "/runs")]
  assert len(commands) == (2 * len(learning.SWEEP["curve_points"]) + 2 if spec.trained else 1)
  for command in commands:
    config, module, others = _parse(command)
    algorithm = {"ppo.py": "ppo", "train.py": "marft_a", "marft_t.py": "marft_t",
                 "grpo.py": "grpo"}[spec.config]
    assert (config.algorithm, config.team.num_roles, config.seed) == (algorithm, spec.agents, 2)
    assert config.task.level == learning.SWEEP["level"]
    assert config.rollout.num_envs == learning.SWEEP["episodes"]
    assert f"--workdir=/runs/{arm}/seed2" in others
    assert ("--untuned" in others) == (not spec.trained)
    assert module == ("launch.eval" if not spec.trained or command == commands[-1] or
                      "--problems" in command else "launch.train")


def test_every_trained_arm_has_the_same_rollout_budget():
  budgets = set()
  for arm, spec in learning.ARMS.items():
    config, _, _ = _parse(learning.shell(learning.train_command(arm, 0, "/runs")))
    per_episode = ((config.team.num_roles - 1) * config.team.max_new_tokens +
                   config.team.last_max_new_tokens)
    budgets.add((config.iterations * config.rollout.num_envs, per_episode))
  s = learning.SWEEP
  assert budgets == {(s["iterations"] * s["episodes"], s["reasoner_tokens"] + s["actor_tokens"])}


def test_run_cell_resumes_where_its_files_say(tmp_path, monkeypatch):
  """Segments already on record are not rerun; a finished cell runs nothing."""
  runs, results = str(tmp_path / "runs"), str(tmp_path / "results")
  ran = []

  def fake_run(command, log_path):  # plays launch.train / launch.eval: files only
    ran.append(command)
    work = next(w for w in command if w.startswith("--workdir="))[len("--workdir="):]
    if command[2] == "launch.train":
      stop = int(next(w for w in command if w.startswith("--config.iterations="))
                 .split("=")[1])
      with open(os.path.join(work, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": stop - 1, "reward": 0.5, "time/iteration_s": 10.0}) + "\n")
      with open(os.path.join(work, "step"), "w") as f:
        f.write(str(stop))
    else:
      step = int(open(os.path.join(work, "step")).read())
      problems = int(next((w for w in command if w.startswith("--problems=")),
                          "=300").split("=")[1])
      with open(os.path.join(work, "eval.json"), "w") as f:
        json.dump({"accuracy": step / 100, "episodes": problems, "checkpoint_step": step}, f)

  monkeypatch.setattr(learning, "_run", fake_run)
  mid, end = learning.SWEEP["curve_points"][0], learning.SWEEP["iterations"]
  out = os.path.join(results, "marft_a_2agent", "seed0")
  os.makedirs(out)
  with open(os.path.join(out, "heldout.jsonl"), "w") as f:  # the mid-run point is on record
    f.write(json.dumps({"iteration": mid, "accuracy": 0.1, "problems": 64}) + "\n")
  os.makedirs(learning.workdir(runs, "marft_a_2agent", 0))
  learning.run_cell("marft_a_2agent", 0, runs, results)
  assert [(c[2], c[-1]) for c in ran] == [
      ("launch.train", "--workdir=" + learning.workdir(runs, "marft_a_2agent", 0)),
      ("launch.eval", "--workdir=" + learning.workdir(runs, "marft_a_2agent", 0))]
  result = json.load(open(os.path.join(out, "eval.json")))
  assert result["accuracy"] == end / 100 and result["train_wall_s"] == 10.0
  assert [r["iteration"] for r in learning.read_jsonl(os.path.join(out, "heldout.jsonl"))] \
      == [mid, end]
  ran.clear()
  learning.run_cell("marft_a_2agent", 0, runs, results)  # finished: nothing runs
  assert ran == []
