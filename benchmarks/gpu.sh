#!/usr/bin/env bash
# Every GPU measurement of cnnkit in one run, sized for < 8 minutes on one H200:
#   the CUDA tests (pytest -m gpu, while the JPEGs are synthesised and packed on the CPU);
#   AlexNet training (bench train --explore: bf16 / fp16 / fp32 x NHWC / NCHW in one
#   interleaved run, with the plain and the careful torchvision peers) at batch 256 and 1024;
#   the loader (raw shards, JPEG shards decoded on the GPU); `cnnkit train` from packed raw and
#   JPEG shards; a one-process NCCL DDP run and a `sync: average` run; the 2012 AlexNet,
#   inference; torch.compile; per-layer times; the CPU/GPU scaling study in fp32 and bf16; the loader
#   on JPEGs decoded by the CPU; `cnnkit train` from synthetic data; RandAugment and
#   TrivialAugment against torchvision's per-image transforms. The figures of the floors
#   come first: a step that would overrun the budget is one of the last. Each bench step times
#   the peak kernels interleaved with its own steps (a second or two each), not one shared
#   figure: the fraction of peak then compares rates under the same clocks and heat.
#
#   bash benchmarks/gpu_wheels.sh            # here, once: the wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu.sh OUT_DIR [BACK]    # there; results: OUT_DIR/*.log, *.json, summary.json
#
# The device tool brings back at most 8 files: with BACK (its $OUT) the summary, the step list,
# the hardware and one results.tgz of every log and figure (no shards, no checkpoints) go there,
# refreshed after every step and on any exit (a run killed outright keeps what it had).
# Without pydantic and simplejpeg importable it stops at once (exit 1); without a CUDA device it
# writes OUT_DIR/stopped.txt, skips every GPU part and exits 0 (exit 2: torch fails to import);
# summary.json's `stopped` then says why, and no step counts as missing.
# Each step has its own time limit and the whole run a budget (BUDGET_S, default 470 s):
# a step that would not fit is skipped and listed; one started with less than its limit left
# and stopped at the budget is listed as cut (summary.json: steps_cut_by_budget), not failed;
# one never reached (the run was killed) is listed in steps_missing.
# SMOKE=1 runs every step on the CPU with tiny sizes, to test this script without a GPU.
# STEPS="gpu_tests ddp_nccl" runs only the steps named (a second run after a fix, within the
# device time left; a step on the packed data needs synth_shapes and pack_raw / pack_jpeg too).
set -u
OUT=$(realpath -m -- "${1:?usage: bash benchmarks/gpu.sh OUT_DIR [BACK_DIR]}")
BACK=${2:+$(realpath -m -- "$2")}
[[ ${SMOKE:-0} == 1 ]] || BUDGET_S=${BUDGET_S:-470}
SMOKE=${SMOKE:-0}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
# a rerun starts clean (stale logs and runs would mix in); a folder gpu.sh did not make is kept
if [[ -d $OUT && -n $(ls -A "$OUT") ]]; then
    [[ -f $OUT/.gpu-sh ]] || { echo "gpu.sh: $OUT is not empty and not an earlier gpu.sh run" >&2; exit 2; }
    rm -rf "${OUT:?}"/* "$OUT"/.gpu-sh
fi
mkdir -p "$OUT" && touch "$OUT/.gpu-sh"
# what the device tool brings back (at most 8 files): the summary (rebuilt each time), the
# steps, the hardware and one results.tgz of every log and figure under 4 MiB (no shards, no
# checkpoints); each file replaced whole (a step in the background may call this at once)
bring_back() {
    [[ -n $BACK ]] || return 0
    mkdir -p "$BACK"
    # one at a time (the background prep calls this too); without flock, unlocked
    local lock
    exec {lock}>> "$OUT/.gpu-sh"  # (the marker file, as the lock)
    command -v flock > /dev/null && flock "$lock"
    local tag=$BASHPID f  # (each process's own temporary names)
    (cd "$REPO" && "$PY" benchmarks/gpu_summary.py "$OUT" > "$OUT/summary.txt.$tag" 2>&1) &&
        mv "$OUT/summary.txt.$tag" "$OUT/summary.txt" || rm -f "$OUT/summary.txt.$tag"
    for f in summary.json summary.txt steps.txt skipped.txt stopped.txt hardware.txt; do
        [[ -f $OUT/$f ]] && cp "$OUT/$f" "$BACK/$f.$tag" && mv "$BACK/$f.$tag" "$BACK/$f"
    done
    local keep=(-type f \( -name '*.log' -o -name '*.json' -o -name '*.txt' -o -name '*.csv'
                -o -name '*.png' -o -name '*.yaml' \) -not -name '*.[0-9]*')
    (cd "$OUT" && find -L . "${keep[@]}" -size +4194303c > "$BACK/left_out.txt.$tag")
    if [[ -s $BACK/left_out.txt.$tag ]]; then mv "$BACK/left_out.txt.$tag" "$BACK/left_out.txt"
    else rm -f "$BACK/left_out.txt.$tag" "$BACK/left_out.txt"; fi
    # tar says 1 for a file that grew while read (a log, nvidia-smi's trace): still a good copy
    (cd "$OUT" && find -L . "${keep[@]}" -size -4194304c |
        tar czf "$BACK/results.tgz.$tag" --warning=no-file-changed -T -)
    if (( $? <= 1 )); then mv "$BACK/results.tgz.$tag" "$BACK/results.tgz"
    else rm -f "$BACK/results.tgz.$tag"; fi
    exec {lock}>&-
}
CURRENT=""  # the step in flight: a run stopped by a signal names it
on_signal() {
    [[ -n $CURRENT ]] && echo "$CURRENT: rc=143 interrupted" >> "$OUT/steps.txt"
    exit 143
}
# the runs' folders in /dev/shm (see SHM_RUNS) come back under OUT/runs without their
# checkpoints, and the memory they took is freed
runs_home() {
    [[ -n ${SHM_RUNS:-} && -d $SHM_RUNS ]] || return 0
    local link target
    for link in "$RUN"/*; do
        [[ -L $link ]] || continue
        target=$(readlink "$link")
        rm -f "$link" && mkdir -p "$link"
        (cd "$target" && find . -type f ! -name '*.pt' -exec cp --parents {} "$link" \;)
    done
    rm -rf "$SHM_RUNS"
}
on_exit() {
    [[ -n ${SMI:-} ]] && kill "$SMI" 2>/dev/null
    runs_home
    bring_back
}
trap on_exit EXIT
trap on_signal TERM INT  # (bash runs it once the step in flight has ended)
START=$(date +%s)
cd "$REPO"
# pydantic, simplejpeg, ...: carried as wheels (gpu_wheels.sh) where the image lacks them; the
# image's own typing_extensions is kept when it is as new as the carried one
# (FORCE_WHEELS=1: install them even where importable, to rehearse this on a CPU machine)
if { [[ ${FORCE_WHEELS:-0} == 1 ]] || ! "$PY" -c 'import pydantic, simplejpeg' 2>/dev/null; } &&
    ls .whl/*.whl > /dev/null 2>&1; then
    wheels=()
    for w in .whl/*.whl; do
        if [[ $(basename "$w") == typing_extensions-* ]]; then
            v=$(basename "$w" | cut -d- -f2)
            "$PY" -c "import sys, importlib.metadata as m
have = tuple(int(p) for p in m.version('typing_extensions').split('.')[:3])
sys.exit(0 if have >= tuple(int(p) for p in '$v'.split('.')[:3]) else 1)" 2>/dev/null && continue
        fi
        wheels+=("$w")
    done
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/cnnkit-site "${wheels[@]}" > "$OUT/wheels.log" 2>&1; then
        echo "wheels: pip failed, unzipped instead" >> "$OUT/wheels.log"  # a wheel is a zip
        for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" /tmp/cnnkit-site >> "$OUT/wheels.log" 2>&1; done
    fi
    export PYTHONPATH="/tmp/cnnkit-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import pydantic, simplejpeg' 2>/dev/null; then  # every step would fail
    echo "gpu.sh: pydantic or simplejpeg missing: run benchmarks/gpu_wheels.sh here and carry .whl" \
        | tee -a "$OUT/stopped.txt" >&2
    exit 1
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ $SMOKE == 1 ]]; then  # a slow CPU: every limit SLOW times longer
    DEV=cpu B=4 BIG=8 REPEATS=2 CLASSES=10 PER_CLASS=4 QUICK=--quick COMPILE=--no-compile SLOW=4
    POLICY_SIZE=32
    LAYER_REPEATS=2 EPOCHS=2 BATCHES=6 JOBS=2 BUDGET_S=${BUDGET_S:-1800}
else  # 12 x 1334 JPEGs: the prep's 12 processes leave 4 of the 16 cores to the CUDA tests
    DEV=cuda B=256 BIG=1024 REPEATS=10 CLASSES=12 PER_CLASS=1334 QUICK= COMPILE=--compile SLOW=1
    POLICY_SIZE=224
    LAYER_REPEATS=10 EPOCHS=5 BATCHES=200 JOBS=12
fi
if [[ $DEV == cuda ]]; then
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' > "$OUT/cuda_check.log" 2>&1
    rc=$?
    if (( rc == 3 )); then
        echo "no CUDA device on $(hostname): GPU measurements skipped" | tee "$OUT/stopped.txt"
        exit 0
    elif (( rc != 0 )); then
        echo "gpu.sh: torch failed to import (cuda_check.log):" | tee -a "$OUT/stopped.txt" >&2
        tail -n 3 "$OUT/cuda_check.log" | tee -a "$OUT/stopped.txt" >&2
        exit 2
    fi
fi
"$PY" - > "$OUT/hardware.txt" <<'PY'
import os, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("gpu:", gpu, "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("cpu:", platform.processor() or platform.machine(), "| cores", len(os.sched_getaffinity(0)))
print("kernel:", platform.release())  # 4.4.0: gVisor, which may refuse to page-lock /dev/shm
PY
# containers often give /dev/shm 64 MB; the loader's slot rings need a few GB (root may grow it)
shm_kb=$(df -k --output=size /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')
if [[ $DEV == cuda && ${shm_kb:-0} -lt $(( 16 * 1024 * 1024 )) ]]; then
    mount -o remount,size=32G /dev/shm 2>/dev/null ||
        { mkdir -p /dev/shm && mount -t tmpfs -o size=32G tmpfs /dev/shm 2>/dev/null; } ||
        echo "shm: could not grow /dev/shm" >> "$OUT/hardware.txt"
fi
df -h /dev/shm | tail -n 1 | awk '{print "shm: " $2 " (" $4 " free)"}' >> "$OUT/hardware.txt"
date -u +"%Y-%m-%dT%H:%M:%SZ" >> "$OUT/hardware.txt"
[[ -z ${STEPS:-} ]] || echo "steps selected: $STEPS" >> "$OUT/hardware.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,memory.total,power.limit \
    --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
# the GPU's clocks, memory, power and throttling every 2 s through the run (gpu_summary.py
# reads the peaks and the clock under load)
# (the throttle reasons' field is left out where this driver does not know its name)
if [[ $DEV == cuda ]] && command -v nvidia-smi > /dev/null; then
    fields=timestamp,utilization.gpu,clocks.sm,clocks.mem,memory.used,power.draw,temperature.gpu
    nvidia-smi --query-gpu=$fields,clocks_throttle_reasons.active --format=csv > /dev/null 2>&1 &&
        fields+=,clocks_throttle_reasons.active
    nvidia-smi --query-gpu=$fields --format=csv,nounits -l 2 > "$OUT/nvidia-smi-trace.csv" 2>&1 &
    SMI=$!
fi

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
    CURRENT=$name
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    CURRENT=""
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

CK=("$PY" -m cnnkit --debug)  # a one-shot run: a failure's whole traceback in its log
T=("${CK[@]}" bench train -d "$DEV" --repeats "$REPEATS" $QUICK --json)
L=("${CK[@]}" bench loader -b "$B" -d "$DEV" --crop 224 --json)
RUN="$OUT/runs"
mkdir -p "$RUN"
# the `cnnkit train` runs' checkpoints (AlexNet: about 0.7 GB an epoch) go to memory, not to a
# disk of unknown speed that could push a step past its limit: their folders are links into
# /dev/shm where it has room (found through the links by bring_back's `find -L`; at the end
# runs_home brings them back without their checkpoints)
SHM_RUNS=/dev/shm/cnnkit-gpu-runs
rm -rf "$SHM_RUNS"
shm_free_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1 | tr -d ' ')
if (( ${shm_free_kb:-0} > 12 * 1024 * 1024 )); then
    for r in packed-raw packed-jpeg ddp avg synthetic; do
        mkdir -p "$SHM_RUNS/$r" && ln -s "$SHM_RUNS/$r" "$RUN/$r"
    done
    echo "runs: checkpoints in $SHM_RUNS" >> "$OUT/hardware.txt"
fi
for kind in raw jpeg; do
    decode=cpu; [[ $kind == jpeg ]] && decode=gpu
    cat > "$RUN/$kind.yaml" <<YAML
name: alexnet-$kind
model: alexnet-owt
data: {source: packed, path: $RUN/$kind, crop: 224, batch_size: $B, decode: $decode}
train: {epochs: $EPOCHS, device: $DEV, optimizer: sgd, lr: 0.01}
YAML
done
cat > "$RUN/synthetic.yaml" <<YAML
name: alexnet-synthetic
model: alexnet-owt
data: {source: synthetic, shape: [3, 224, 224], num_classes: 1000, train_size: $(( B * 40 )),
       val_size: $B, batch_size: $B}
train: {epochs: 2, device: $DEV}
YAML

# 0. the data, made on the CPU while the CUDA tests run (their figures are not timed): JPEGs
# synthesised (a process per class), packed raw and as JPEG shards (JOBS processes)
prep() {
    step synth_shapes       60 "${CK[@]}" synth shapes "$RUN/shapes" --classes "$CLASSES" \
        --per-class "$PER_CLASS" --size 256
    step pack_raw           45 "${CK[@]}" pack "$RUN/shapes" "$RUN/raw" --size 256 -j "$JOBS"
    step pack_jpeg          45 "${CK[@]}" pack "$RUN/shapes" "$RUN/jpeg" --size 256 --format jpeg -j "$JOBS"
}
prep &
PREP=$!
# 1. the CUDA tests: if the path is broken, the figures below say little
# (3 processes, not 16: each starts CUDA; SMOKE: all skipped; without pytest-xdist, pyproject's
# "-n auto" is replaced; with pytest-timeout a hung test fails alone, leaving the summary line)
if "$PY" -c 'import xdist' 2>/dev/null; then ONE=(-n 3); else ONE=(-o "addopts=-ra"); fi
"$PY" -c 'import pytest_timeout' 2>/dev/null && ONE+=(--timeout 150)
# (-v: each test named as it ends, so a pytest killed at its limit still says which passed)
step gpu_tests 180 "$PY" -m pytest -v -m gpu "${ONE[@]}" --durations 8 -p no:cacheprovider tests
wait "$PREP"  # nothing timed shares the CPU with the packing
# 2. the flagship's training step: every precision x format interleaved, both torchvision
# peers; then the large batch, the likeliest best bf16 figure
# (--max-seconds: the timing stops well inside the step's limit, so a slow step still reports)
step train_owt_256_explore  90 "${T[@]}" alexnet-owt -b "$B" --explore --baseline \
    --max-seconds $(( 45 * SLOW ))
step train_owt_1024_bf16    60 "${T[@]}" alexnet-owt -b "$BIG" -p bf16 --channels-last \
    --max-seconds $(( 30 * SLOW ))
# 3. the loader alone (the ring's prefetched batches untimed), then `cnnkit train` end to end
# from packed data: raw shards, JPEG shards decoded on the GPU
step loader_raw             40 "${L[@]}" "$RUN/raw" --batches "$BATCHES"
step loader_jpeg_gpu        40 "${L[@]}" "$RUN/jpeg" --decode gpu --batches "$BATCHES"
step train_packed_raw       75 "${CK[@]}" train "$RUN/raw.yaml" --out "$RUN/packed-raw" --quiet
step train_packed_jpeg_gpu  75 "${CK[@]}" train "$RUN/jpeg.yaml" --out "$RUN/packed-jpeg" --quiet
# 4. one-process NCCL groups, DDP and the first seed's weight averaging: CUDA-only paths, before
# the figures below that only add to the ones above
step ddp_nccl               60 "${CK[@]}" train "$RUN/raw.yaml" --nproc 1 --out "$RUN/ddp" --quiet \
    train.epochs=1
step average_nccl           60 "${CK[@]}" train "$RUN/raw.yaml" --nproc 1 --out "$RUN/avg" --quiet \
    train.epochs=1 train.sync=average
# 5. the 2012 AlexNet, inference
step train_alexnet2012      60 "${T[@]}" alexnet -b "$B" --max-seconds $(( 30 * SLOW ))
step infer_owt              45 "${CK[@]}" bench infer alexnet-owt -b "$B" -d "$DEV" $QUICK --json \
    --max-seconds $(( 20 * SLOW ))
# 6. torch.compile (a minute or two of compiling, cold), per-layer times, the scaling study
# (CPU and GPU halves) in fp32 and bf16, the rest
step train_owt_compile     150 "${T[@]}" alexnet-owt -b "$B" -p bf16 --channels-last "$COMPILE" \
    --max-seconds $(( 30 * SLOW ))
step layers_owt             45 "${CK[@]}" bench layers alexnet-owt -b "$B" -d "$DEV" \
    --repeats "$LAYER_REPEATS" --json
step scaling_fp32          100 "${CK[@]}" bench scaling --devices "cpu,$DEV" -o "$OUT/scaling-fp32" $QUICK --json
step scaling_bf16           80 "${CK[@]}" bench scaling --devices "cpu,$DEV" -p bf16 \
    -o "$OUT/scaling-bf16" --quick --json
step loader_jpeg_cpu        40 "${L[@]}" "$RUN/jpeg" --batches $(( BATCHES / 2 ))
step train_synthetic        60 "${CK[@]}" train "$RUN/synthetic.yaml" --out "$RUN/synthetic" --quiet
# 7. RandAugment / TrivialAugment on the device: cnnkit's batched ops against torchvision's
# per-image transforms (whose affine ops wait for the GPU)
step policy                 30 "$PY" benchmarks/policy_vs_torchvision.py --batch "$B" \
    --size "$POLICY_SIZE" --rounds 5 --device "$DEV"
rm -rf "$RUN/shapes"  # the JPEGs are only input; the results stay

touch "$OUT/complete"
"$PY" benchmarks/gpu_summary.py "$OUT" > "$OUT/summary.txt"
cat "$OUT/summary.txt"
echo "total $(( $(date +%s) - START ))s; results in $OUT"
