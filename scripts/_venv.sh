# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/demo.sh (and, through test.sh, by .ci/run).
# Creates ./.venv if needed and installs the project into it:
#   1. torch==2.13.0 first (the local CPU wheel where one is configured; a bare version range
#      could resolve to a multi-GB CUDA build),
#   2. then `pip install -e '.[dev]'`.
# Idempotent: a stamp in .venv records what was installed; the installation is redone only when
# pyproject.toml, the torch spec or the interpreter changed, or after an interrupted install.
# Env knobs: HP_PYTHON (interpreter for a new venv), HP_TORCH_SPEC (default torch==2.13.0),
# HP_FRESH_VENV=1 (delete and recreate .venv).
set -euo pipefail

HP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HP_VENV="$HP_ROOT/.venv"
HP_TORCH_SPEC="${HP_TORCH_SPEC:-torch==2.13.0}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

_hp_pick_python() {
    if [[ -n "${HP_PYTHON:-}" ]]; then echo "$HP_PYTHON"
    elif command -v python3.11 >/dev/null 2>&1; then echo python3.11
    else echo python3
    fi
}

_hp_stamp() {
    {
        cat "$HP_ROOT/pyproject.toml"
        echo "$HP_TORCH_SPEC"
        "$HP_VENV/bin/python" -c 'import sys; print(sys.version)'
    } | "$HP_VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

hp_ensure_venv() {
    if [[ "${HP_FRESH_VENV:-0}" == "1" ]]; then
        rm -rf "$HP_VENV"
    fi
    if [[ ! -x "$HP_VENV/bin/python" ]]; then
        local py
        py="$(_hp_pick_python)"
        if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
            echo "error: $py is missing or older than Python 3.10 (set HP_PYTHON)" >&2
            return 1
        fi
        echo "creating $HP_VENV with $("$py" --version 2>&1)" >&2
        rm -rf "$HP_VENV"
        "$py" -m venv "$HP_VENV"
    fi
    local stamp_file="$HP_VENV/.hp-install-stamp" stamp
    stamp="$(_hp_stamp)"
    if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
        return 0
    fi
    rm -f "$stamp_file"
    echo "installing hyper_parallel into $HP_VENV ($HP_TORCH_SPEC, then -e .[dev]) ..." >&2
    (
        cd "$HP_ROOT"
        "$HP_VENV/bin/python" -m pip install -q "$HP_TORCH_SPEC" </dev/null
        "$HP_VENV/bin/python" -m pip install -q -e '.[dev]' </dev/null
    )
    echo "$stamp" >"$stamp_file"
}

hp_ensure_venv
