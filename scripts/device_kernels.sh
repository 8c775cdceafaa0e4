#!/usr/bin/env bash
# Here, without a GPU: the cuda kernels (PTX for sm_90) of the device check's runs, compiled into a kernel cache
# and packed as .kcache/cuda.tar.xz (ignored by git), which scripts/device_check.sh unpacks into its kernel cache.
# A cold device machine then compiles nothing it was given: NVVM's work, minutes of a 10-minute call, is done here.
# Each run's plans must match the device's exactly (the attention kernels depend on the context: bench's -c is
# depth + max(p, n); serve_bench's is --parallel x --slot-ctx), so the list below follows device_check.sh's stages.
#   bash scripts/device_kernels.sh            (POLYSTRATA_HOME: a scratch home, default /tmp/ps_kernels)
set -euo pipefail
cd "$(dirname "$0")/.."
export POLYSTRATA_HOME="${POLYSTRATA_HOME:-/tmp/ps_kernels}" POLYSTRATA_COMPILE_JOBS="${POLYSTRATA_COMPILE_JOBS:-2}"
PY="${PYTHON:-python3}"
M="${MODELS:-/tmp/models}"; mkdir -p "$M" .kcache
synth() {  # synth NAME ARGS...: a preset model, made once
    [ -f "$M/$1.gguf" ] || "$PY" -m polystrata synth "${@:2}" -o "$M/$1.gguf" > /dev/null
}
synth llama3-8b-q4km --arch llama --preset llama3-8b --type Q4_K_M
synth qwen3moe-8l-q4km --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --type Q4_K_M
# Four layers hold every kernel of the whole model (three Gated DeltaNet layers and one gated attention layer).
synth qwen36-4l-q4km --arch qwen35moe --preset qwen3.6-35b-a3b --layers 4 --type Q4_K_M
while read -r model args; do
    [ -n "$model" ] || continue
    echo "$model $args"
    # shellcheck disable=SC2086
    "$PY" -m polystrata compile "$M/$model.gguf" --target cuda --arch sm_90 $args -o "$POLYSTRATA_HOME/art" 2>&1 \
        | grep -v "^compiling kernels"
done <<LIST
llama3-8b-q4km -c 512
llama3-8b-q4km -c 512 --knob attention.q_tile=32
llama3-8b-q4km -c 512 --knob matmul.mma_tokens=64
llama3-8b-q4km -c 512 -ub 512
llama3-8b-q4km -c 4096
llama3-8b-q4km -c 4096 --knob attention.q_tile=32
llama3-8b-q4km -c 4096 -ub 512
llama3-8b-q4km -c 4096 --knob attention.tile_splits=4
llama3-8b-q4km -c 512 --knob attention.tile_splits=4
llama3-8b-q4km -c 512 --knob matmul.reuse=1
llama3-8b-q4km -c 8192 -np 16
llama3-8b-q4km -c 8192 -np 16 --knob matmul.reuse=1
llama3-8b-q4km -c 8192 -np 16 --knob matmul.mma_split=4
llama3-8b-q4km -c 8192 -np 16 --knob matmul.mma_split=8
llama3-8b-q4km -c 8192 -np 16 --knob matmul.mma_chunk=64
llama3-8b-q4km -c 8224
llama3-8b-q4km -c 8224 --kv-type q8_g64
llama3-8b-q4km -c 32800
llama3-8b-q4km -c 32800 --kv-type q8_g64
qwen3moe-8l-q4km -c 512
qwen36-4l-q4km -c 512
LIST
"$PY" scripts/cuda_selftest.py --compile-only sm_90  # the selftest's own kernels
# The tile-product variants of docs/benchmarks.md's "Why the tile kernel was slow" (matvec_bench on the device).
mv="$PY scripts/matvec_bench.py --target cuda --arch sm_90 --tokens 512 --knob matmul.mma_min=512"
for knobs in "" "--knob matmul.mma_words=0" "--knob matmul.mma_chunk=64" "--knob matmul.mma_chunk=256" \
        "--knob matmul.mma_tokens=64" "--knob matmul.mma_rows=128 --knob matmul.mma_lanes=256"; do
    $mv --rows 14336 --cols 4096 $knobs
done
$mv --rows 4096 --cols 14336
"$PY" scripts/matvec_bench.py --target cuda --arch sm_90 --tokens 512 --rows 14336 --cols 4096  # the int8 matvecs
for knobs in "" "--knob matmul.mma_split=4" "--knob matmul.mma_split=8"; do  # the serve stage's 16-row matmuls
    "$PY" scripts/matvec_bench.py --target cuda --arch sm_90 --tokens 16 --rows 14336 --cols 4096 $knobs
done
tar cJf .kcache/cuda.tar.xz -C "$POLYSTRATA_HOME/kernels" cuda
ls -la .kcache/cuda.tar.xz
