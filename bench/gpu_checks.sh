#!/usr/bin/env bash
# What to run on a lent GPU (one device, one rank), in one go, most wanted first: the context-
# parallel attention kernel families on the real kernels (seconds), the memory bench at Llama 3 8B
# layer shapes (estimate vs the caching allocator, hp vs FSDP2; bench_memory_cuda.py), the CUDA
# tests (activation memory, then codegen), and with HP_GPU_CODEGEN_BENCH=1 the codegen bench
# against FSDP2 eager/compiled and the unsharded model eager/compiled.
# Usage: bash bench/gpu_checks.sh OUT_DIR   (writes log.txt, the benches' JSON, a profiler trace and
# one region's generated Triton code there). Each part has its own time limit so one that hangs
# leaves the others their time.
set -uo pipefail
out="${1:?usage: bash bench/gpu_checks.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYPER_PARALLEL_LOG=quiet HP_GPU_TRACE_OUT="$out/trace_inductor_step.json"
exec > >(tee "$out/log.txt") 2>&1
python3 -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_attention_ops.py
echo "attention kernel families (context parallelism) rc=$?"
timeout 240 python3 bench/bench_memory_cuda.py --timeout 90 --json-out "$out/bench_memory_cuda.json"
echo "memory bench rc=$?"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_activation_memory.py
echo "activation memory tests rc=$?"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider --basetemp=/tmp/hp_gpu tests/gpu/test_cuda_codegen.py
echo "codegen tests rc=$?"
cp "$(ls /tmp/hp_gpu/*/rank0/inductor.backward.region*.py 2>/dev/null | head -1)" "$out/" 2>/dev/null
if [[ "${HP_GPU_CODEGEN_BENCH:-0}" == 1 ]]; then
    timeout 260 python3 bench/bench_codegen.py --device cuda --world 1 --hidden 1024 --intermediate 2816 \
        --layers 4 --heads 16 --kv-heads 8 --vocab 32000 --seq-len 1024 --batch 8 --steps 10 --warmup 3 \
        --threads 8 --mixed-precision bf16 --compiled-peers --json-out "$out/bench_codegen_cuda.json"
    echo "codegen bench rc=$?"
fi
