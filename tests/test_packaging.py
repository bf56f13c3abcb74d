"""The package as a user installs it: pyproject.toml's metadata, the files shipped beside it,
and (one slow test) a non-editable install whose console scripts run from another folder."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml

import marft_jax
from tests.compile_flags import FAST_COMPILE

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("marft-train", "marft-eval", "marft-generate")


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


@pytest.fixture(scope="module")
def project():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _range(requirement: str, name: str) -> str:
  """'>=0.10.0,<0.12' of 'jax[cuda13]>=0.10.0,<0.12' (name 'jax')."""
  match = re.fullmatch(rf"{re.escape(name)}(\[[\w,]+\])?([<>=!~].*)", requirement)
  assert match, requirement
  return match.group(2)


def test_the_version_is_written_once_and_cited_as_it(project):
  assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "marft_jax.__version__"}
  citation = yaml.safe_load(_read("CITATION.cff"))
  assert str(citation["version"]) == marft_jax.__version__


def test_extras_agree_with_the_base_and_the_readme(project):
  """The accelerator extras pin jax to the base range; the test extra holds the benchmarks
  extra (the suite grades HumanEval) and the torch that the README installs first."""
  dependencies = project["project"]["dependencies"]
  extras = project["project"]["optional-dependencies"]
  assert set(extras) == {"test", "benchmarks", "docs", "cuda", "cuda12", "tpu"}
  jax_range = _range(next(d for d in dependencies if d.startswith("jax>")), "jax")
  for extra in ("cuda", "cuda12", "tpu"):
    assert [_range(r, "jax") for r in extras[extra]] == [jax_range], extra
  assert set(extras["benchmarks"]) <= set(extras["test"])
  assert set(extras["docs"]) <= set(extras["test"])  # the suite builds the docs
  torch = re.search(r"pip install (torch==\S+) ", _read("README.md")).group(1)
  assert torch in extras["test"]
  assert all(re.search(r"[<>=]", d) for d in dependencies), "every dependency has a range"


def test_console_scripts_name_each_launchers_run(project):
  scripts = project["project"]["scripts"]
  assert scripts == {s: f"launch.{s.split('-')[1]}:run" for s in SCRIPTS}
  for target in scripts.values():
    module = target.split(":")[0]
    with open(os.path.join(ROOT, *module.split(".")) + ".py") as f:
      assert "\ndef run() -> None:" in f.read(), target


def test_every_data_file_of_the_packages_is_package_data(project):
  """A file that is not Python under marft_jax/ or launch/ (a problem fixture, py.typed) is
  matched by [tool.setuptools.package-data], or the wheel would ship without it."""
  package_data = project["tool"]["setuptools"]["package-data"]
  missing = []
  for top in ("marft_jax", "launch"):
    for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
      dirs[:] = [d for d in dirs if d != "__pycache__"]
      for name in files:
        if name.endswith((".py", ".pyc")):
          continue
        path = os.path.relpath(os.path.join(folder, name), ROOT)
        if not any(path.startswith(package.replace(".", os.sep) + os.sep) and fnmatch.fnmatch(
            os.path.relpath(path, package.replace(".", os.sep)), pattern)
                   for package, patterns in package_data.items() for pattern in patterns):
          missing.append(path)
  assert not missing, missing
  assert os.path.isfile(os.path.join(ROOT, "marft_jax", "py.typed"))


def test_license_citation_and_changelog(project):
  assert project["project"]["license"] == "Apache-2.0"
  assert project["project"]["license-files"] == ["LICENSE"]
  license_text = _read("LICENSE")
  assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
  citation = yaml.safe_load(_read("CITATION.cff"))
  assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
  assert citation["title"] == project["project"]["name"] == "marft_jax"
  assert citation["license"] == "Apache-2.0"
  paper, = citation["references"]
  assert paper["title"] == "MARFT: Multi-Agent Reinforcement Fine-Tuning"
  assert [a["family-names"] for a in paper["authors"]] == ["Liao", "Wen", "Wang", "Zhang"]
  assert paper["year"] == 2025 and paper["url"] == "https://arxiv.org/abs/2504.16129"
  changelog = _read("CHANGELOG.md")
  assert "keepachangelog.com" in changelog
  assert re.findall(r"^## \[(.+?)\]", changelog, re.M)[0] == "Unreleased"


# --- a non-editable install, run from another folder -----------------------------------------


def _venv_with_the_host_packages(venv: str) -> str:
  """A venv without pip that sees the running interpreter's packages (jax, pip, setuptools)
  behind its own: `--system-site-packages` would reach the base interpreter's alone where the
  tests run in a venv themselves. `site.addsitedir` also runs their .pth files (an editable
  install's finder among them, which comes after the venv's own site-packages)."""
  import site
  import sysconfig
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
  python = os.path.join(venv, "bin", "python")
  purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                            "'purelib'))"], check=True, capture_output=True, text=True)
  host = [*site.getsitepackages(), sysconfig.get_path("purelib")]
  if site.ENABLE_USER_SITE:
    host.append(site.getusersitepackages())
  with open(os.path.join(purelib.stdout.strip(), "_host_packages.pth"), "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({p!r})"
                                         for p in dict.fromkeys(host)) + "\n")
  return python


_INSTALLED = textwrap.dedent("""
    import importlib.metadata, json, os, sysconfig
    import launch.cli, marft_jax
    dist = importlib.metadata.distribution("marft_jax")
    print(json.dumps(dict(
        purelib=sysconfig.get_path("purelib"), marft_jax=marft_jax.__file__,
        launch=launch.cli.__file__, configs=sorted(os.listdir(launch.cli.CONFIG_DIR)),
        data=sorted(os.listdir(os.path.join(os.path.dirname(marft_jax.__file__), "envs", "data"))),
        typed=os.path.isfile(os.path.join(os.path.dirname(marft_jax.__file__), "py.typed")),
        license=any(f.name == "LICENSE" for f in dist.files),
        scripts=sorted(e.name for e in dist.entry_points if e.group == "console_scripts"))))
""")


def test_a_non_editable_install_runs_its_console_scripts_from_another_folder(tmp_path,
                                                                               project):
  """`pip install .` (a wheel built from a copy of the sources, no isolation, no index) into a
  fresh venv; from an empty folder: `marft-train/-eval/-generate --help`, `python -m
  launch.train` with an unknown config name, and a one-iteration `marft-train` of a tiny model
  on a shipped config named, reading its bundled problems, into a relative workdir."""
  import setuptools
  if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (77, 0):
    pytest.skip(f"setuptools {setuptools.__version__}: the build needs setuptools>=77 (the "
                "test extra installs it)")
  source = tmp_path / "source"  # the build writes build/ and *.egg-info beside the sources
  ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
  for package in ("marft_jax", "launch"):
    shutil.copytree(os.path.join(ROOT, package), source / package, ignore=ignore)
  for name in ("pyproject.toml", project["project"]["readme"],
               *project["project"]["license-files"]):
    shutil.copy(os.path.join(ROOT, name), source / name)
  venv = str(tmp_path / "venv")
  python = _venv_with_the_host_packages(venv)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
             XLA_FLAGS=FAST_COMPILE)  # one CPU device, as a user's machine has
  install = subprocess.run(
      [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--ignore-installed",
       "--quiet", str(source)], env=env, capture_output=True, text=True, timeout=180)
  assert install.returncode == 0, install.stdout + install.stderr
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()

  def run(*command, timeout=120):
    return subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=timeout)

  out = run(python, "-c", _INSTALLED)
  assert out.returncode == 0, out.stderr
  installed = json.loads(out.stdout)
  for module in ("marft_jax", "launch"):  # the venv's copy, not the repository's
    assert installed[module].startswith(installed["purelib"] + os.sep), installed
  configs = sorted(n for n in os.listdir(os.path.join(ROOT, "launch", "configs"))
                   if n.endswith(".py"))
  assert [n for n in installed["configs"] if n.endswith(".py")] == configs
  assert installed["data"] == sorted(os.listdir(os.path.join(ROOT, "marft_jax", "envs",
                                                             "data")))
  assert installed["typed"] and installed["license"] and installed["scripts"] == sorted(SCRIPTS)

  first_lines = {"marft-train": "Train a team of agents with MARFT",
                 "marft-eval": "Evaluate a team on held-out problems",
                 "marft-generate": "Chat with a model"}
  for script, first_line in first_lines.items():
    out = run(os.path.join(venv, "bin", script), "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(first_line), out.stdout[:300]
    default = "generate" if script == "marft-generate" else "train"
    assert f"Config fields ({default}, launch/configs/{default}.py;" in out.stdout

  out = run(python, "-m", "launch.train", "--config=code_2agent")
  assert out.returncode == 2
  names = ", ".join(n[:-3] for n in configs if n != "__init__.py")
  assert out.stderr.strip() == ("error: --config=code_2agent: no such config file, nor a "
                                f"shipped config's name (one of {names})")

  from marft_jax.models import tiny
  model = tiny.save_tiny_model(tmp_path / "tiny")
  out = run(os.path.join(venv, "bin", "marft-train"), "--config=math_2agents",
            f"--config.model.source={model}", "--config.iterations=1",
            "--config.rollout.num_envs=2", "--config.team.max_new_tokens=4",
            "--config.team.last_max_new_tokens=4", "--config.optimizer.minibatches=1",
            "--workdir=run", timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().startswith("iterations=1 reward=") and "workdir=run" in out.stdout
  assert (elsewhere / "run" / "metrics.jsonl").stat().st_size > 0
  assert (elsewhere / "run" / "exports" / "step_1").is_dir()
