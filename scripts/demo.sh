#!/usr/bin/env bash
# Train the example Llama model on 4 local processes: sets up ./.venv on first use, then
# torchrun.  Extra arguments go to examples/train_llama.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venv.sh

exec .venv/bin/torchrun --nproc-per-node 4 examples/train_llama.py "$@"
