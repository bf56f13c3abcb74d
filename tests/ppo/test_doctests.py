"""The `>>>` examples in marft_jax.ppo's docstrings run and print what they say, and every
function that marft_jax.ppo exports has one (so that the examples cannot silently rot).

CI runs only tests/ (not `--doctest-modules`), so the examples are collected here with the
standard library's `doctest`, one test each, named by the example's dotted path
(`marft_jax.ppo.returns.masked_gae`). They run under this suite's JAX settings (float32,
rank promotion an error; tests/conftest.py).
"""

import doctest
import importlib
import inspect
import pkgutil

import pytest

from marft_jax import ppo

# Printed arrays line up their columns with spaces; the numbers are what is compared.
OPTIONS = doctest.NORMALIZE_WHITESPACE


def _modules():
  names = [info.name for info in pkgutil.iter_modules(ppo.__path__)]
  return [ppo] + [importlib.import_module(f"{ppo.__name__}.{name}") for name in sorted(names)]


def _examples() -> dict:
  """Dotted name -> doctest.DocTest, for every docstring of the package holding an example."""
  finder = doctest.DocTestFinder()
  return {test.name: test for module in _modules() for test in finder.find(module)
          if test.examples}


EXAMPLES = _examples()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example(name):
  report = []
  runner = doctest.DocTestRunner(optionflags=OPTIONS)
  # A fresh copy of the globals: an example must not lean on another's names.
  test = EXAMPLES[name]
  test = doctest.DocTest(test.examples, dict(test.globs), test.name, test.filename,
                         test.lineno, test.docstring)
  result = runner.run(test, out=report.append, clear_globs=True)
  assert result.attempted, f"{name}: no example ran"
  assert not result.failed, f"{name}:\n" + "".join(report)


def _exported_functions() -> dict:
  """Dotted name of each public function `marft_jax.ppo` exports -> its name there."""
  return {f"{fn.__module__}.{fn.__qualname__}": name for name, fn in vars(ppo).items()
          if inspect.isfunction(fn) and not name.startswith("_")}


def test_every_exported_function_has_an_example():
  exported = _exported_functions()
  assert len(exported) >= 30, sorted(exported)  # the export list itself was found
  missing = sorted(name for dotted, name in exported.items() if dotted not in EXAMPLES)
  assert not missing, f"exported from marft_jax.ppo without a `>>>` example: {missing}"
  # The package's own: token advantages -> clipped loss -> gradient (the README's).
  assert "marft_jax.ppo" in EXAMPLES
