#!/usr/bin/env bash
# Here, before device calls: cut the two real models (from the zoo's cache: `polystrata pull smollm2-135m`,
# `polystrata pull gemma3-270m`) into parts that fit the 64 MiB a device call carries, into .models/ (ignored by
# git). The models are one stream, back to back (.models/layout lists them with their sizes); the first part is
# smaller, leaving room for the wheels in .whl/ that the first call also carries. Then, in consecutive calls while
# the machine stays warm (see docs/benchmarks.md):
#   carry .whl .models/layout .models/part-00:  bash scripts/device_check.sh receive
#   carry .models/part-01 ... part-NN:          bash scripts/device_check.sh receive   (the last: receive parity)
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${POLYSTRATA_HOME:-$HOME/.cache/polystrata}/models"
PART=64000000                                    # bytes a call; the checkout itself is about 1 MB
WHEELS=$(cat .whl/*.whl 2>/dev/null | wc -c)
rm -rf .models && mkdir -p .models
: > .models/layout; : > .models/stream
for f in SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf; do
    [ -f "$CACHE/$f" ] || { echo "missing $CACHE/$f: run polystrata pull first" >&2; exit 1; }
    echo "$f $(wc -c < "$CACHE/$f")" >> .models/layout
    cat "$CACHE/$f" >> .models/stream
done
FIRST=$((PART - WHEELS))
head -c "$FIRST" .models/stream > .models/part-00
tail -c +$((FIRST + 1)) .models/stream | split -b "$PART" -d -a 2 --numeric-suffixes=1 - .models/part-
rm .models/stream
ls -l .models
