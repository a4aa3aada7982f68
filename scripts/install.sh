#!/usr/bin/env bash
# Install nbddp (editable) into the current Python, with torch if it is missing.
# Usage: bash scripts/install.sh [extra]   e.g. "dev" for the test tools.
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
"$PY" -m pip install --quiet --disable-pip-version-check -e "$target"
