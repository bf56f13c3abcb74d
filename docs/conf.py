"""Sphinx configuration of the marft_jax documentation.

Build: `pip install -e ".[docs]"`, then `python -m sphinx -W --keep-going -b html docs
docs/_build/html` (warnings are errors; tests/test_docs.py runs the same build).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # autodoc imports marft_jax from the checkout
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

import marft_jax  # noqa: E402

project = "marft_jax"
author = "The marft_jax authors"
copyright = "The marft_jax authors"  # noqa: A001 - Sphinx's name for it
release = marft_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "plain_docstrings",  # docs/_ext: the docstrings' plain text, read as such
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "results/**", "default_run/**"]
# `name` in a docstring is code, as in the Markdown pages.
default_role = "code"

# MyST: $...$ / $$...$$ maths, ::: fences, and anchors for every heading down to ###, so
# pages can link `page.md#section`.
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# autodoc: the docstrings are Google style (Args:, Returns:, Raises:), read by napoleon.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# The configuration reference (config.md) is generated from TrainConfig's field comments by
# its own tool; until that has written it, the guide's toctree skips its entry.
HERE = os.path.dirname(os.path.abspath(__file__))
suppress_warnings = [] if os.path.exists(os.path.join(HERE, "config.md")) else ["toc.not_readable"]

html_theme = "furo"
html_title = f"marft_jax {release}"
