#!/usr/bin/env bash
# Install the test tools, then run the test suite and execute every notebook (nbval).
#   bash scripts/test.sh           the whole suite: lint, types, docs, tests, notebooks
#                                  (pytest in two lanes at once, see tests/conftest.py)
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
bash scripts/install.sh dev,frameworks,ray
# This run may not skip a cluster or tool it installs: a Ray, SLURM or browser test that
# finds its cluster or tool missing fails, with the reason (tests/conftest.py).
require=ray
# The real-browser test needs Debian's chromium (apt-get, as root) and JupyterLab;
# NBDDP_BROWSER_TESTS=0 skips installing them (the test then skips itself).
if [ "${NBDDP_BROWSER_TESTS:-1}" = 1 ]; then
  bash scripts/install-browser.sh
  require=$require,browser
fi
# A real single-machine SLURM cluster (root, Debian packages), started from the shell
# (not under pytest) and stopped on exit; NBDDP_SLURM_TESTS=0 skips it.
if [ "${NBDDP_SLURM_TESTS:-1}" = 1 ]; then
  bash scripts/slurm-up.sh
  trap 'bash scripts/slurm-down.sh' EXIT
  require=$require,slurm
fi
export NBDDP_REQUIRE=${NBDDP_REQUIRE-$require}
"$PY" -m ruff check nbddp tests benchmarks examples
"$PY" -m mypy nbddp
PYTHON="$PY" bash scripts/docs.sh   # the docs site, strict: a broken reference fails
# Two lanes at once (see tests/conftest.py): the tests that mostly wait run beside those
# that keep the cores busy. NBDDP_TEST_LANES=1 runs everything in one pytest process.
if [ "${NBDDP_TEST_LANES:-2}" = 1 ]; then
  "$PY" -m pytest tests notebooks --nbval-lax "$@"  # not exec: the EXIT trap stops SLURM
  exit 0
fi
# Each lane's pytest ends with its own time ("in 3017.44s"); the tests' time in all is
# said at the end.
started=$SECONDS
echo "--- the busy lane (the waiting lane runs beside it; its output follows) ---"
waiting_log=$(mktemp)
NBDDP_TEST_LANE=waiting "$PY" -m pytest tests notebooks --nbval-lax "$@" >"$waiting_log" 2>&1 &
waiting=$!
NBDDP_TEST_LANE=busy "$PY" -m pytest tests notebooks --nbval-lax "$@" &
busy=$!
# Ctrl-C in a terminal reaches both lanes with this shell (one process group; the lanes,
# started in the background, would ignore SIGINT, but the suite's conftest restores
# Python's handler); a stop (SIGTERM) is passed on to them as an interrupt.
trap 'kill -INT $waiting $busy 2>/dev/null' INT TERM
status=0
for lane in $busy $waiting; do
  wait $lane || { s=$?; [ $s = 5 ] || status=$s; }  # 5: -k/-m left this lane no test
done
wait || true  # after a Ctrl-C, both lanes are gone before this returns
echo "--- the waiting lane (run beside the one above) ---"
cat "$waiting_log"
rm -f "$waiting_log"
echo "both lanes: $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
exit $status
