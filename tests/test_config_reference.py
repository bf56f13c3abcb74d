"""The configuration reference has one source, the comments of the config dataclasses' fields:
docs/config.md is generated from them and is up to date, every field has one, none cites
history, `--help` prints them within 100 columns and lists every flag its script takes."""

import dataclasses
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from launch import reference
from launch.configs.generate import GenerateConfig
from marft_jax.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(ROOT, "launch", "configs")
SHIPPED = sorted(p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                 if not p.endswith("__init__.py"))
ROOTS = (TrainConfig, GenerateConfig)


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _root_of(path):
  return GenerateConfig if os.path.basename(path) == "generate.py" else TrainConfig


def test_the_page_is_generated_from_the_comments_and_up_to_date():
  with open(reference.PAGE, encoding="utf-8") as f:
    committed = f.read()
  assert committed == reference.markdown(), (
      f"docs/config.md differs from the fields' comments: run `{reference.REGENERATE}`")


@pytest.mark.parametrize("root", ROOTS, ids=lambda c: c.__name__)
def test_every_field_has_a_comment(root):
  missing = reference.undocumented(root)
  assert not missing, (f"fields of {root.__name__} without a comment (add one above or after "
                       f"the declaration, then run `{reference.REGENERATE}`): {missing}")


@pytest.mark.parametrize("root", ROOTS, ids=lambda c: c.__name__)
def test_no_help_cites_history(root):
  """Commits, dates and issues belong to marft_jax.train.config.history and CHANGELOG.md."""
  cited = {key: match.group(0) for key, text in reference.documented_keys(root).items()
           for match in [reference.HISTORY.search(text)] if match}
  assert not cited, cited


def test_the_history_pattern_finds_commits_dates_and_issues_only():
  for text in ("as before df0626f", "since 3821d0b2e4", "on 2026-11-29", "see issue 12",
               "Issue #7"):
    assert reference.HISTORY.search(text), text
  for text in ("1024 MiB", "16777216 rows", "a decade", "effaced", "0.1 × lr", "k3, k1"):
    assert not reference.HISTORY.search(text), text


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_help_lines_fit_in_100_columns(path):
  lines = reference.help_lines(_root_of(path), _load(path))
  wide = [line for line in lines if len(line) > reference.WIDTH]
  assert not wide, "\n".join(wide)


def test_every_section_has_a_docstring_for_the_page():
  for root in ROOTS:
    for prefix, cls in reference.sections(root):
      assert reference.class_doc(cls), f"{prefix or root.__name__}: {cls.__name__}"


def test_the_page_has_a_row_per_key_and_its_prose_fits_in_100_columns():
  page = reference.markdown()
  rows = re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)
  keys = [k for root in ROOTS for k, _ in reference.documented_keys(root).items()
          if not k.endswith("<name>.name")]
  assert sorted(rows) == sorted(keys)
  prose = [line for line in page.splitlines() if not line.startswith("|")]
  assert max(map(len, prose)) <= reference.WIDTH


@dataclasses.dataclass(frozen=True)
class _Commented:
  """A fixture of every way a field is commented."""

  # Above: the first line
  # and the second.
  above: int = 1
  after: str = "#"  # after it (a '#' in the default is no comment)
  # Above,
  both: float = 0.5  # then after.
  # A banner, then a blank line: not a field's.

  bare: int = 0
  spread: tuple = (1,
                   2)  # on its declaration's last line


def test_the_comment_reader():
  assert reference.field_help(_Commented) == {
      "above": "Above: the first line and the second.",
      "after": "after it (a '#' in the default is no comment)",
      "both": "Above, then after.", "bare": "",
      "spread": "on its declaration's last line"}
  assert reference.undocumented(_Commented) == ["bare"]


def test_the_missing_comment_check_kills_a_mutant(tmp_path, monkeypatch):
  """marft_jax/train/config/schema.py with one comment deleted (a trailing one, then a block above
  a field): the check names exactly that key."""
  with open(os.path.join(ROOT, "marft_jax", "train", "config", "schema.py"),
            encoding="utf-8") as f:
    source = f.read()
  trailing = "  max_to_keep: int = 3  # the latest checkpoints kept in the workdir, >= 1\n"
  block = "  # Iterations between checkpoints, >= 1; one is also written at the end and on SIGTERM\n"
  for deleted, mutant, key in ((trailing, "  max_to_keep: int = 3\n", "max_to_keep"),
                               (block, "", "checkpoint_every")):
    assert source.count(deleted) == 1, "the mutant's line moved: update this test"
    path = tmp_path / f"mutant_{key}.py"
    path.write_text(source.replace(deleted, mutant), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, path.stem, module)  # where inspect finds its source
    spec.loader.exec_module(module)
    assert reference.undocumented(module.TrainConfig) == [key]
  assert reference.undocumented(TrainConfig) == []


def test_a_value_differing_from_the_default_says_the_default_and_long_values_are_cut():
  config = _load(os.path.join(CONFIG_DIR, "train.py"))
  lines = reference.help_lines(TrainConfig, config)
  assert any(line.startswith("  eval_every = 8  (default: 0)  # Held-out accuracy")
             for line in lines)
  prompt = next(line for line in lines if line.startswith("  team.roles.actor.system_prompt"))
  assert prompt.endswith("...") and len(prompt) == reference.WIDTH


_SCRIPTS = ("train", "eval", "generate")


@pytest.fixture(scope="module")
def helps():
  """Per script: (the flags absl has registered once it is imported, its --help)."""
  names = ("import sys; from absl import flags; import launch.{0}; "
           "print(' '.join(sorted({{flags.FLAGS[n].name for n in flags.FLAGS}})))")
  runs = {}
  for script in _SCRIPTS:  # started together: each spends seconds importing jax
    runs[script] = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                    for argv in ([sys.executable, "-c", names.format(script)],
                                 [sys.executable, "-m", f"launch.{script}", "--help"])]
  out = {}
  for script, (flag_run, help_run) in runs.items():
    flag_out, flag_err = flag_run.communicate(timeout=300)
    help_out, help_err = help_run.communicate(timeout=300)
    assert flag_run.returncode == 0, flag_err[-2000:]
    assert help_run.returncode == 0, help_err[-2000:]
    out[script] = (flag_out.split(), help_out)
  return out


@pytest.mark.parametrize("script", _SCRIPTS)
def test_help_lists_every_flag_the_script_takes(helps, script):
  registered, text = helps[script]
  listed = set(re.findall(r"--(\w+)", text))
  assert {"config", "compilation_cache", "retain_host_memory", "verbosity"} <= set(registered)
  if script != "generate":
    assert {"workdir"} <= set(registered)
  missing = sorted(set(registered) - listed)
  assert not missing, missing
  own = re.findall(r"^  --(\w+)", text.split("\nFlags (")[1], flags=re.M)
  assert "retain_host_memory" in own and "compilation_cache" in own  # with their help


@pytest.mark.parametrize("script", _SCRIPTS)
def test_help_fits_in_100_columns_and_cites_no_history(helps, script):
  _, text = helps[script]
  wide = [line for line in text.splitlines() if len(line) > reference.WIDTH]
  assert not wide, "\n".join(wide)
  assert not reference.HISTORY.search(text), reference.HISTORY.search(text)
