#!/usr/bin/env bash
# Install what the real-browser test (tests/test_browser.py, marker "browser") needs:
# Debian's chromium, and JupyterLab + Playwright's Python package in the current Python.
# Playwright drives the system browser (/usr/bin/chromium); its own browser download
# (`playwright install`) is never run.
# Usage: bash scripts/install-browser.sh      (root, or sudo available, for apt-get)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore

if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends chromium fonts-liberation
fi

"$PY" -m pip install --quiet --disable-pip-version-check jupyterlab playwright
