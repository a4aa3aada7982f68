#!/usr/bin/env bash
# Install what is needed, then train a small model with DDP on 2 ranks via nbddp.launch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" examples/ddp_demo.py
