#!/usr/bin/env bash
# Install nbddp (editable) into the current Python, with torch if it is missing.
# Usage: bash scripts/install.sh [extras]   e.g. "dev" for the test tools, "dev,frameworks".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch" 2>/dev/null; then
  # The CPU wheel; any unpinned torch pulls a multi-GB CUDA build.
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
target="."
[ $# -gt 0 ] && target=".[$1]"
# The torch already installed, named on the same line: frameworks that depend on torch
# (Lightning) install beside it instead of pulling another build.
torch_here=$("$PY" -c "import torch; print(torch.__version__)")
"$PY" -m pip install --quiet --disable-pip-version-check -e "$target" "torch==$torch_here"
