"""Sphinx configuration of the docs site: python3 docs/build.py builds it (see that file).

The source folder is the repository itself, so README.md, docs/*.md and notebooks/*.ipynb are
pages as they are (their links work as on GitHub); only the files below are read.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_docs import PLOTLY_JS

from ddp_notebook import __version__

project = "ddp_notebook"
release = __version__
root_doc = "docs/index"
include_patterns = [
    "README.md",
    "docs/*.md",
    "notebooks/*.ipynb",
    "benchmarks/README.md",
    "benchmarks/results/*.md",
]
# folders never worth walking into
exclude_patterns = [".*", "**/.*", "build", "test-artifacts", "benchmarks/.peers-venv", "*.egg-info"]

extensions = ["myst_nb", "sphinx.ext.autodoc", "ddp_docs"]

# the notebooks' outputs come from their executed copies (docs/build.py, tests/conftest.py)
nb_execution_mode = "off"
ddp_executed_notebooks = ""
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
# names a module imports for its annotations only (errors.py may import nothing of the package)
autodoc_type_aliases = {"Death": "ddp_notebook.wire.results.Death"}
# every reference must resolve, except to the libraries ddp_notebook builds on, whose docs are
# not fetched (the build reads nothing from the network)
nitpicky = True
# a Progress bar's channel is internal: the rank makes it, nobody passes one
nitpick_ignore = [("py:class", "Channel")]
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|ipyparallel|IPython|traitlets|numpy|pandas|zmq|psutil|ipywidgets|plotly)(\..*)?"),
    (r"py:.*", r"(abc|collections\.abc|typing|pathlib|subprocess|threading|os|io|datetime|enum)\..*"),
]

html_theme = "furo"
html_title = f"ddp_notebook {release}"
html_show_copyright = False
html_static_path = [str(PLOTLY_JS)]
html_css_files: list[str] = []
