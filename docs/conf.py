"""Sphinx configuration of jdist's documentation site (`make docs`).

The pages are myst markdown (`docs/*.md`, one topic each: a page added there
appears in the guide's table of contents by itself), the API reference is
autodoc over the public names (`docs/api/*.rst`), and the tutorials are the
notebooks of `notebooks/` (`docs/notebooks` links to them), executed by
myst-nb and cached. `make docs` executes them; the suite's build
(`tests/test_docs.py`) passes `-D nb_execution_mode=off`, since the suite
runs the notebooks already.
"""

import importlib
import pathlib
import sys

from sphinx.util import logging

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jdist, installed or not

import jdist  # noqa: E402

project = "jdist"
author = "The jdist authors"
copyright = "2026, The jdist authors"
release = version = jdist.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints", "notebooks/*.py"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb",
                 ".ipynb": "myst-nb"}

html_theme = "sphinx_book_theme"
html_title = f"jdist {version}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}

# myst: `#` anchors for headings (pages link to each other's sections),
# and ```{directive} fences.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# Notebooks: executed when missing from the cache or changed, one at a time,
# in a scratch directory (they write checkpoints and logs); a cell that
# raises fails the build.
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "docs" / "_build" / ".jupyter_cache")
nb_execution_in_temp = True
nb_execution_timeout = 1800
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# API reference: Google-style docstrings, members in source order, the
# signature's types shortened.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a class's "Attributes:" as fields, not entries
# The docstrings quote names in single backticks, as markdown does.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_inherit_docstrings = False

# Submodules whose names are public too (jdist.losses & co. are also in
# jdist.__all__ as modules).
PUBLIC_SUBMODULES = ("jdist.cluster_resolver", "jdist.losses",
                     "jdist.metrics", "jdist.testing")


def _check_api_coverage(app, env):
  """Every public name has an entry in the API reference.

  The public names are `jdist.__all__` and the `__all__` of the public
  submodules; a warning (an error under `-W`) names those missing.
  """
  del app
  documented = set(env.get_domain("py").objects)
  public = [f"jdist.{name}" for name in jdist.__all__]
  for module in PUBLIC_SUBMODULES:
    public += [f"{module}.{name}"
               for name in importlib.import_module(module).__all__]
  missing = sorted(name for name in public if name not in documented)
  if missing:
    logging.getLogger(__name__).warning(
        "public names without an entry in docs/api/: %s (add an autoclass "
        "or autofunction to the page of their topic)", ", ".join(missing))


def setup(app):
  app.connect("env-check-consistency", _check_api_coverage)
