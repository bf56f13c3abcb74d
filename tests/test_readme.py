"""The README is the front page: short, holding what the issue lists, its code runs, its results
are the measured ones, and CI runs its two commands."""

import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The configuration reference is generated from TrainConfig's field comments by its own tool;
# the README links it before that tool has written it.
GENERATED_PAGES = {"docs/config.md"}


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


def _blocks(language):
  return re.findall(rf"```{language}\n(.*?)```", _read("README.md"), re.S)


def _commands():
  return [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]


def _section(title):
  readme = _read("README.md")
  return readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_ci_runs_the_readme_commands_word_for_word():
  main_job, test = _commands()[:2]
  ci = _read(".ci/run")
  assert main_job.startswith("pip install -e . &&") and "python -m launch.train" in main_job
  assert test.startswith("pip install torch==2.13.0") and "python -m pytest" in test
  assert test in ci.splitlines(), "the README's test command must be in .ci/run verbatim"
  # The main job runs with a short prompt and few tokens: the README's command, then flags.
  flat = ci.replace("\\\n", " ")
  assert re.search(re.escape(main_job) + r"\s+--config\.", flat), flat
  assert "python -m venv" in ci  # in a fresh venv holding only the package


def test_readme_launch_commands_name_real_config_keys():
  from launch import cli
  for command in _commands():
    for script in ("generate", "train"):
      if f"python -m launch.{script}" in command:
        argv = shlex.split(command.split("#")[0].split("python -m ")[-1])
        config_file = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
                           os.path.join(cli.CONFIG_DIR, f"{script}.py"))
        cli._default_config_path = os.path.join(ROOT, config_file)
        assert os.path.isfile(cli._default_config_path), command
        assert cli._unknown_override(argv) == "", command


def test_readme_is_a_front_page():
  readme = _read("README.md")
  assert len(readme.splitlines()) <= 150
  install = _section("Install")
  for extra in ('".[cuda]"', '".[tpu]"', "pip install -e .  "):
    assert extra in install, extra
  quickstart = _blocks("python")[0]
  assert 10 <= len(quickstart.strip().splitlines()) <= 15, quickstart
  assert "train(" in quickstart and "restore" in quickstart
  for section in ("Results", "Features", "Documentation", "Citation"):
    assert _section(section).strip(), section
  assert "@misc{" in _section("Citation") and "2504.16129" in _section("Citation")


def test_readme_results_are_the_measured_ones():
  """The five rows are docs/results.json's means and intervals, in points."""
  measured = json.loads(_read("docs/results.json"))
  arms = {"untuned reasoner → actor team": "untuned_2agent", "single-agent PPO": "ppo_1agent",
          "MARFT-A, 2 agents": "marft_a_2agent", "MARFT-T, 2 agents": "marft_t_2agent",
          "GRPO, 2 agents": "grpo_2agent"}
  rows = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", _section("Results"), re.M))
  assert set(arms) <= set(rows), rows
  for label, arm in arms.items():
    cell = measured[arm]
    assert rows[label] == f"{100 * cell['mean']:.1f} ± {100 * cell['ci95']:.1f}", label
  assert "docs/results.md" in _section("Results")


def test_readme_links_lead_somewhere():
  for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read("README.md")):
    if target not in GENERATED_PAGES:
      assert os.path.exists(os.path.join(ROOT, target)), target


def test_readme_python_snippets_run_word_for_word(capsys, monkeypatch, tmp_path):
  """The quickstart trains the tiny model for two iterations and restores it (in a temporary
  folder: its workdir is relative); the team file is the shipped one (tests/train)."""
  monkeypatch.chdir(tmp_path)
  for block in _blocks("python"):
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own code
  printed = capsys.readouterr().out.split()
  assert printed[:1] == ["2"], printed  # the restored step: the last of 2 iterations
  assert 0.0 <= float(printed[1]) <= 1.0
  assert (tmp_path / "runs" / "quickstart" / "exports" / "step_2").is_dir()
