#!/usr/bin/env bash
# Install the test tools, then run the test suite and execute every notebook (nbval).
#   bash scripts/test.sh           the whole suite: lint, types, docs, tests, notebooks
#   bash scripts/test.sh --fast    the fast lane while working (about 2 minutes): lint,
#                                  and the tests marked `fast` (pure logic, a few launches)
# Extra arguments go to pytest, e.g. bash scripts/test.sh -k failures
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/install.sh dev
  "$PY" -m ruff check nbddp tests benchmarks examples
  exec "$PY" -m pytest tests -m fast "$@"
fi
bash scripts/install.sh dev,frameworks
# The real-browser test needs Debian's chromium (apt-get, as root) and JupyterLab;
# NBDDP_BROWSER_TESTS=0 skips installing them (the test then skips itself).
if [ "${NBDDP_BROWSER_TESTS:-1}" = 1 ]; then bash scripts/install-browser.sh; fi
# A real single-machine SLURM cluster (root, Debian packages), started from the shell
# (not under pytest) and stopped on exit; NBDDP_SLURM_TESTS=0 skips it.
if [ "${NBDDP_SLURM_TESTS:-1}" = 1 ]; then
  bash scripts/slurm-up.sh
  trap 'bash scripts/slurm-down.sh' EXIT
fi
"$PY" -m ruff check nbddp tests benchmarks examples
"$PY" -m mypy nbddp
PYTHON="$PY" bash scripts/docs.sh   # the docs site, strict: a broken reference fails
"$PY" -m pytest tests notebooks --nbval-lax "$@"
