#!/usr/bin/env bash
# Build the documentation site (docs/ -> site/) with MkDocs in strict mode: any warning,
# such as a broken link or a reference to a name the API no longer has, fails the build.
# Extra arguments go to mkdocs, e.g. bash scripts/docs.sh --verbose
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install --quiet --disable-pip-version-check -e '.[docs]'
# Material for MkDocs prints a notice about its future on every build; it is no warning.
export NO_MKDOCS_2_WARNING=1
"$PY" -m mkdocs build --strict --site-dir site "$@"
