#!/usr/bin/env bash
# On the GPU device machine (H200): install the carried wheels, run the GPU conformance checks, model parity and
# the benchmarks, and print a short table last. Run from the repository root with the wheels in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl numpy==2.4.4 \
#       pyopencl pytools platformdirs siphash24 gguf   (see docs/benchmarks.md)
# Stages (default: all but receive, attention, depth, moe, hostprof, serve, qwen36, prefill and tune): receive
# selftest tests parity bench attention depth moe hostprof serve qwen36 prefill tune.
# Example: scripts/device_check.sh bench
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES="${*:-selftest tests parity bench}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/device_check.log"
# PYTHONSAFEPATH: the source tree's polystrata/ must not shadow the installed package (ir/, codegen/ map into it).
# POLYSTRATA_PROGRESS: progress lines in the log even from `--json` runs, so a timed-out run shows how far it got.
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 POLYSTRATA_HOME=/tmp/ps_home NCCL_NVLS_ENABLE=0 POLYSTRATA_PROGRESS=1

# numpy 2.5 breaks numba-cuda (np.row_stack is gone): the carried 2.4 wheel goes first on the path.
# A warm machine keeps /tmp/site between calls, so a later call (one carrying model parts) may leave .whl behind.
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
elif [ ! -f /tmp/site/numpy/__init__.py ]; then
    echo "no wheels in .whl/ and none installed in /tmp/site"; exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/site . > /dev/null \
    || { echo "project install failed"; exit 1; }
export PYTHONPATH=/tmp/site
# Kernels compiled without a GPU (scripts/device_kernels.sh, carried as .kcache): the runs below load their PTX.
if [ -f .kcache/cuda.tar.xz ]; then
    mkdir -p "$POLYSTRATA_HOME/kernels" && tar xJf .kcache/cuda.tar.xz --skip-old-files -C "$POLYSTRATA_HOME/kernels"
fi
# NVIDIA's OpenCL driver is there but not registered with the ICD loader.
mkdir -p /etc/OpenCL/vendors && echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
python3 -c "import numpy, numba, numba_cuda; print('numpy', numpy.__version__, 'numba', numba.__version__)" | tee -a "$LOG"
python3 -c "from polystrata.targets import available_kernel_targets as a; print('targets', a())" | tee -a "$LOG"

SUMMARY="$OUT/summary.txt"; : > "$SUMMARY"

# The synthetic preset models the benchmark stages share, made once a machine (a warm one keeps /tmp between calls).
M=/tmp/models; mkdir -p "$M"
preset_model() {
    [ -f "$M/$1.gguf" ] && return 0
    case "$1" in
        llama3-8b-q4km) python3 -m polystrata synth --arch llama --preset llama3-8b --type Q4_K_M -o "$M/$1.gguf" ;;
        qwen3moe-8l-q4km) python3 -m polystrata synth --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --type Q4_K_M \
            -o "$M/$1.gguf" ;;
        *) echo "no preset model $1"; return 1 ;;
    esac 2>> "$LOG"
}
row() { printf '%-34s %s\n' "$1" "$2" | tee -a "$SUMMARY"; }
# A summary row of a `bench --json` file's prefill test: pp_row FILE LABEL.
pp_row() {
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['pp']; print(f\"{sys.argv[2]:34s} {r['tok_s_mean']:.0f}±{r['tok_s_sd']:.0f} tok/s\")" \
        "$1" "$2" | tee -a "$SUMMARY"
}

# Model parts (scripts/device_models.sh) are kept outside the checkout: a later call's carry replaces .models/.
PARTS=/tmp/model_parts
if [[ " $STAGES " == *" receive "* ]]; then
    mkdir -p "$PARTS" && cp .models/* "$PARTS"/ 2>/dev/null
    echo "received: $(cd "$PARTS" && ls | tr '\n' ' ')" | tee -a "$LOG"
fi

if [[ " $STAGES " == *" selftest "* ]]; then
    python3 scripts/cuda_selftest.py ${SELFTEST_ARGS:-} 2>&1 | tee -a "$LOG" | tail -25  # e.g. --no-cpu
    row "cuda selftest" "exit ${PIPESTATUS[0]}"
fi

if [[ " $STAGES " == *" tests "* ]]; then
    # Conformance on every target present: cpu, cuda, hip (NVRTC), opencl (NVIDIA's driver); the recipes one by one
    # (they name the failing kernel), then whole models, and batched steps (CUDA graphs of each plan and row count).
    # TESTS_K narrows the selection (pytest -k), e.g. "not cpu".
    timeout 1500 python3 -m pytest -q -x -p no:cacheprovider tests/test_recipes_*.py tests/test_targets.py \
        tests/test_target_hip.py tests/test_batch.py -m "not slow" ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
        | tee -a "$LOG" | tail -15
    row "tests (recipes, targets, hip, batch)" "$(grep -E '[0-9]+ (passed|failed)' "$LOG" | tail -1)"
    # The memory manager on cuda: expert streaming bit-identical to the resident run for every policy, the guard.
    POLYSTRATA_MEMORY_TARGET=cuda timeout 900 python3 -m pytest -q -x -p no:cacheprovider tests/test_memory.py \
        2>&1 | tee "$OUT/memory.log" | tail -5
    row "tests (memory manager, cuda)" "$(grep -E '[0-9]+ (passed|failed)' "$OUT/memory.log" | tail -1)"
fi

if [[ " $STAGES " == *" parity "* ]]; then
    # The real models travel as parts of one stream (scripts/device_models.sh, then the receive stage over
    # consecutive calls); `layout` names the files the stream holds, back to back, and their sizes. They go into
    # the zoo's cache, where the zoo checks their pinned sha256 before use; llama.cpp's fixtures are in the repo.
    mkdir -p "$POLYSTRATA_HOME/models"
    if [ -f "$PARTS/layout" ] && compgen -G "$PARTS/part-*" > /dev/null; then
        cat "$PARTS"/part-* > /tmp/models.stream
        off=0
        while read -r f size; do
            tail -c +$((off + 1)) /tmp/models.stream | head -c "$size" > "$POLYSTRATA_HOME/models/$f"
            off=$((off + size))
        done < "$PARTS/layout"
        rm -f /tmp/models.stream
    fi
    for entry in smollm2-135m:smollm2 gemma3-270m:gemma3; do
        name=${entry%%:*}
        python3 -c "import sys; from polystrata.zoo import is_cached; sys.exit(not is_cached('$name'))" 2>/dev/null \
            || { echo "parity $name: model not carried (or its sha256 is wrong)" | tee -a "$LOG"; continue; }
        for t in cuda hip opencl; do
            timeout 600 python3 -m polystrata parity "$name" --fixtures "tests/data/fixtures/reference/${entry##*:}" \
                --target "$t" 2>&1 | tee -a "$LOG" | tail -3
        done
        # Quantized KV on cuda against its own f16 KV and against the reference executor (split rows and int8 q
        # in the scores where they apply; docs/benchmarks.md, "Quantized KV on the GPU plans", has opencl's beside).
        timeout 600 python3 scripts/kv_parity.py "$name" --target cuda 2>&1 | tee -a "$LOG" | grep "^kv_parity"
    done
    grep -E "^(kv_)?parity" "$LOG" | while read -r line; do row "${line%%:*}" "${line#*:}"; done
fi

if [[ " $STAGES " == *" bench "* ]]; then
    # BENCH_MODELS narrows the models; BENCH_PARTS the parts ("matvec profile bench", all by default).
    BENCH_MODELS=${BENCH_MODELS:-llama3-8b-q4km qwen3moe-8l-q4km}; BENCH_PARTS=${BENCH_PARTS:-matvec profile bench}
    for m in $BENCH_MODELS; do preset_model "$m"; done
    if [[ " $BENCH_PARTS " == *" matvec "* ]]; then
        for t in cuda hip opencl; do python3 scripts/matvec_bench.py --target "$t" 2>&1 | tee -a "$LOG" | tail -2; done
        # Q6_K in the qwen3-30b-a3b output head's shape (cuda keeps Q6_K in 224-byte blocks: ir.layout.padded).
        python3 scripts/matvec_bench.py --target cuda --format Q6_K --rows 49152 --cols 2048 2>&1 | tee -a "$LOG" | tail -2
    fi
    # MATVEC_KNOBS: extra cuda runs with knob overrides, one run per space-separated item, several knobs of a run
    # joined by commas, e.g. "matmul.rows=4 matmul.sub=8,matmul.lanes=448".
    [[ " $BENCH_PARTS " == *" matvec "* ]] && for kn in ${MATVEC_KNOBS:-}; do
        args=(); IFS=, read -ra ks <<< "$kn"; for k in "${ks[@]}"; do args+=(--knob "$k"); done
        python3 scripts/matvec_bench.py --target cuda "${args[@]}" 2>&1 | tee -a "$LOG" | grep '^matvec'
    done
    grep -E '^matvec' "$LOG" | while read -r line; do row "${line%% on *}" "${line#*on }"; done
    for m in $BENCH_MODELS; do
        # --trace (device times of graph-replayed steps) where torch's CUPTI profiler is there; else timed launches.
        TRACE=$(python3 -c "import torch" 2>/dev/null && [ "${BENCH_TARGET:-cuda}" = cuda ] && echo --trace)
        [[ " $BENCH_PARTS " == *" profile "* ]] && timeout 300 python3 scripts/profile_decode.py "$M/$m.gguf" \
            --target "${BENCH_TARGET:-cuda}" $TRACE --top ${PROFILE_TOP:-12} 2>&1 | tee -a "$LOG" | tail -${PROFILE_TOP:-12}
        [[ " $BENCH_PARTS " == *" bench "* ]] || continue
        # BENCH_ARGS shortens the run when device time is short (e.g. "-p 128 -n 32 -r 1").
        timeout 900 python3 -m polystrata bench "$M/$m.gguf" --target "${BENCH_TARGET:-cuda}" ${BENCH_ARGS:--p 512 -n 128 -r 3} \
            --json > "$OUT/bench_$m.json" 2>> "$LOG"
        python3 - "$OUT/bench_$m.json" "$m" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
pp, tg = r["pp"], r["tg"]
print(f"{sys.argv[2]:34s} pp{pp['n']} {pp['tok_s_mean']:.0f}±{pp['tok_s_sd']:.0f}  tg{tg['n']} {tg['tok_s_mean']:.0f}±{tg['tok_s_sd']:.0f} tok/s"
      f"  {r['bytes_per_token']/2**30:.2f} GiB/token  roofline {r['roofline_pct'] or 0:.0f}%  host {r.get('host_ms_per_token', 'n/a')} ms/token")
EOF
    done
fi

if [[ " $STAGES " == *" qwen36 "* ]]; then
    # Issue 23's benchmark (not among the default stages): the qwen3.6-35b-a3b preset (Qwen3.6-35B-A3B's shape,
    # every layer: 30 Gated DeltaNet and 10 gated attention, 256 experts; ~20 GB in Q4_K_M) decode and pp512 on
    # cuda, then llama-bench on the same file. QWEN36_ARGS shortens the PolyStrata run (e.g. "-p 512 -n 32 -r 1"),
    # QWEN36_LAYERS writes fewer layers, QWEN36_PARTS runs one side a call ("polystrata" or "llamacpp"; a warm
    # machine keeps the model in /tmp/models).
    PARTS36=" ${QWEN36_PARTS:-polystrata llamacpp} "
    [[ "$PARTS36" == *" llamacpp "* ]] && bash scripts/device_llamacpp.sh start >> "$LOG" 2>&1
    mm="$M/qwen36-35b-a3b${QWEN36_LAYERS:+-${QWEN36_LAYERS}l}-q4km.gguf"
    [ -f "$mm" ] || timeout 1200 python3 -m polystrata synth --arch qwen35moe --preset qwen3.6-35b-a3b --type Q4_K_M \
        ${QWEN36_LAYERS:+--layers "$QWEN36_LAYERS"} -o "$mm" 2>> "$LOG" || row "qwen3.6 synth" "failed (see the log)"
    ls -la "$mm" | tee -a "$LOG"
    if [[ "$PARTS36" == *" polystrata "* ]]; then
        if timeout 1500 python3 -m polystrata bench "$mm" --target "${BENCH_TARGET:-cuda}" \
                ${QWEN36_ARGS:--p 512 -n 128 -r 3} --json > "$OUT/bench_qwen36.json" 2>> "$LOG"; then
            python3 - "$OUT/bench_qwen36.json" <<'EOF2' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
pp, tg = r["pp"], r["tg"]
print(f"{'qwen3.6-35b-a3b q4km polystrata':34s} pp{pp['n']} {pp['tok_s_mean']:.0f}±{pp['tok_s_sd']:.0f}  tg{tg['n']} "
      f"{tg['tok_s_mean']:.1f}±{tg['tok_s_sd']:.1f} tok/s  roofline {r['roofline_pct'] or 0:.0f}%  host "
      f"{r.get('host_ms_per_token', 'n/a')} ms/token")
EOF2
        else
            row "qwen3.6 polystrata" "failed (exit $?, see the log)"
        fi
    fi
    if [[ "$PARTS36" == *" llamacpp "* ]]; then
        if bash scripts/device_llamacpp.sh wait 900 >> "$LOG" && timeout 600 /tmp/llamacpp-build/bin/llama-bench \
                -m "$mm" -p 512 -n 128 -r 3 -fa 1 -ngl 99 -o json > "$OUT/lcpp_qwen36.json" 2>> "$LOG"; then
            python3 - "$OUT/lcpp_qwen36.json" <<'EOF2' | tee -a "$SUMMARY"
import json, sys
for r in json.load(open(sys.argv[1])):
    test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    print(f"{'qwen3.6-35b-a3b q4km llama.cpp ' + test:34s} {r['avg_ts']:.1f}±{r['stddev_ts']:.1f} tok/s")
EOF2
        else
            row "qwen3.6 llama.cpp" "failed or not built (exit $?, see the log)"
        fi
    fi
fi

if [[ " $STAGES " == *" depth "* ]]; then
    # Decode after DEPTH tokens of context (llama-bench -d) on the llama3-8b preset, each KV cache type (f16, q8_0,
    # q8_g64 at 8192 and 32768; cuda keeps the q8 cache rows split into codes and scales). Issue 17's goal: q8_g64
    # at least as fast as f16 at 8192, >= 1.2x f16 at 32768. bench fills the depth from one prefilled chunk
    # (bench._fill_depth); DEPTHS / KV_TYPES / DEPTH_N / DEPTH_R narrow the stage.
    preset_model llama3-8b-q4km
    for dp in ${DEPTHS:-8192 32768}; do
        for kv in ${KV_TYPES:-f16 q8_0 q8_g64}; do
            timeout 420 python3 -m polystrata bench "$M/llama3-8b-q4km.gguf" --target "${BENCH_TARGET:-cuda}" -p 0 \
                -n "${DEPTH_N:-64}" -r "${DEPTH_R:-2}" -d "$dp" --kv-type "$kv" --json > "$OUT/depth_${dp}_$kv.json" \
                2>> "$LOG" || { row "llama3-8b @ d$dp $kv" "failed (exit $?, see the log)"; continue; }
            python3 - "$OUT/depth_${dp}_$kv.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
tg = r["tg"]
print(f"{'llama3-8b tg' + str(tg['n']) + ' @ d' + str(r['depth']) + ' ' + r['kv_type']:34s} "
      f"{tg['tok_s_mean']:.1f}±{tg['tok_s_sd']:.1f} tok/s  (n_ctx {r['n_ctx']}, host {r.get('host_ms_per_token')} ms/token)")
EOF
        done
        # The anchor in the same call: llama.cpp's decode at the same depth, flash attention, f16 and q8_0 KV
        # (LCPP_KV_TYPES=none: PolyStrata alone, e.g. while llama.cpp still builds).
        if [ "${LCPP_KV_TYPES:-}" != none ] && bash scripts/device_llamacpp.sh start >> "$LOG" 2>&1 && bash scripts/device_llamacpp.sh wait 540 >> "$LOG"; then
            for kv in ${LCPP_KV_TYPES:-f16 q8_0}; do
                timeout 300 /tmp/llamacpp-build/bin/llama-bench -m "$M/llama3-8b-q4km.gguf" -p 0 -n "${DEPTH_N:-64}" \
                    -r "${DEPTH_R:-2}" -d "$dp" -fa 1 -ctk "$kv" -ctv "$kv" -o json > "$OUT/lcpp_depth_${dp}_$kv.json" \
                    2>> "$LOG" || { row "llama.cpp @ d$dp $kv" "failed (exit $?)"; continue; }
                python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print(f\"{'llama.cpp tg' + str(r['n_gen']) + ' @ d' + sys.argv[2] + ' ' + sys.argv[3]:34s} {r['avg_ts']:.1f}±{r['stddev_ts']:.1f} tok/s\")" \
                    "$OUT/lcpp_depth_${dp}_$kv.json" "$dp" "$kv" | tee -a "$SUMMARY"
            done
        fi
    done
fi

if [[ " $STAGES " == *" attention "* ]]; then
    # One-token attention alone at depth (scripts/attention_bench.py): microseconds a layer and KV bandwidth, each KV
    # type; ATTN_KNOBS adds variants (e.g. "attention.splits=130 attention.heads=1"). The q8 types run three times:
    # cache rows split into codes and scales with int8 q in the scores (cuda's defaults), split with f32 q
    # (attention.int8=0), and in their GGUF blocks (--gguf-kv), so each step's effect reads off one run.
    for dp in ${DEPTHS:-8192 32768}; do
        for kv in ${KV_TYPES:-f16 q8_0 q8_g64}; do
            for kn in "" ${ATTN_KNOBS:-}; do
                timeout 180 python3 scripts/attention_bench.py --target cuda --depth "$dp" --kv-type "$kv" \
                    --iters 50 ${kn:+--knob "$kn"} 2>> "$LOG" | tail -1 | cut -c1-150 | tee -a "$SUMMARY"
            done
            if [[ "$kv" != f16 ]]; then
                for variant in "--knob attention.int8=0" --gguf-kv; do
                    timeout 180 python3 scripts/attention_bench.py --target cuda --depth "$dp" --kv-type "$kv" \
                        --iters 50 $variant 2>> "$LOG" | tail -1 | cut -c1-150 | tee -a "$SUMMARY"
                done
            fi
        done
    done
fi

if [[ " $STAGES " == *" prefill "* ]]; then
    # Issue 21 (not among the default stages): prefill on matrix units. The main prefill matmuls alone (llama3-8b's
    # ffn_up / ffn_down shapes, 512 tokens: TFLOP/s of the tile-product kernel), then pp512 / pp4096 against
    # llama.cpp's on both presets, same files; each also without the tile products of attention (attention.mma=0:
    # its loops), with K chunks of 64 (the default's 128 halved), and without the matmuls' and, on the MoE preset,
    # the experts' tile products (mma_min past every matrix: the int8 matvecs).
    # PREFILL_LENGTHS, BENCH_MODELS narrow it; PREFILL_VARIANTS=0 skips the variants but pp512 at -ub 512.
    for shape in "14336 4096" "4096 14336"; do
        set -- $shape
        timeout 300 python3 scripts/matvec_bench.py --target cuda --rows "$1" --cols "$2" --tokens 512 --iters 20 \
            --copies 2 2>&1 | tee -a "$LOG" | tail -2 | tee -a "$SUMMARY"
    done
    preset_model llama3-8b-q4km; preset_model qwen3moe-8l-q4km
    lcpp=$(bash scripts/device_llamacpp.sh start >> "$LOG" 2>&1 && bash scripts/device_llamacpp.sh wait 540 >> "$LOG" && echo yes)
    for m in ${BENCH_MODELS:-llama3-8b-q4km qwen3moe-8l-q4km}; do
        for p in ${PREFILL_LENGTHS:-512 4096}; do
            timeout 600 python3 -m polystrata bench "$M/$m.gguf" --target cuda -p "$p" -n 0 -r 3 --json \
                > "$OUT/prefill_${m}_$p.json" 2>> "$LOG" || { row "$m pp$p" "failed (see the log)"; continue; }
            pp_row "$OUT/prefill_${m}_$p.json" "$m pp$p"
            # A variant's knobs joined by commas. ub=N: -ub N, the step size: steps of 512 rows (llama.cpp's
            # default micro-batch) against the default's 256; it runs with PREFILL_VARIANTS=0 too.
            # attention.q_tile=32: prefill attention's tiles of 32 query rows (each K/V tile staged once for twice
            # the rows, half the groups; 43 KiB of shared memory, 127 registers for sm_90 against 16 rows' 35 and 79).
            # matmul.mma_tokens=64: tiles of 64 tokens (99 registers, 22 KiB; each weight tile decoded for twice the
            # tokens).
            # attention.tile_splits=4: each q tile's keys in 4 groups (4x the groups of a step; a combine after).
            variants="attention.mma=0 attention.q_tile=32 attention.tile_splits=4 matmul.mma_tokens=64"
            variants+=" matmul.mma_chunk=64 matmul.mma_min=1048576"
            [[ "$m" == qwen3moe* ]] && variants+=" moe_ffn.mma_min=1048576"
            [ "${PREFILL_VARIANTS:-1}" = 0 ] && variants=""
            variants="ub=512 $variants"  # at 4096 too: twice the prefill attention's groups a step
            for kn in $variants; do
                f="$OUT/prefill_${m}_${p}_${kn//[.=,]/_}.json"
                args=(); IFS=, read -ra ks <<< "$kn"
                for k in "${ks[@]}"; do [[ "$k" == ub=* ]] && args+=(-ub "${k#ub=}") || args+=(--knob "$k"); done
                timeout 600 python3 -m polystrata bench "$M/$m.gguf" --target cuda -p "$p" -n 0 -r 3 "${args[@]}" \
                    --json > "$f" 2>> "$LOG" || { row "$m pp$p $kn" "failed (see the log)"; continue; }
                pp_row "$f" "$m pp$p $kn"
            done
            [ -n "$lcpp" ] || continue
            timeout 300 /tmp/llamacpp-build/bin/llama-bench -m "$M/$m.gguf" -p "$p" -n 0 -r 3 -fa 1 -ngl 99 -o json \
                > "$OUT/lcpp_prefill_${m}_$p.json" 2>> "$LOG" || { row "llama.cpp $m pp$p" "failed"; continue; }
            python3 -c "import json,sys; r=json.load(open(sys.argv[1]))[0]; print(f\"{'llama.cpp ' + sys.argv[2] + ' pp' + sys.argv[3]:34s} {r['avg_ts']:.0f}±{r['stddev_ts']:.0f} tok/s\")" \
                "$OUT/lcpp_prefill_${m}_$p.json" "$m" "$p" | tee -a "$SUMMARY"
        done
    done
fi

if [[ " $STAGES " == *" moe "* ]]; then
    # MoE decode with experts that do not all fit (issue 17): the 48-layer qwen3-30b-a3b preset against llama.cpp's
    # --n-cpu-moe at equal device memory (scripts/moe_offload_bench.py; llama-bench from device_llamacpp.sh).
    # MOE_SKEW > 0 uses a model whose routing is concentrated (synth --router-skew); MOE_ARGS passes options on.
    bash scripts/device_llamacpp.sh start && bash scripts/device_llamacpp.sh wait 540 | tee -a "$LOG"
    mm="$M/qwen3moe-48l-q4km-skew${MOE_SKEW:-0}.gguf"
    [ -f "$mm" ] || python3 -m polystrata synth --arch qwen3moe --preset qwen3-30b-a3b --type Q4_K_M \
        --router-skew "${MOE_SKEW:-0}" -o "$mm" 2>> "$LOG"
    timeout 1500 python3 scripts/moe_offload_bench.py "$mm" --llama-bench /tmp/llamacpp-build/bin/llama-bench \
        ${MOE_ARGS:-} --json "$OUT/moe_skew${MOE_SKEW:-0}.json" 2>&1 | tee -a "$LOG" | tail -14 | tee -a "$SUMMARY"
fi

if [[ " $STAGES " == *" hostprof "* ]]; then
    # Where the host's time of a resident decode step goes (issue 19: host share 0.07 -> 0.19 ms/token between two
    # runs with the same device time): cProfile over a decode-only bench of the llama3-8b preset, by own time.
    preset_model llama3-8b-q4km
    timeout 600 python3 -m cProfile -s tottime -m polystrata bench "$M/llama3-8b-q4km.gguf" --target cuda -p 0 -n 256 \
        -r 2 --json 2>> "$LOG" > "$OUT/hostprof.txt"
    head -1 "$OUT/hostprof.txt" | cut -c1-200 | tee -a "$SUMMARY"
    grep -A 25 "Ordered by" "$OUT/hostprof.txt" | cut -c1-160 | tee -a "$SUMMARY"
    # The decode step alone (bench's step, wall less device time) and its own profile: the driver calls' share.
    timeout 600 python3 scripts/host_overhead.py "$M/llama3-8b-q4km.gguf" --target cuda -n 500 --profile 25 \
        2>> "$LOG" > "$OUT/host_overhead.txt"
    grep -E "^host time|Ordered by" -A 27 "$OUT/host_overhead.txt" | cut -c1-160 | tee -a "$SUMMARY"
fi

if [[ " $STAGES " == *" serve "* ]]; then
    # Serving throughput (issue 22): `polystrata serve` against llama-server on the llama3-8b preset, 1/4/16
    # concurrent streams (scripts/serve_bench.py; aiohttp's wheels travel in .whl; llama-server from the unified
    # binary of device_llamacpp.sh). SERVE_ARGS passes options on (e.g. "--streams 1,16 --tokens 64"), SERVE_KNOBS
    # PolyStrata's (e.g. "--knob matmul.reuse=1").
    preset_model llama3-8b-q4km
    # The split-K tile products on this GPU's matrix units against the reference first (a fast wrong kernel would
    # win the runs below: serve_bench checks no text), then a batched step's matmul alone, ffn_up's shape at 16
    # rows: the int8 matvecs against them (knob matmul.mma_split, off by default; docs/benchmarks.md, "Serving:
    # split-K tile products").
    # SERVE_CHECKS=0 skips both (measured before, where a call's minutes are short).
    if [ "${SERVE_CHECKS:-1}" != 0 ]; then
        timeout 600 python3 -m pytest -q -p no:cacheprovider tests/test_recipes_tile_mma.py -k "split or glu" \
            --target cuda 2>&1 | tail -1 | sed "s/^/split-K kernels on cuda: /" | tee -a "$LOG" "$SUMMARY"
        for kn in "" "--knob matmul.mma_split=4" "--knob matmul.mma_split=8"; do
            timeout 300 python3 scripts/matvec_bench.py --target cuda --rows 14336 --cols 4096 --tokens 16 \
                --iters 50 $kn 2>&1 | tee -a "$LOG" | tail -2 | tee -a "$SUMMARY"
        done
    fi
    # SERVE_LLAMA=0: PolyStrata alone (no llama.cpp build to wait for).
    lcpp=(); [ -n "${SERVE_KNOBS:-}" ] && lcpp=(--polystrata-args "$SERVE_KNOBS")
    if [ "${SERVE_LLAMA:-1}" = 0 ]; then
        row "llama-server" "left out (SERVE_LLAMA=0)"
    elif bash scripts/device_llamacpp.sh start >> "$LOG" 2>&1 && bash scripts/device_llamacpp.sh wait 540 >> "$LOG" \
        && [ -x /tmp/llamacpp-build/bin/llama-server ]; then
        lcpp+=(--llama-server /tmp/llamacpp-build/bin/llama-server --llama-args "-ngl 99 -fa on")
    else
        row "llama-server" "not available (see the log): polystrata alone"
    fi
    timeout 900 python3 scripts/serve_bench.py "$M/llama3-8b-q4km.gguf" --target cuda "${lcpp[@]}" ${SERVE_ARGS:-} \
        --json "$OUT/serve.json" 2>&1 | tee -a "$LOG" | tail -10 | tee -a "$SUMMARY"
    # Where the step of 16 prompts joining at once goes (most of the time to first token at 16 streams), each launch
    # timed alone; SERVE_JOIN_PROFILE=0 skips it.
    if [ "${SERVE_JOIN_PROFILE:-1}" != 0 ]; then
        timeout 300 python3 scripts/profile_decode.py "$M/llama3-8b-q4km.gguf" --target cuda --tokens 288 \
            --sequences 16 --reps 5 --top 12 2>&1 | tee -a "$LOG" | tail -13 | tee -a "$SUMMARY"
    fi
    # SERVE_VARIANTS: PolyStrata alone again with knobs, one run per space-separated item, a run's knobs joined by
    # commas (as the prefill stage's), at SERVE_VARIANT_STREAMS (default 16) streams: e.g. "matmul.reuse=1
    # matmul.mma_split=4" (the batched step's matmuls on the reuse matvecs, on the split-K tile products).
    for kn in ${SERVE_VARIANTS:-}; do
        args=""; IFS=, read -ra ks <<< "$kn"; for k in "${ks[@]}"; do args+=" --knob $k"; done
        timeout 600 python3 scripts/serve_bench.py "$M/llama3-8b-q4km.gguf" --target cuda --polystrata-args "$args" \
            --streams "${SERVE_VARIANT_STREAMS:-16}" ${SERVE_ARGS:-} --json "$OUT/serve_${kn//[.=,]/_}.json" 2>&1 \
            | tee -a "$LOG" | tail -3 | sed "s/^/[$kn] /" | tee -a "$SUMMARY"
    done
fi

if [[ " $STAGES " == *" tune "* ]]; then
    # Kernel autotuning (issue 20): per model and target, `tune` with TUNE_BUDGET (default 4m: a call is at most
    # 10 minutes, with the load, the default kernels' compile and the bench), then `bench --tuning both` (untuned,
    # then tuned, in one run; TUNE_BENCH=0 skips it). TUNE_TARGETS and TUNE_MODELS narrow it; TUNE_ARGS adds
    # options (`--plans decode`), TUNE_JOBS sets -j; TUNE_BENCH_ARGS shortens the bench. The tuning database
    # starts empty on each machine: a session that takes several calls carries the last call's database back in
    # .tuning/ (ignored by git); each call returns it as tuning.sqlite, and its rows as tuning_h200.json. `tune`
    # resumes with the instances left (largest share of a step first), a cut-short one where it stopped.
    preset_model llama3-8b-q4km; preset_model qwen3moe-8l-q4km
    # The database itself where a call left one (.tuning/tuning.sqlite: it also keeps the candidates measured of
    # an instance the budget cut short, which the next `tune` goes on from), else the rows of the JSON.
    if [ -f .tuning/tuning.sqlite ]; then
        mkdir -p "$POLYSTRATA_HOME" && cp .tuning/tuning.sqlite "$POLYSTRATA_HOME/tuning.sqlite"
    elif [ -f .tuning/tuning_h200.json ]; then
        python3 -m polystrata tune --import .tuning/tuning_h200.json 2>&1 | tee -a "$LOG"
    fi
    for t in ${TUNE_TARGETS:-cuda hip opencl}; do
        for m in ${TUNE_MODELS:-llama3-8b-q4km qwen3moe-8l-q4km}; do
            timeout 900 python3 -m polystrata tune "$M/$m.gguf" --target "$t" --budget "${TUNE_BUDGET:-4m}" \
                ${TUNE_JOBS:+-j "$TUNE_JOBS"} ${TUNE_ARGS:-} 2>&1 | tee -a "$LOG" \
                | grep -E '^tune: ([0-9]+ kernel|budget|.*(tried, |budget was spent))' \
                | sed "s/^/$m $t: /" | tee -a "$SUMMARY"
            python3 -m polystrata tune --export "$OUT/tuning_h200.json" 2>> "$LOG"  # after each: a timeout keeps it
            cp "$POLYSTRATA_HOME/tuning.sqlite" "$OUT/" 2>> "$LOG"
            [ "${TUNE_BENCH:-1}" = 0 ] && continue
            timeout 900 python3 -m polystrata bench "$M/$m.gguf" --target "$t" --tuning both \
                ${TUNE_BENCH_ARGS:--p 512 -n 128 -r 3} --json > "$OUT/tune_${m}_$t.json" 2>> "$LOG"
            python3 - "$OUT/tune_${m}_$t.json" "$m $t" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
u, t = r["untuned"], r["tuned"]
print(f"{sys.argv[2]:34s} pp {u['pp']['tok_s_mean']:.0f} -> {t['pp']['tok_s_mean']:.0f}  "
      f"tg {u['tg']['tok_s_mean']:.1f} -> {t['tg']['tok_s_mean']:.1f} tok/s  ratio {r['ratio']}  "
      f"{len(t['tuned_kernels'])} tuned instances")
EOF
        done
    done
    python3 -m polystrata tune --show > "$OUT/tuning_rows.txt" 2>> "$LOG"
fi

echo; echo "=== summary ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) ==="
cat "$SUMMARY"
