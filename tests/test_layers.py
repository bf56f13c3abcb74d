"""The package's layers point down: read from the imports (`ast`), no module of `marft_jax/` or
`bench/` imports from a layer above its own, no group of modules imports itself in a circle,
and no module hides an import of the package's own code inside a function.

`LAYERS` is the map, bottom first; a module belongs to the layer of its longest listed prefix,
and one that no prefix names fails `test_every_module_has_a_layer` (a new file is placed on
purpose, not by accident). Every import counts as an edge wherever it is written (in a
function, under `if TYPE_CHECKING:`), so nothing can hide one. The facades at the top (the
package `__init__`s that re-export, and the modules kept at old import paths) re-export only:
nothing inside the package imports them, so code inside imports each name from where it is
defined.
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

T = "marft_jax.train."
LAYERS: tuple[tuple[str, ...], ...] = (
    ("marft_jax.compile_stats", "marft_jax.jsonl", "marft_jax.configs",
     "marft_jax.host_allocator", "marft_jax.validation"),
    ("marft_jax.architecture", "marft_jax.sharding", "marft_jax.multihost"),
    ("marft_jax.lora",),
    ("marft_jax.models", "marft_jax.memory"),
    ("marft_jax.ppo",),
    ("marft_jax.envs",),
    ("marft_jax.rollout",),
    # train/: the leaves (workdir files, locks, metrics, checkpoints), then the RL and update
    # maths, each owning its section's dataclass
    tuple(T + m for m in ("workdir_lock", "saved_steps", "write_failures", "metrics",
                          "eval_progress", "optim", "checkpoint")),
    tuple(T + m for m in ("batching", "local_batch", "advantages", "critic", "update")),
    # the task table and the held-out problems its builders keep apart
    (T + "heldout", T + "tasks"),
    # config/, each file on those above it (config/__init__.py lists them in this order)
    (T + "config.sections",),
    (T + "config.teams", T + "config.algorithms"),
    (T + "config.schema",),
    (T + "config.profile_files",),
    (T + "config.resolve",),
    (T + "config.history", T + "config.saved"),
    # build/: a run's pieces from its config
    (T + "build.preflight", T + "build.team", T + "build.envs", T + "build.model"),
    (T + "build.learner", T + "trained_problems"),
    # one run interface for a team on one or several backbones
    (T + "shared_critic", T + "backbones"),
    (T + "run",),
    # the drivers
    (T + "async_rollout", T + "evaluate"),
    (T + "loop", T + "restore"),
    # facades: re-exports only (package __init__s, old import paths)
    ("marft_jax.__init__", T + "__init__", T + "config.__init__", T + "build.__init__",
     T + "algorithms", T + "teams", T + "config_history"),
    ("bench",),
)
FACADES = LAYERS[-2]
# A facade may name its re-exports lazily (`__getattr__`: `import marft_jax` loads no JAX).
LAZY_ALLOWED_IN = ("__getattr__",)


def module_files() -> dict[str, pathlib.Path]:
  """{module name: file} of every module of marft_jax/ and bench/; a package is named by its
  `__init__` ("marft_jax.train.__init__") so that it has a layer of its own."""
  files = {}
  for top in ("marft_jax", "bench"):
    for path in sorted((ROOT / top).rglob("*.py")):
      files[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
  return files


def _package(module: str) -> str:
  return module[:-len(".__init__")] if module.endswith(".__init__") else module


def _target(name: str, modules) -> str | None:
  """The module an imported dotted name is: itself, or its package's `__init__`."""
  if name in modules:
    return name
  if name + ".__init__" in modules:
    return name + ".__init__"
  return None


def imports(module: str, path: pathlib.Path, modules) -> list[tuple[str, int, str]]:
  """[(imported module, line, enclosing function or "")] of every import of the package's own
  code in `path`, wherever it is written. `from a import b` names a.b when b is a module,
  else a's `__init__`."""
  tree = ast.parse(path.read_text(), str(path))
  package = _package(module) if path.name == "__init__.py" else module.rsplit(".", 1)[0]
  found = []

  def visit(node, function: str):
    for child in ast.iter_child_nodes(node):
      inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
          else function
      if isinstance(child, ast.Import):
        for alias in child.names:
          target = _target(alias.name, modules)
          if target:
            found.append((target, child.lineno, function))
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:
          parts = package.split(".")[:len(package.split(".")) - child.level + 1]
          base = ".".join(parts + ([base] if base else []))
        for alias in child.names:
          target = _target(f"{base}.{alias.name}", modules) or _target(base, modules)
          if target:
            found.append((target, child.lineno, function))
      visit(child, inner)

  visit(tree, "")
  return [(t, line, fn) for t, line, fn in found if t != module]


def layer_of(module: str) -> int | None:
  best, layer = -1, None
  for i, prefixes in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
        best, layer = len(prefix), i
  return layer


def graph() -> dict[str, list[tuple[str, int, str]]]:
  files = module_files()
  return {m: imports(m, p, files) for m, p in files.items()}


def upward(edges) -> list[str]:
  """The imports of a layer above the importer's (or of a facade, from inside)."""
  bad = []
  for module, targets in edges.items():
    for target, line, _ in targets:
      if layer_of(target) > layer_of(module) or (
          target in FACADES and layer_of(module) < len(LAYERS) - 1 and module not in FACADES):
        bad.append(f"{module}:{line} imports {target} (layer {layer_of(target)} above "
                   f"{layer_of(module)}, or a facade)")
  return bad


def circles(edges) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []
  counter = [0]

  def connect(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in {t for t, _, _ in edges.get(v, ())}:
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      connect(v)
  return found


def hidden(edges) -> list[str]:
  """Imports of the package's own code inside a function of marft_jax/ (a facade's
  `__getattr__` aside)."""
  return [f"{module}:{line} imports {target} inside {function}()"
          for module, targets in edges.items() if module.startswith("marft_jax")
          for target, line, function in targets
          if function and not (module in FACADES and function in LAZY_ALLOWED_IN)]


@pytest.fixture(scope="module")
def edges():
  return graph()


def test_every_module_has_a_layer(edges):
  assert [m for m in edges if layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_above_its_own(edges):
  assert upward(edges) == []


def test_no_modules_import_each_other_in_a_circle(edges):
  assert circles(edges) == []


def test_no_import_of_the_package_hides_inside_a_function(edges):
  assert hidden(edges) == []


def test_an_upward_import_a_circle_and_a_hidden_import_are_each_caught(edges):
  """The checks' mutants: an update that imports the loop (upward), two config modules of
  one layer that import each other (a circle), and the package imported inside a function."""
  mutant = {m: list(t) for m, t in edges.items()}
  mutant[T + "update"].append((T + "loop", 1, ""))
  assert any("update:1 imports marft_jax.train.loop" in v for v in upward(mutant))
  mutant = {m: list(t) for m, t in edges.items()}
  mutant[T + "config.teams"].append((T + "config.algorithms", 1, ""))
  mutant[T + "config.algorithms"].append((T + "config.teams", 1, ""))
  assert [T + "config.algorithms", T + "config.teams"] in circles(mutant)
  mutant = {m: list(t) for m, t in edges.items()}
  mutant[T + "loop"].append((T + "run", 7, "train"))
  assert hidden(mutant) == ["marft_jax.train.loop:7 imports marft_jax.train.run inside train()"]


def test_the_parser_reads_lazy_relative_and_from_imports(tmp_path):
  """`imports` against a hand-written module: each form names the module it loads."""
  source = ("from marft_jax.train import loop\n"
            "from marft_jax.train.config import TrainConfig\n"
            "from . import run\n"
            "import marft_jax.train.tasks\n"
            "def f():\n"
            "  from marft_jax.train.build import team\n")
  path = tmp_path / "probe.py"
  path.write_text(source)
  modules = {T + n: None for n in ("loop", "run", "tasks", "build.team", "config.__init__",
                                   "probe")}
  assert imports(T + "probe", path, modules) == [
      (T + "loop", 1, ""), (T + "config.__init__", 2, ""), (T + "run", 3, ""),
      (T + "tasks", 4, ""), (T + "build.team", 6, "f")]


@pytest.mark.parametrize("facade", [T + "algorithms", T + "teams", T + "config_history",
                                    T + "config.__init__"])
def test_the_old_import_paths_still_name_the_moved_objects(facade):
  """The facades re-export: each name at the old path is the object where it now lives."""
  import importlib
  from marft_jax.train.build import team
  from marft_jax.train.config import algorithms, history, resolve, schema, sections, teams
  module = importlib.import_module(_package(facade))
  expected = {
      T + "algorithms": {"ALGORITHMS": algorithms.ALGORITHMS, "resolve": resolve.resolve},
      T + "teams": {"shipped": teams.shipped, "build_team": team.agents,
                    "adapter_names": teams.adapter_names},
      T + "config_history": {"fill_missing": history.fill_missing, "CHANGED": history.CHANGED},
      T + "config.__init__": {"TrainConfig": schema.TrainConfig, "preset": resolve.preset,
                              "TeamSection": sections.TeamSection},
  }[facade]
  for name, obj in expected.items():
    assert getattr(module, name) is obj, name


def test_layers_name_only_modules_that_exist(edges):
  """A stale entry in `LAYERS` (a module moved or deleted) is an error, not a silent gap."""
  names = set(edges) | {_package(m) for m in edges}
  stale = [p for layer in LAYERS for p in layer
           if not any(n == p or n.startswith(p + ".") for n in names)]
  assert stale == [], stale
  assert os.path.isdir(ROOT / "marft_jax" / "train" / "config")
