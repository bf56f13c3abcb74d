"""bench/learning.py and its aggregator: mean ± 95 % interval from hand-computed inputs, the
results files, every printed command parsing into the config its arm names, and the team
sweep's arms: equal generated tokens per iteration (counted from the parsed configs), what
each arm trains, the majority vote's problems, the per-role analysis and paired differences."""

import ast
import collections
import json
import math
import os

import shlex

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from bench import learning, learning_ablations, learning_results
from marft_jax.configs import from_config_dict
from marft_jax.envs import team_tasks
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

  commands = {a: [learning.shell(c) for c in learning.cell_commands(a, 0, "/runs")]
              for a in learning.ARMS}
  summary = learning_results.write_all(results, docs, learning.ARMS, commands)

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
  assert "| marft_a_2agent | 30.0 ± 24.8 | 3 | 70.0 | reasoner 41.0, actor 8.0 | 20.0 min |" in md
  assert "| untuned_2agent | 25.0 n/a (1 seed) | 1 | 10.0 |" in md
  assert "| grpo_2agent | pending | 0 |" in md
  assert os.path.getsize(os.path.join(docs, learning_results.CURVES_PNG)) > 1000
  curves = learning_results.curves(results, learning.ARMS)["marft_a_2agent"]
  assert curves["reward"] == [(0, pytest.approx(0.1))]  # mean of 0, 0.1, 0.2
  assert curves["heldout"] == [(0, 0.25), (32, pytest.approx(0.3))]  # untuned at iteration 0


def _parse(command):
  """The typed config a printed command gives, parsed and resolved as the launch scripts do."""
  words = shlex.split(command)
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


def _fake_launch(ran, interrupt_call=None):
  """Plays launch.train / launch.eval with files only, recording each command in `ran`;
  call number `interrupt_call` (1-based) raises KeyboardInterrupt, as a stopped session."""

  def fake_run(command, log_path):
    ran.append(command)
    if len(ran) == interrupt_call:
      raise KeyboardInterrupt
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

  return fake_run


def test_run_cell_resumes_where_its_files_say(tmp_path, monkeypatch):
  """Segments already on record are not rerun; a finished cell runs nothing."""
  runs, results = str(tmp_path / "runs"), str(tmp_path / "results")
  ran = []
  monkeypatch.setattr(learning, "_run", _fake_launch(ran))
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


def test_a_running_cell_keeps_its_files_out_of_the_results(tmp_path, monkeypatch):
  """A cell stopped after its mid-run point has nothing in `results` (the repository holds
  finished cells only); resumed, it runs only what is left and then writes its files."""
  runs, results = str(tmp_path / "runs"), str(tmp_path / "results")
  ran = []
  # the mid-run segment trains and evaluates; the session stops during the last segment
  monkeypatch.setattr(learning, "_run", _fake_launch(ran, interrupt_call=3))
  with pytest.raises(KeyboardInterrupt):
    learning.run_cell("marft_a_2agent", 0, runs, results)
  assert [c[2] for c in ran] == ["launch.train", "launch.eval", "launch.train"]
  assert not os.path.exists(os.path.join(results, "marft_a_2agent"))
  ran.clear()
  learning.run_cell("marft_a_2agent", 0, runs, results)
  # the mid-run point is not evaluated again
  assert [c[2] for c in ran] == ["launch.train", "launch.eval"]
  out = os.path.join(results, "marft_a_2agent", "seed0")
  mid, end = learning.SWEEP["curve_points"][0], learning.SWEEP["iterations"]
  assert [r["iteration"] for r in learning.read_jsonl(os.path.join(out, "heldout.jsonl"))] \
      == [mid, end]
  assert sorted(os.listdir(out)) == ["eval.json", "heldout.jsonl", "metrics.jsonl"]


# --- the team sweep ----------------------------------------------------------------------------

TEAM_TRAINED = [k for k, spec in learning.TEAM_ARMS.items() if spec.trained]


def _turn_caps(config):
  """Each turn's cap, read off the parsed config: a role's own, else the team's."""
  order = config.team.role_order
  roles = {r.name: r for r in config.team.roles}
  return [roles[n].max_new_tokens or (config.team.last_max_new_tokens if i == len(order) - 1
                                      else config.team.max_new_tokens)
          for i, n in enumerate(order)]


@pytest.mark.parametrize("task", learning.TASKS)
def test_every_team_arm_spends_the_same_generated_tokens(task):
  """episodes x the turns' caps, from each arm's parsed training config: one number per task,
  the one the driver prints; the evaluated arms' turns have the team's caps too."""
  budgets = {}
  for key in [k for k in TEAM_TRAINED if k.startswith(task + "/")]:
    config, _, _ = _parse(learning.shell(learning.train_command(key, 0, "/runs")))
    budgets[key] = config.rollout.num_envs * sum(_turn_caps(config))
    assert budgets[key] == learning.token_budget(key)
  assert len(set(budgets.values())) == 1, budgets
  first, last = learning.TEAM_SWEEP["tokens"][task]
  assert set(budgets.values()) == {learning.TEAM_SWEEP["episodes"] * (first + last)}
  for arm in ("untuned_team", "majority_single"):
    config, _, _ = _parse(learning.shell(learning.eval_command(f"{task}/{arm}", 0, "/runs")))
    assert sum(_turn_caps(config)) == first + last
  assert learning.token_budget(f"{task}/majority_single") == \
      learning.TEAM_SWEEP["group_size"] * (first + last)
  printed = "\n".join(learning.budget_lines([f"{task}/marft_a_team"]))
  assert f"{learning.TEAM_SWEEP['episodes'] * (first + last)} generated tokens" in printed


@pytest.mark.parametrize("key", sorted(learning.TEAM_ARMS))
def test_team_arms_train_what_they_say(key):
  task, arm = key.split("/")
  spec = learning.TEAM_ARMS[key]
  commands = [learning.shell(c) for c in learning.cell_commands(key, 1, "/runs")]
  config, module, others = _parse(commands[-1])
  assert module == "launch.eval" and config.seed == 1
  assert f"--workdir=/runs/{task}/{arm}/seed1" in others
  assert ("--untuned" in others) == (not spec.trained)
  single = arm in ("ppo_single", "twice_single", "majority_single")
  if single:  # the whole problem for every role, the last one graded
    assert config.task.name == f"marft_jax.envs.team_tasks:full_information_{task}"
    assert [r.name for r in config.team.roles if r.graded] == [config.team.role_order[-1]]
  else:
    assert config.task.name == task
    assert config.team.role_order == learning.TEAM_ROLES[task]
  algorithm = {"ppo_single": "ppo", "majority_single": "ppo", "grpo_team": "grpo"}.get(
      arm, "marft_a")
  assert config.algorithm == algorithm
  assert config.team.num_roles == spec.agents == (1 if arm in ("ppo_single", "majority_single")
                                                   else 2)
  assert config.team.shared_adapter == (arm in ("shared_team", "twice_single"))
  assert config.team.anonymous == (arm == "anonymous_team")
  if arm == "grpo_team":
    assert config.rollout.group_size == learning.TEAM_SWEEP["group_size"]
  if arm == "majority_single":  # n samples of each problem, as many problems a call
    n = learning.TEAM_SWEEP["group_size"]
    assert f"--samples_per_problem={n}" in others
    assert f"--eval_batch={n * 34}" in others  # 100 problems at most 40 a call: 3 calls of 34
  else:
    assert f"--eval_batch={learning.TEAM_SWEEP['eval_batch']}" in others
  assert len(commands) == (2 * len(learning.TEAM_SWEEP["curve_points"]) + 2 if spec.trained
                           else 1)


def test_the_majority_vote_plays_the_greedy_arms_problems():
  """launch.eval puts `problems_per_call(total, batch // n)` problems in each call: the vote's
  batch gives as many as the greedy arms' (so the same episode seeds, the same problems)."""
  n, greedy_batch = learning.TEAM_SWEEP["group_size"], learning.TEAM_SWEEP["eval_batch"]
  for total in (100, 40, 7):
    command = learning.eval_command("grid_path/majority_single", 0, "/runs", problems=total)
    batch = int(next(w for w in command if w.startswith("--eval_batch=")).split("=")[1])
    assert learning._problems_per_call(total, batch // n) == \
        learning._problems_per_call(total, greedy_batch)
  assert learning._problems_per_call(100, 40) == 34  # 3 calls: ceil(100 / 3)
  assert learning._problems_per_call(164, 40) == 33


def test_ablations_evaluate_marft_a_teams_adapters():
  for task in learning.TASKS:
    names = {k.split("/")[1] for k in learning.ABLATIONS if k.startswith(task + "/")}
    assert names == {"swapped_team"} | {f"alone_{r}" for r in learning.TEAM_ROLES[task]}
    key = f"{task}/alone_{learning.TEAM_ROLES[task][0]}"
    assert learning.cell_commands(key, 2, "/runs") == [
        [learning.sys.executable, "-m", "bench.learning_ablations", key, "2", "/runs"]]


def _episode(seed, first, last, prediction, correct):
  return {"seed": seed, "dropped": None,
          "turns": [{"reply": first}, {"reply": last}],
          "infos": [{"prediction": {"checker": prediction}, "correct": {"checker": correct}}]}


def test_role_analysis_counts_who_fixes_what():
  source = team_tasks.problems("verify_correct", "test")
  gold = {s: int(source.problem_for_seed(s).answer) for s in (1, 2, 3, 4)}
  episodes = [
      _episode(1, f"x = {gold[1] + 1}", "", str(gold[1]), True),  # overruled, fixed
      _episode(2, f"x = {gold[2]}", "", str(gold[2] + 1), False),  # overruled, broken
      _episode(3, f"x = {gold[3]}", "", str(gold[3]), True),  # kept, right
      _episode(4, "no number", "", None, False),  # no final answer: no overrule
  ]
  got = learning.role_analysis("verify_correct", episodes)
  assert got == {"episodes": 4, "first_right_rate": 0.5, "last_right_rate": 0.5,
                 "overrules_rate": 0.5, "fixes_rate": 0.25, "breaks_rate": 0.25,
                 "keeps_rate": 0.25}


def _listed(problem) -> list[str]:
  """The candidate paths as the task's text lists them (read independently of the meta)."""
  line = problem.question.rsplit("Candidate paths: ", 1)[1].rstrip(".")
  return [c.replace(" ", "") for c in line.split(", ")]


def _path_episode(seed, path, correct, dropped=None):
  return {"seed": seed, "dropped": dropped, "turns": [{"reply": ""}],
          "infos": [{"prediction": {"executor": path}, "correct": {"executor": correct}}]}


def test_candidate_choice_counts_where_the_graded_path_comes_from():
  source = team_tasks.problems("grid_path", "test")
  listed = {s: _listed(source.problem_for_seed(s)) for s in range(1, 7)}
  gold = {s: source.problem_for_seed(s).answer for s in listed}
  wrong = {s: next(c for c in listed[s] if c != gold[s]) for s in listed}
  episodes = [
      _path_episode(1, gold[1], True),  # the right candidate
      _path_episode(2, listed[2][0], listed[2][0] == gold[2]),  # the first listed
      _path_episode(3, wrong[3], False),  # a failing candidate
      _path_episode(4, "UUUUUUUU", False),  # a path the task does not list
      _path_episode(5, None, False),  # no path
      _path_episode(6, gold[6], True, dropped="env error"),  # not counted
  ]
  places = collections.Counter(listed[s].index(p) + 1 for s, p in
                               ((1, gold[1]), (2, listed[2][0]), (3, wrong[3])))
  got = learning.candidate_choice("grid_path", episodes)
  assert got == {"episodes": 5, "candidates": 3, "candidate_rate": 3 / 5,
                 **{f"place_{i}_rate": places[i] / 5 for i in (1, 2, 3)},
                 "other_path_rate": 1 / 5, "no_path_rate": 1 / 5,
                 "right_when_candidate": (1 + (listed[2][0] == gold[2])) / 3}
  assert learning.candidate_choice("verify_correct", episodes) is None


def test_the_choice_table_names_the_places_and_the_chance_rate():
  choice = {"seeds_analysed": [1, 2], "candidate_rate": 0.6, "place_1_rate": 0.5,
            "place_2_rate": 0.1, "place_3_rate": 0.0, "other_path_rate": 0.3, "no_path_rate": 0.1,
            "right_when_candidate": 0.4}
  table = learning_results.choice_table({"ppo_single": {"choice": choice}, "untuned_team": {}})
  lines = table.splitlines()
  assert "33 %" in lines[0]
  assert lines[2] == ("| arm | seeds analysed | a candidate % | 1. listed % | 2. listed % | "
                      "3. listed % | another path % | no path % | right when a candidate % |")
  assert lines[4:] == ["| ppo_single | 1, 2 | 60.0 | 50.0 | 10.0 | 0.0 | 30.0 | 10.0 | 40.0 |"]
  assert learning_results.choice_table({"ppo_single": {}}) is None


def test_reanalyse_rewrites_the_analyses_of_finished_cells_that_kept_their_transcripts(
    tmp_path):
  source = team_tasks.problems("grid_path", "test")
  runs, results = tmp_path / "runs", tmp_path / "results"
  team_ep = _path_episode(1, source.problem_for_seed(1).answer, True)
  team_ep["turns"] = [{"reply": "The path from S to G is " + team_ep["infos"][0]["prediction"][
      "executor"]}, {"reply": ""}]
  for key, seed in (("grid_path/marft_a_team", 0), ("grid_path/ppo_single", 0),
                    ("grid_path/ppo_single", 1)):
    out = results / key / f"seed{seed}"
    out.mkdir(parents=True)
    (out / "eval.json").write_text('{"accuracy": 1.0}')
  # ppo_single seed 1 lost its workdir; grpo_team seed 0 is still running (no eval.json)
  for key in ("grid_path/marft_a_team", "grid_path/ppo_single", "grid_path/grpo_team"):
    work = learning.workdir(str(runs), key, 0)
    os.makedirs(work)
    with open(os.path.join(work, "eval_transcripts.jsonl"), "w") as f:
      f.write(json.dumps(team_ep) + "\n")
  majority = results / "grid_path/majority_single/seed0"  # a vote: no greedy transcript
  majority.mkdir(parents=True)
  (majority / "eval.json").write_text("{}")
  work = learning.workdir(str(runs), "grid_path/majority_single", 0)
  os.makedirs(work)
  with open(os.path.join(work, learning._result_stem("grid_path/majority_single")
                         + "_transcripts.jsonl"), "w") as f:
    f.write(json.dumps(team_ep) + "\n")
  done = learning.reanalyse(["grid_path/marft_a_team", "grid_path/ppo_single",
                             "grid_path/grpo_team", "grid_path/majority_single"], [0, 1],
                            str(runs), str(results))
  assert done == ["grid_path/marft_a_team seed 0", "grid_path/ppo_single seed 0"]
  team, single = results / "grid_path/marft_a_team/seed0", results / "grid_path/ppo_single"
  assert json.loads((team / "analysis.json").read_text())["first_right_rate"] == 1.0
  assert json.loads((team / "choice.json").read_text())["right_when_candidate"] == 1.0
  assert (single / "seed0/choice.json").exists() and not (single / "seed0/analysis.json").exists()
  assert sorted(os.listdir(single / "seed1")) == ["eval.json"]
  assert (team / "eval.json").read_text() == '{"accuracy": 1.0}'
  assert not (results / "grid_path/grpo_team").exists()
  assert os.listdir(majority) == ["eval.json"]


def test_the_analysis_table_reads_in_transcript_order():
  """Columns in the order a transcript is read (the first role, what the last does with its
  answer, the team's answer), not alphabetical; a rate role_analysis adds later goes last."""
  rows = {"marft_a_team": {"analysis": {"last_right_rate": 0.5, "fixes_rate": 0.125,
                                        "first_right_rate": 0.25, "a_new_rate": 0.75}},
          "ppo_single": {}}
  lines = learning_results.analysis_table(rows).splitlines()
  assert lines[2] == "| arm | first_right % | fixes % | last_right % | a_new % |"
  assert lines[4:] == ["| marft_a_team | 25.0 | 12.5 | 50.0 | 75.0 |"]
  assert "pending" in learning_results.analysis_table({"ppo_single": {}})


def test_training_signal_is_each_seeds_reward_and_rewardless_iterations():
  """Per seed, the mean of its iterations' rewards and the share of iterations whose reward
  is 0, one record per step (a resumed step's last record counts); then the mean over
  seeds. An arm that did not train (no metrics) has none."""
  seed0 = [{"step": 0, "reward": 0.75}, {"step": 0, "reward": 0.0}, {"step": 1, "reward": 0.5},
           {"step": 2, "reward": 0.0}, {"step": 3, "reward": 0.25}, {"step": 4}]
  seed1 = [{"step": 0, "reward": 0.25}, {"step": 1, "reward": 0.25}]
  got = learning_results.training_signal({0: {"metrics": seed0}, 1: {"metrics": seed1}})
  assert got == {"reward": pytest.approx((0.1875 + 0.25) / 2),
                 "rewardless_iterations": pytest.approx(0.25), "seeds": 2}
  assert learning_results.training_signal({0: {"metrics": []}}) is None
  table = learning_results.training_table({"marft_a_team": {"training": got}, "untuned_team": {}})
  assert table.splitlines()[4:] == ["| marft_a_team | 21.9 | 25 |"]


def test_reply_lengths_are_each_roles_mean_over_seeds_in_acting_order():
  evals = [{"accuracy": 0.5, "reply_tokens/solver": 10.0, "reply_tokens/checker": 4.0},
           {"reply_tokens/solver": 20.0, "reply_tokens/checker": 6.0}]
  got = learning_results.reply_lengths(evals)
  assert list(got.items()) == [("solver", 15.0), ("checker", 5.0)]
  assert learning_results.reply_lengths([{"accuracy": 0.5}]) == {}
  table = learning_results.reply_table({"marft_a_team": {"reply_tokens": got}, "swapped": {}})
  assert table.splitlines()[4:] == ["| marft_a_team | solver 15.0, checker 5.0 |"]


def test_problem_scores_and_the_majority_vote():
  greedy = [_episode(7, "", "", "3", True), _episode(8, "", "", "4", False)]
  assert learning.problem_scores(greedy, 1) == {"7": 1.0, "8": 0.0}
  votes = [_episode(5, "", "", p, c) for p, c in
           (("3", False), ("4", True), ("4", True), (None, False))]  # 4 wins 2 to 1
  ties = [_episode(6, "", "", p, c) for p, c in (("9", False), ("4", True))]  # the first drawn
  assert learning.problem_scores(votes + ties, 4) == {"5": 1.0, "6": 0.0}


def test_paired_differences_take_each_seeds_common_problems():
  arm = {0: {"problems": {"a": 1.0, "b": 1.0, "c": 0.0}}, 1: {"problems": {"a": 1.0, "b": 0.0}},
         2: {"problems": {"a": 0.0}}}
  ref = {0: {"problems": {"a": 0.0, "b": 1.0, "c": 0.0}}, 1: {"problems": {"a": 0.0, "b": 0.0}},
         2: {"problems": {"a": 1.0}}}
  got = learning_results.paired_difference(arm, ref)
  assert got["per_seed"] == {0: pytest.approx(1 / 3), 1: 0.5, 2: -1.0}
  mean, half = learning_results.ci95([1 / 3, 0.5, -1.0])
  assert (got["mean"], got["ci95"], got["seeds"]) == (pytest.approx(mean), pytest.approx(half), 3)
  assert learning_results.paired_difference(arm, {})["seeds"] == 0


def test_team_aggregate_marks_pending_cells(tmp_path):
  results, docs = str(tmp_path / "results"), str(tmp_path / "docs")
  os.makedirs(docs)
  folder = os.path.join(results, "grid_path", "untuned_team", "seed0")
  os.makedirs(folder)
  json.dump({"accuracy": 0.25, "episodes": 4, "token_budget": 64},
            open(os.path.join(folder, "eval.json"), "w"))
  json.dump({"1": 1.0, "2": 0.0, "3": 0.0, "4": 0.0}, open(os.path.join(folder, "problems.json"),
                                                            "w"))
  summary = learning_results.write_team(results, docs, ["grid_path"], learning.TEAM_ARM_NAMES,
                                        {"grid_path": ["swapped_team"]})
  assert summary["grid_path"]["untuned_team"]["mean"] == 0.25
  md = open(os.path.join(docs, "results.md")).read()
  assert "| untuned_team | 25.0 (1 seed) | 1 | pending | – | 64 |" in md
  assert "| marft_a_team | pending | 0 | pending | pending | – |" in md
  assert json.load(open(os.path.join(results, "team.json")))["arms"]["grid_path"][
      "ppo_single"]["seeds"] == 0


def _team_cell(results, task, arm, seed, problems):
  folder = os.path.join(results, task, arm, f"seed{seed}")
  os.makedirs(folder)
  json.dump({"accuracy": float(np.mean(list(problems.values()))), "episodes": len(problems),
             "token_budget": 64}, open(os.path.join(folder, "eval.json"), "w"))
  json.dump(problems, open(os.path.join(folder, "problems.json"), "w"))


def test_the_readme_row_is_the_best_multi_agent_arm_against_ppo(tmp_path):
  """Per task: the trained two-agent arm of highest mean (never ppo_single, the majority
  vote or the untuned team, even where they score higher), paired against ppo_single on each
  seed's common problems; a task without a finished team arm is pending."""
  results, docs = str(tmp_path / "results"), str(tmp_path / "docs")
  os.makedirs(docs)
  readme = str(tmp_path / "README.md")
  open(readme, "w").write("# t\n\n" + learning_results.README_BEGIN + "\n"
                          + learning_results.README_END + "\n\nafter\n")
  scores = {"ppo_single": [[1, 1, 0, 0], [1, 0, 0, 0]], "marft_a_team": [[1, 0, 0, 0], [0, 0, 0, 0]],
            "grpo_team": [[1, 1, 1, 0], [1, 1, 0, 0]], "majority_single": [[1, 1, 1, 1]] * 2,
            "untuned_team": [[1, 1, 1, 1]] * 2}
  for arm, per_seed in scores.items():
    for seed, s in enumerate(per_seed):
      _team_cell(results, "split_facts", arm, seed, {str(i): float(v) for i, v in enumerate(s)})
  _team_cell(results, "grid_path", "ppo_single", 0, {"0": 1.0, "1": 0.0})
  learning_results.write_team(results, docs, ["split_facts", "grid_path"],
                              learning.TEAM_ARM_NAMES, {"split_facts": [], "grid_path": []},
                              readme=readme)
  text = open(readme).read()
  assert text.startswith("# t\n\n" + learning_results.README_BEGIN) and text.endswith("\nafter\n")
  # grpo 75 %, 50 % against ppo 50 %, 25 %: +25 points on both seeds (interval 0; of the
  # means, t(1) · s / √2 = 12.71 · 0.177 / 1.414)
  assert "| split_facts | grpo_team | 62.5 ± 158.8 | 37.5 ± 158.8 | +25.0 ± 0.0 |" in text
  assert "| grid_path | pending | pending | 50.0 (1 seed) | pending |" in text


def test_accuracy_by_kind_splits_each_seeds_scores_by_the_problems_question(tmp_path):
  """split_facts problems scored right exactly when they ask for a total: by kind, totals
  100 % and differences 0 % on every seed (the kind read from each problem's question, not
  its meta); a second arm right on seed 0's differences only: 100 % and 0 %, mean 50 ±
  t(1)·s/√2."""
  results, docs = str(tmp_path / "results"), str(tmp_path / "docs")
  os.makedirs(docs)
  source = team_tasks.problems("split_facts", "test")
  is_total = {s: "How many more" not in source.problem_for_seed(s).question
              for s in range(100, 130)}
  assert 0 < sum(is_total.values()) < len(is_total)
  for seed in (0, 1):
    _team_cell(results, "split_facts", "ppo_single", seed,
               {str(s): float(t) for s, t in is_total.items()})
    _team_cell(results, "split_facts", "marft_a_team", seed,
               {str(s): float(seed == 0 and not t) for s, t in is_total.items()})
  summary = learning_results.write_team(results, docs, ["split_facts"], learning.TEAM_ARM_NAMES,
                                        {"split_facts": []})
  ppo = summary["split_facts"]["ppo_single"]["by_kind"]
  assert (ppo["total"]["mean"], ppo["total"]["ci95"], ppo["difference"]["mean"]) == (1, 0, 0)
  assert ppo["total"]["problems"] == sum(is_total.values())
  team = summary["split_facts"]["marft_a_team"]["by_kind"]
  assert team["total"]["mean"] == 0
  mean, half = learning_results.ci95([1.0, 0.0])
  assert (team["difference"]["mean"], team["difference"]["ci95"]) == (mean, pytest.approx(half))
  md = open(os.path.join(docs, "results.md")).read()
  n_diff, n_total = len(is_total) - sum(is_total.values()), sum(is_total.values())
  assert f"| arm | difference ({n_diff}) | total ({n_total}) |" in md
  assert "| ppo_single | 0.0 ± 0.0 | 100.0 ± 0.0 |" in md
  assert f"| marft_a_team | 50.0 ± {100 * half:.1f} | 0.0 ± 0.0 |" in md
  assert "| untuned_team |" not in md.split("by kind of problem")[1]


def test_team_curves_take_finished_cells_only(tmp_path):
  """A running cell's curve point (heldout.jsonl, no eval.json yet) is no number of the
  report: the curves leave it out until the cell has finished."""
  results = str(tmp_path)
  _team_cell(results, "grid_path", "marft_a_team", 0, {"0": 1.0, "1": 0.0})
  for seed, point in ((0, 0.25), (1, 0.75)):
    folder = os.path.join(results, "grid_path", "marft_a_team", f"seed{seed}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "heldout.jsonl"), "w") as f:
      f.write(json.dumps({"iteration": 8, "accuracy": point, "problems": 40}) + "\n")
  assert learning_results.team_curves(results, "grid_path", ["marft_a_team"]) == {
      "marft_a_team": [(8, 0.25, 0.25, 0.25, 1)]}


def test_team_curves_give_each_points_mean_and_spread_over_seeds(tmp_path):
  """Iteration 0 is the untuned team's seeds; each later point the finished seeds' mean,
  lowest and highest, and how many seeds it holds."""
  results = str(tmp_path)
  _team_cell(results, "grid_path", "untuned_team", 0, {"0": 0.0, "1": 0.0})
  _team_cell(results, "grid_path", "untuned_team", 1, {"0": 1.0, "1": 0.0})
  for seed, points in ((0, (0.25, 0.5)), (1, (0.75, 1.0)), (2, (0.5,))):
    _team_cell(results, "grid_path", "marft_a_team", seed, {"0": 1.0})
    with open(os.path.join(results, "grid_path", "marft_a_team", f"seed{seed}",
                           "heldout.jsonl"), "w") as f:
      for iteration, point in zip((8, 16), points):
        f.write(json.dumps({"iteration": iteration, "accuracy": point}) + "\n")
  got = learning_results.team_curves(results, "grid_path", ["marft_a_team", "ppo_single"])
  assert got == {"marft_a_team": [(0, 0.25, 0.0, 0.5, 2), (8, 0.5, 0.25, 0.75, 3),
                                  (16, 0.75, 0.5, 1.0, 2)]}
  png = str(tmp_path / "curves.png")
  learning_results.plot_team({"grid_path": got}, png)
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_readmes_team_rows_are_the_finished_cells():
  """The README's team rows are what the aggregator makes of the committed cells
  (docs/results/): a cell added or removed without `--aggregate` fails here."""
  readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  block = readme.split(learning_results.README_BEGIN + "\n", 1)[1].split(
      "\n" + learning_results.README_END, 1)[0]
  summary = learning_results.summarize_team(os.path.join(ROOT, "docs", "results"), learning.TASKS,
                                            learning.TEAM_ARM_NAMES)
  assert block == learning_results.readme_rows(summary)


def test_the_aggregator_does_not_import_the_driver():
  """bench.learning imports bench.learning_results, never the other way round."""
  path = os.path.join(ROOT, "bench", "learning_results.py")
  imported = {a.name if isinstance(n, ast.Import) else n.module
              for n in ast.walk(ast.parse(open(path).read()))
              if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
  assert not {m for m in imported if m and m.startswith("bench")}


def test_ablation_adapters_swap_and_pick_along_the_adapter_axis():
  """Every target's factors are [L, A, ...]: `swapped` reverses A (two roles), `only` keeps
  one adapter as a stack of one; the layer axis never moves."""
  a = np.arange(2 * 2 * 3).reshape(2, 2, 3)  # L = 2 layers, A = 2 adapters
  layers = {"q_proj": {"a": a, "b": a + 100}}
  flipped = learning_ablations.swapped(layers)
  np.testing.assert_array_equal(flipped["q_proj"]["a"][:, 0], a[:, 1])
  np.testing.assert_array_equal(flipped["q_proj"]["b"][:, 1], a[:, 0] + 100)
  alone = learning_ablations.only(layers, 1)
  assert alone["q_proj"]["a"].shape == (2, 1, 3)
  np.testing.assert_array_equal(alone["q_proj"]["a"][:, 0], a[:, 1])
