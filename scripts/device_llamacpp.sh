#!/usr/bin/env bash
# On the GPU device machine: llama.cpp with CUDA (sm_90) from the llama-cpp-python 0.3.36 sources, carried as
# .lcpp/llamacpp-src.tar.xz (its vendor/llama.cpp without models/, docs/ and the web UI's sources: see
# docs/benchmarks.md). It builds llama.cpp's unified binary `llama` (subcommands `bench` and `serve`), one static
# file, and puts two launchers beside it: bin/llama-bench and bin/llama-server.
# `start` unpacks a binary carried as .lcpp/llama.xz (from an earlier `pack`), or the older llama-bench-only
# .lcpp/llama-bench.xz, or launches the build in its own process session, so it outlives the call that started it
# (a warm machine keeps /tmp between calls); `wait` blocks until the binaries exist or the build failed; `pack`
# writes the stripped `llama`, xz-compressed, to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=/tmp/llamacpp; BUILD=/tmp/llamacpp-build; LOG=/tmp/llamacpp-build.log

launchers() {  # llama-bench and llama-server as the unified binary's subcommands
    printf '#!/bin/sh\nexec "%s/bin/llama" bench "$@"\n' "$BUILD" > "$BUILD/bin/llama-bench"
    printf '#!/bin/sh\nexec "%s/bin/llama" serve "$@"\n' "$BUILD" > "$BUILD/bin/llama-server"
    chmod +x "$BUILD/bin/llama-bench" "$BUILD/bin/llama-server"
}

case "${1:-start}" in
start)
    [ -x "$BUILD/bin/llama-bench" ] && { echo "llama.cpp already built"; exit 0; }
    [ -x "$BUILD/bin/llama" ] && { launchers; echo "llama.cpp already built"; exit 0; }
    # A build an earlier call (or stage) started is still running: a second start must not unpack over it.
    [ -f "$LOG" ] && ! grep -q "build-rc=" "$LOG" && { echo "llama.cpp build in progress (log $LOG)"; exit 0; }
    mkdir -p "$BUILD/bin"
    if [ -f .lcpp/llama.xz ]; then
        xz -dc .lcpp/llama.xz > "$BUILD/bin/llama" && chmod +x "$BUILD/bin/llama" && launchers
        echo "llama unpacked from .lcpp/llama.xz (bench and serve)"; exit 0
    fi
    if [ -f .lcpp/llama-bench.xz ]; then
        xz -dc .lcpp/llama-bench.xz > "$BUILD/bin/llama-bench" && chmod +x "$BUILD/bin/llama-bench"
        echo "llama-bench unpacked from .lcpp/llama-bench.xz (no llama-server in it)"; exit 0
    fi
    mkdir -p "$SRC" && tar xJf .lcpp/llamacpp-src.tar.xz -C "$SRC" || { echo "no llama.cpp sources carried"; exit 1; }
    setsid bash -c "cmake -S $SRC/llama.cpp -B $BUILD -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
        -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        && cmake --build $BUILD --target llama-app -j \$(nproc); echo build-rc=\$?" > "$LOG" 2>&1 < /dev/null &
    echo "llama.cpp build started (log $LOG)";;
wait)
    for _ in $(seq 1 "${2:-540}"); do
        if [ -x "$BUILD/bin/llama" ]; then launchers; echo "llama.cpp ready (llama-bench, llama-server)"; exit 0; fi
        [ -x "$BUILD/bin/llama-bench" ] && { echo "llama-bench ready"; exit 0; }
        grep -q "build-rc=" "$LOG" 2>/dev/null && break
        sleep 1
    done
    echo "llama.cpp not built:"; tail -20 "$LOG"; exit 1;;
pack)
    strip "$BUILD/bin/llama" && xz -T0 -6 -c "$BUILD/bin/llama" > "$OUT/llama.xz" && ls -la "$OUT";;
esac
