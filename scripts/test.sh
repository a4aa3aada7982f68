#!/usr/bin/env bash
# Install the test tools, then run the test suite and execute every notebook (nbval).
# Extra arguments go to pytest, e.g. bash scripts/test.sh -k failures
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
PY=${PYTHON:-python3}
"$PY" -m ruff check nbddp tests benchmarks examples
"$PY" -m mypy nbddp
exec "$PY" -m pytest tests notebooks --nbval-lax "$@"
