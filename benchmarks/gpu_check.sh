#!/usr/bin/env bash
# Issue 28's step-level ratios on a GPU, in at most 8 minutes (sized for one
# H200 and 16 cores): bench_targets.py's default / accumulation 4 / clip_norm
# rows against the matching keras.Model, with XLA on, XLA off, and under
# mixed_float16 (loss scaling on both sides), on the 14 ms MLP, Conv2D+BN, the
# Transformer and the 1M-row Embedding. Writes a markdown table (the GPU's
# name, each phase's table or why it has none), the JSON and the logs.
# On a machine where JAX sees several GPUs (an even number, at least 4), then
# issue 49's rows, in at most 150 s more: bench_model_parallel_jax.py's
# FastGradModel / keras.Model step time and peak memory per device under
# `keras.distribution.ModelParallel` (a 2 x GPUs/2 mesh); with fewer, the
# table says why they were not run (needs JAX with CUDA: pip install
# "jax[cuda12]"; not installed by --install).
#
#   bash benchmarks/gpu_check.sh [--cpu] [--install] [OUT_DIR]
#
# OUT_DIR: an argument, else $OUT (the device tool collects what is there),
# else benchmarks/out/gpu_check. Results: OUT_DIR/gpu_check.md.
#
# The machine needs TensorFlow with CUDA, Keras and this checkout:
#   python -m pip install -e . "tensorflow[and-cuda]>=2.18"
# (what `--install` runs first; a box without a package index needs them
# installed already). Without an installed keras_fastgrad the checkout is
# used as it is (PYTHONPATH). $PYTHON picks the interpreter (default python3).
#
# --cpu: a test of this script on the CPU (CUDA hidden), in quick sizes: the
# 1.5 ms MLP, 1 round, every row in graph mode, the gated row under XLA, the
# GPU-only phase (mixed_float16) left out, and the ModelParallel rows too
# (their CPU run is bench_model_parallel_jax.py itself, on 8 host devices).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CPU=0
INSTALL=0
DEST=""
for arg in "$@"; do
    case "$arg" in
        --cpu) CPU=1 ;;
        --install) INSTALL=1 ;;
        -h | --help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $arg (known: --cpu, --install, OUT_DIR)" >&2; exit 2 ;;
        *) DEST="$arg" ;;
    esac
done
DEST="${DEST:-${OUT:-$ROOT/benchmarks/out/gpu_check}}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
export TF_CPP_MIN_LOG_LEVEL=3

if [ "$INSTALL" = 1 ]; then
    "$PYTHON" -m pip install -q -e "$ROOT" "tensorflow[and-cuda]>=2.18"
fi
if ! "$PYTHON" -c "import keras_fastgrad" 2>/dev/null; then
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

BUDGET_S=480  # the whole check, phases included
MODEL_PARALLEL_S=150  # issue 49's rows, after it, where JAX sees several GPUs
RESERVE_S=15  # kept for the summary
if [ "$CPU" = 1 ]; then
    export CUDA_VISIBLE_DEVICES=""
    # Each side (model) built costs seconds of tracing, more under XLA; the
    # timing itself is short: every row's sides once, in graph mode.
    COMMON=(--cpu --quick --rounds 1 --models mlp_64x256_b64)
    PHASES=("graph|--rows gated,ungated,acc,clip|240" "XLA|--xla --rows gated|240")
else
    COMMON=(--rounds 8 --models mlp_256x1024_b64,cnn_bn,transformer,embedding_1m
        --rows gated,ungated,acc,clip)
    # label|flags|seconds at most. XLA first: jit_compile="auto" is XLA on a
    # single GPU, what users get.
    PHASES=("XLA|--xla|170" "graph||110" "mixed_float16|--mixed|100"
        "XLA + mixed_float16|--xla --mixed|150")
fi

TABLE="$DEST/gpu_check.md"
START=$(date +%s)
rm -f "$DEST/phases.txt"
touch "$DEST/.started"  # the JSON written after it is this run's
{
    echo "# gpu_check.sh: issue 28's step-time ratios ($( [ "$CPU" = 1 ] && echo "CPU test run" || echo GPU))"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ); code: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if command -v nvidia-smi >/dev/null && [ "$CPU" = 0 ]; then
        echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd ';')"
    else
        echo "- GPU: none used"
    fi
    echo "- CPU: $(nproc) cores; Python: $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"
    echo "- command: bash benchmarks/gpu_check.sh $*"
    echo "- ratios: FastGradModel / keras.Model step time, median of the per-round ratios"
    echo "  (min, max, best round, p25 of steps beside it); targets from issue 28"
    echo
} >"$TABLE"

for phase in "${PHASES[@]}"; do
    IFS="|" read -r label flags cap <<<"$phase"
    left=$((BUDGET_S - RESERVE_S - ($(date +%s) - START)))
    left=$((left < cap ? left : cap))
    slug="$(echo "$label" | tr -c 'A-Za-z0-9\n' '_')"
    if [ "$left" -lt 60 ]; then
        printf '### %s\n\nnot run: %ss of the %ss budget left\n\n' "$label" "$left" "$BUDGET_S" >>"$TABLE"
        continue
    fi
    phase_start=$(date +%s)
    # shellcheck disable=SC2086  # $flags holds zero or more options
    if (cd "$ROOT/benchmarks" && timeout "$left" "$PYTHON" bench_targets.py "${COMMON[@]}" $flags \
        --markdown "$TABLE") >"$DEST/$slug.log" 2>&1; then
        status="ok"
    else
        rc=$?
        status="failed (exit $rc$( [ "$rc" = 124 ] && echo ", out of time"))"
        printf '%s: %s (the tables above are what it finished); the end of %s.log:\n\n```\n%s\n```\n\n' \
            "$label" "$status" "$slug" "$(tail -n 15 "$DEST/$slug.log")" >>"$TABLE"
    fi
    echo "$label: $status in $(($(date +%s) - phase_start)) s" | tee -a "$DEST/phases.txt"
done

# Issue 49's multi-device rows: only where JAX sees an even number >= 4 of GPUs.
if [ "$CPU" = 0 ]; then
    gpus=$("$PYTHON" -c "import jax; print(len(jax.devices('gpu')))" 2>/dev/null || echo 0)
    label="ModelParallel (JAX, $gpus GPUs)"
    if [ "$gpus" -ge 4 ] && [ $((gpus % 2)) = 0 ]; then
        phase_start=$(date +%s)
        if (cd "$ROOT/benchmarks" && timeout "$MODEL_PARALLEL_S" "$PYTHON" \
            bench_model_parallel_jax.py) >"$DEST/model_parallel.log" 2>&1; then
            status="ok"
        else
            rc=$?
            status="failed (exit $rc$( [ "$rc" = 124 ] && echo ", out of time"))"
        fi
        printf '### %s\n\n```\n%s\n```\n\n' "$label" \
            "$(sed -n '/^Issue 49/,$p' "$DEST/model_parallel.log" | grep -v '^WARNING\|^I0000')" >>"$TABLE"
        echo "$label: $status in $(($(date +%s) - phase_start)) s" | tee -a "$DEST/phases.txt"
    else
        printf '### ModelParallel (JAX)\n\nnot run: JAX sees %s GPUs (needs an even number, at least 4)\n\n' \
            "$gpus" >>"$TABLE"
        echo "ModelParallel (JAX): not run, $gpus GPUs" | tee -a "$DEST/phases.txt"
    fi
fi
find "$ROOT/benchmarks/out" -maxdepth 1 \( -name 'targets*.json' -o -name 'model_parallel_jax.json' \) \
    -newer "$DEST/.started" -exec cp {} "$DEST"/ \;
{
    echo "Phases:"
    echo
    sed 's/^/- /' "$DEST/phases.txt"
    echo
    echo "Wall time: $(($(date +%s) - START)) s"
} >>"$TABLE"
rm -f "$DEST/phases.txt" "$DEST/.started"
echo "gpu_check.sh: wrote $TABLE"
