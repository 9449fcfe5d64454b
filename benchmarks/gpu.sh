#!/usr/bin/env bash
# Every GPU measurement of cnnkit in one run, sized for < 8 minutes on one H200:
#   the CUDA tests (pytest -m gpu); AlexNet training (bench train --explore: bf16 / fp16 / fp32 x
#   NHWC / NCHW in one interleaved run, with the plain and the careful torchvision peers) at
#   batch 256 and 1024, the 2012 AlexNet, inference, per-layer times; `cnnkit train` from
#   synthetic data and from packed data (raw and JPEG shards decoded on the GPU); the loader
#   (raw shards, JPEG shards on the CPU and on the GPU); a one-process NCCL DDP run and a
#   `sync: average` run; the CPU/GPU scaling study in fp32 and bf16; torch.compile last.
#
#   bash benchmarks/gpu_wheels.sh            # here, once: the wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu.sh OUT_DIR [BACK]    # there; results: OUT_DIR/*.log, *.json, summary.json
#
# The device tool brings back at most 8 files: with BACK (its $OUT) the summary, the step list,
# the hardware and one results.tgz of every log and figure (no shards, no checkpoints) go there.
# Without pydantic and simplejpeg importable it stops at once (exit 1); without a CUDA device it
# writes OUT_DIR/skipped.txt, skips every GPU part and exits 0. BACK is filled on every exit.
# Each step has its own time limit and the whole run a budget (BUDGET_S, default 470 s):
# a step that would not fit is skipped and listed; one started with less than its limit left
# and stopped at the budget is listed as cut (summary.json: steps_cut_by_budget), not failed.
# SMOKE=1 runs every step on the CPU with tiny sizes, to test this script without a GPU.
# STEPS="gpu_tests ddp_nccl" runs only the steps named (a second run after a fix, within the
# device time left; a step on the packed data needs synth_shapes and pack_raw / pack_jpeg too).
set -u
OUT=$(realpath -m -- "${1:?usage: bash benchmarks/gpu.sh OUT_DIR [BACK_DIR]}")
BACK=${2:+$(realpath -m -- "$2")}
[[ ${SMOKE:-0} == 1 ]] || BUDGET_S=${BUDGET_S:-470}
SMOKE=${SMOKE:-0}
REPO=$(cd "$(dirname "$0")/.." && pwd)
# a rerun starts clean (stale logs and runs would mix in); a folder gpu.sh did not make is kept
if [[ -d $OUT && -n $(ls -A "$OUT") ]]; then
    [[ -f $OUT/.gpu-sh ]] || { echo "gpu.sh: $OUT is not empty and not an earlier gpu.sh run" >&2; exit 2; }
    rm -rf "${OUT:?}"/* "$OUT"/.gpu-sh
fi
mkdir -p "$OUT" && touch "$OUT/.gpu-sh"
# what the device tool brings back (at most 8 files): the summary, the steps, the hardware and
# one results.tgz of every log and figure under 4 MiB (no shards, no checkpoints); on any exit
bring_back() {
    [[ -n $BACK ]] || return 0
    mkdir -p "$BACK"
    local f
    for f in summary.json summary.txt steps.txt skipped.txt hardware.txt results.tgz left_out.txt; do
        rm -f "$BACK/$f"
        [[ -f $OUT/$f && $f != results.tgz ]] && cp "$OUT/$f" "$BACK/"
    done
    (cd "$OUT" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.csv' \
        -o -name '*.png' -o -name '*.yaml' \) -size +4194303c > "$BACK/left_out.txt")
    [[ -s $BACK/left_out.txt ]] || rm -f "$BACK/left_out.txt"
    (cd "$OUT" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.csv' \
        -o -name '*.png' -o -name '*.yaml' \) -size -4194304c | tar czf "$BACK/results.tgz" -T -)
}
trap bring_back EXIT
trap 'exit 143' TERM INT  # (bash runs it once the step in flight has ended)
PY=${PYTHON:-python3}
START=$(date +%s)
cd "$REPO"
# pydantic, simplejpeg, ...: carried as wheels (gpu_wheels.sh) where the image lacks them
if ! "$PY" -c 'import pydantic, simplejpeg' 2>/dev/null && ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/cnnkit-site .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheels: rc=1" >> "$OUT/steps.txt"
    export PYTHONPATH="/tmp/cnnkit-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import pydantic, simplejpeg' 2>/dev/null; then  # every step would fail
    echo "gpu.sh: pydantic or simplejpeg missing: run benchmarks/gpu_wheels.sh here and carry .whl" \
        | tee -a "$OUT/steps.txt" >&2
    exit 1
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ $SMOKE == 1 ]]; then  # a slow CPU: every limit SLOW times longer
    DEV=cpu B=4 BIG=8 REPEATS=2 PER_CLASS=4 QUICK=--quick COMPILE=--no-compile SLOW=4
    LAYER_REPEATS=2 EPOCHS=2 BUDGET_S=${BUDGET_S:-1800}
else
    DEV=cuda B=256 BIG=1024 REPEATS=10 PER_CLASS=1200 QUICK= COMPILE=--compile SLOW=1
    LAYER_REPEATS=10 EPOCHS=4
fi
if [[ $DEV == cuda ]] &&
    ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device on $(hostname): GPU measurements skipped" | tee "$OUT/skipped.txt"
    exit 0
fi
"$PY" - > "$OUT/hardware.txt" <<'PY'
import os, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("gpu:", gpu, "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("cpu:", platform.processor() or platform.machine(), "| cores", len(os.sched_getaffinity(0)))
PY
# containers often give /dev/shm 64 MB; the loader's slot rings need a few GB (root may grow it)
shm_kb=$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')
if [[ $DEV == cuda && ${shm_kb:-0} -lt $(( 16 * 1024 * 1024 )) ]]; then
    mount -o remount,size=32G /dev/shm 2>/dev/null || echo "shm: could not grow /dev/shm" >> "$OUT/hardware.txt"
fi
df -h /dev/shm | tail -n 1 | awk '{print "shm: " $2 " (" $4 " free)"}' >> "$OUT/hardware.txt"
date -u +"%Y-%m-%dT%H:%M:%SZ" >> "$OUT/hardware.txt"
[[ -z ${STEPS:-} ]] || echo "steps selected: $STEPS" >> "$OUT/hardware.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total,power.limit \
    --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true

# step NAME LIMIT_S COMMAND...: run with a time limit, output to NAME.log, its last JSON line
# (stderr may print after it) to NAME.json
step() {
    local name=$1 limit=$(( $2 * SLOW )); shift 2
    [[ -z ${STEPS:-} || " $STEPS " == *" $name "* ]] || return 0  # a rerun of some steps only
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < limit / 2 )); then
        echo "$name: skipped (${left}s of the budget left)" | tee -a "$OUT/skipped.txt"
        return
    fi
    local cut=0
    (( limit > left )) && { limit=$left; cut=1; }
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local why=""  # a step stopped at a limit the budget shortened: not a failure of its own
    (( cut && (rc == 124 || rc == 137) )) && why=" cut by the budget"
    local last
    last=$(grep -a '^{' "$OUT/$name.log" | tail -n 1)
    if [[ -n $last ]] && printf '%s\n' "$last" | "$PY" -c 'import json,sys; json.load(sys.stdin)' 2>/dev/null; then
        printf '%s\n' "$last" > "$OUT/$name.json"
    fi
    echo "$name: rc=$rc $(( $(date +%s) - t0 ))s$why" | tee -a "$OUT/steps.txt"
    bring_back  # after every step: a run killed outright still leaves what it had measured
}

CK=("$PY" -m cnnkit)
T=("${CK[@]}" bench train -d "$DEV" --repeats "$REPEATS" $QUICK --json)
L=("${CK[@]}" bench loader -b "$B" --batches 30 -d "$DEV" --crop 224 --json)
RUN="$OUT/runs"
mkdir -p "$RUN"
# The most telling figures first: a step that would overrun the budget is the one dropped.
# 0. the CUDA tests: if the path is broken, the figures below say little
# (3 processes, not 16: each starts CUDA; SMOKE: all skipped; without pytest-xdist, pyproject's
# "-n auto" is replaced; with pytest-timeout a hung test fails alone, leaving the summary line)
if "$PY" -c 'import xdist' 2>/dev/null; then ONE=(-n 3); else ONE=(-o "addopts=-ra"); fi
"$PY" -c 'import pytest_timeout' 2>/dev/null && ONE+=(--timeout 150)
step gpu_tests 180 "$PY" -m pytest -q -m gpu "${ONE[@]}" --durations 8 -p no:cacheprovider tests
# 1. the flagship's training step: every precision x format interleaved, both torchvision peers
step train_owt_256_explore  90 "${T[@]}" alexnet-owt -b "$B" --explore --baseline
# 2. the data: synthesised JPEGs packed raw and as JPEG shards; the loader alone
step synth_shapes           60 "${CK[@]}" synth shapes "$RUN/shapes" --classes 10 \
    --per-class "$PER_CLASS" --size 256
step pack_raw               45 "${CK[@]}" pack "$RUN/shapes" "$RUN/raw" --size 256
step pack_jpeg              45 "${CK[@]}" pack "$RUN/shapes" "$RUN/jpeg" --size 256 --format jpeg
step loader_raw             40 "${L[@]}" "$RUN/raw"
step loader_jpeg_gpu        40 "${L[@]}" "$RUN/jpeg" --decode gpu
# 3. `cnnkit train` end to end from packed data: raw shards, JPEG shards decoded on the GPU
for kind in raw jpeg; do
    decode=cpu; [[ $kind == jpeg ]] && decode=gpu
    cat > "$RUN/$kind.yaml" <<YAML
name: alexnet-$kind
model: alexnet-owt
data: {source: packed, path: $RUN/$kind, crop: 224, batch_size: $B, decode: $decode}
train: {epochs: $EPOCHS, device: $DEV, optimizer: sgd, lr: 0.01}
YAML
done
step train_packed_raw       75 "${CK[@]}" train "$RUN/raw.yaml" --out "$RUN/packed-raw" --quiet
step train_packed_jpeg_gpu  75 "${CK[@]}" train "$RUN/jpeg.yaml" --out "$RUN/packed-jpeg" --quiet
# 4. more training figures: a large batch, the 2012 AlexNet, inference
step train_owt_1024_bf16    60 "${T[@]}" alexnet-owt -b "$BIG" -p bf16 --channels-last
step train_alexnet2012      60 "${T[@]}" alexnet -b "$B"
step infer_owt              45 "${CK[@]}" bench infer alexnet-owt -b "$B" -d "$DEV" $QUICK --json
# 5. one-process NCCL groups: DDP and the first seed's weight averaging
step ddp_nccl               60 "${CK[@]}" train "$RUN/raw.yaml" --nproc 1 --out "$RUN/ddp" --quiet \
    train.epochs=1
step average_nccl           60 "${CK[@]}" train "$RUN/raw.yaml" --nproc 1 --out "$RUN/avg" --quiet \
    train.epochs=1 train.sync=average
# 6. per-layer times, the scaling study (CPU and GPU halves) in fp32 and bf16, the rest
step layers_owt             45 "${CK[@]}" bench layers alexnet-owt -b "$B" -d "$DEV" \
    --repeats "$LAYER_REPEATS" --json
step scaling_fp32          100 "${CK[@]}" bench scaling --devices "cpu,$DEV" -o "$OUT/scaling-fp32" $QUICK --json
step scaling_bf16           80 "${CK[@]}" bench scaling --devices "cpu,$DEV" -p bf16 \
    -o "$OUT/scaling-bf16" --quick --json
step loader_jpeg_cpu        40 "${L[@]}" "$RUN/jpeg"
cat > "$RUN/synthetic.yaml" <<YAML
name: alexnet-synthetic
model: alexnet-owt
data: {source: synthetic, shape: [3, 224, 224], num_classes: 1000, train_size: $(( B * 40 )),
       val_size: $B, batch_size: $B}
train: {epochs: 2, device: $DEV}
YAML
step train_synthetic        60 "${CK[@]}" train "$RUN/synthetic.yaml" --out "$RUN/synthetic" --quiet
# 7. torch.compile (minutes of compiling): last
step train_owt_compile     100 "${T[@]}" alexnet-owt -b "$B" -p bf16 --channels-last "$COMPILE"
rm -rf "$RUN/shapes"  # the JPEGs are only input; the results stay

"$PY" benchmarks/gpu_summary.py "$OUT" > "$OUT/summary.txt"
cat "$OUT/summary.txt"
echo "total $(( $(date +%s) - START ))s; results in $OUT"
