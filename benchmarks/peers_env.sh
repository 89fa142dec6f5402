#!/usr/bin/env bash
# Make the environment `run.py peers` runs in: benchmarks/.peers-venv (git-ignored).
#
# The peers (nbdistributed 0.1.0, accelerate) go into this venv only, never into the
# project's dependencies. The venv sees the base interpreter's packages
# (--system-site-packages), so torch, ipyparallel and jupyter_client are reused, not
# downloaded again; ddp_notebook is installed editable from this checkout.
#
#     bash benchmarks/peers_env.sh && benchmarks/.peers-venv/bin/python benchmarks/run.py peers
#
# Set PYTHON=... to choose the base interpreter (default: python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
venv="$here/.peers-venv"
base="${PYTHON:-python3}"
# the CPU build, pinned: an unpinned torch from PyPI pulls several GB of CUDA libraries
torch_pin="torch==2.13.0"

if [ ! -x "$venv/bin/python" ]; then
    "$base" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"

if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install --quiet "$torch_pin" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# ddp_notebook's own dependencies come from the base interpreter (or its pyproject)
"$py" -m pip install --quiet -e "$root"
# nbdistributed 0.1.0 declares the `jupyter` metapackage (notebook, jupyterlab, ...) but
# imports only IPython, zmq and torch, which are here already
"$py" -m pip install --quiet --no-deps "nbdistributed==0.1.0"
"$py" -m pip install --quiet accelerate "$torch_pin"
"$py" -m pip install --quiet "jupyter_client>=8" "ipykernel>=6" ipyparallel
"$py" - <<'EOF'
from importlib import metadata
for name in ("torch", "ipyparallel", "ddp_notebook", "nbdistributed", "accelerate", "jupyter_client", "ipykernel"):
    print(f"{name:15} {metadata.version(name)}")
EOF
echo
echo "ready; run:  $venv/bin/python $here/run.py peers"
