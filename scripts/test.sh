#!/usr/bin/env bash
# Run the test suite: sets up ./.venv on first use (see scripts/_venv.sh), then pytest.
#   bash scripts/test.sh [ARGS...]          the whole suite (CI runs it without arguments)
#   bash scripts/test.sh --fast [ARGS...]   the tests that start no process pool and take at most
#                                           5 s each (pytest -m "not pool and not slow", see
#                                           tests/conftest.py)
# Extra arguments go to pytest.  Fails if pytest collects no tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh

tier=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    tier=(-m "not pool and not slow")
fi

rc=0
.venv/bin/python -m pytest -q ${tier[@]+"${tier[@]}"} "$@" </dev/null || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
