#!/usr/bin/env bash
# On the GPU device machine: build llama.cpp's llama-bench with CUDA (sm_90) from the llama-cpp-python 0.3.36
# sources, carried as .lcpp/llamacpp-src.tar.xz (its vendor/llama.cpp without models/ and docs/: see
# docs/benchmarks.md), as one static binary. `start` unpacks a binary carried as .lcpp/llama-bench.xz (from an
# earlier `pack`) or launches the build in its own process session, so it outlives the call that started it (a warm
# machine keeps /tmp between calls); `wait` blocks until bin/llama-bench exists or the build failed; `pack` writes
# the stripped binary, xz-compressed, to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=/tmp/llamacpp; BUILD=/tmp/llamacpp-build; LOG=/tmp/llamacpp-build.log
case "${1:-start}" in
start)
    [ -x "$BUILD/bin/llama-bench" ] && { echo "llama-bench already built"; exit 0; }
    if [ -f .lcpp/llama-bench.xz ]; then
        mkdir -p "$BUILD/bin" && xz -dc .lcpp/llama-bench.xz > "$BUILD/bin/llama-bench" && chmod +x "$BUILD/bin/llama-bench"
        echo "llama-bench unpacked from .lcpp/llama-bench.xz"; exit 0
    fi
    mkdir -p "$SRC" && tar xJf .lcpp/llamacpp-src.tar.xz -C "$SRC" || { echo "no llama.cpp sources carried"; exit 1; }
    setsid bash -c "cmake -S $SRC/llama.cpp -B $BUILD -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
        -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        && cmake --build $BUILD --target llama-bench -j \$(nproc); echo build-rc=\$?" > "$LOG" 2>&1 < /dev/null &
    echo "llama.cpp build started (log $LOG)";;
wait)
    for _ in $(seq 1 "${2:-540}"); do
        [ -x "$BUILD/bin/llama-bench" ] && { echo "llama-bench ready"; exit 0; }
        grep -q "build-rc=" "$LOG" 2>/dev/null && break
        sleep 1
    done
    echo "llama-bench not built:"; tail -20 "$LOG"; exit 1;;
pack)
    strip "$BUILD/bin/llama-bench" && xz -T0 -6 -c "$BUILD/bin/llama-bench" > "$OUT/llama-bench.xz" && ls -la "$OUT";;
esac
