#!/usr/bin/env bash
# Run the test suite: sets up ./.venv on first use (see scripts/_venv.sh), then pytest.
# Extra arguments go to pytest.  Fails if pytest collects no tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh

rc=0
.venv/bin/python -m pytest -q "$@" </dev/null || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
