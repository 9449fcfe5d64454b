#!/usr/bin/env bash
# Every GPU measurement of cnnkit in one run, sized for < 8 minutes on one H200:
#   AlexNet training (bench train) in bf16 / fp16, channels_last on / off, torch.compile on / off,
#   fp32 and inference for reference; per-layer times; cnnkit vs torchvision's plain loop;
#   `cnnkit train` from synthetic and from packed data; the loader; the CPU/GPU scaling study.
#
#   bash benchmarks/gpu.sh OUT_DIR        # results: OUT_DIR/*.log, *.json, summary.txt
#
# Without a CUDA device it writes OUT_DIR/skipped.txt, skips every GPU part and exits 0.
# Each step has its own time limit and the whole run a budget (BUDGET_S, default 470 s):
# a step that would not fit is skipped and listed, never left half-written.
# SMOKE=1 runs every step on the CPU with tiny sizes, to test this script without a GPU.
set -u
OUT=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
BUDGET_S=${BUDGET_S:-470}
SMOKE=${SMOKE:-0}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
START=$(date +%s)
cd "$REPO"

if [[ $SMOKE == 1 ]]; then
    DEV=cpu B=4 REPEATS=2 TRAIN_SIZE=16 PER_CLASS=4 QUICK=--quick COMPILE=--no-compile FP16=bf16
    WORKERS=2 LAYER_REPEATS=2
else
    DEV=cuda B=256 REPEATS=20 TRAIN_SIZE=10240 PER_CLASS=200 QUICK= COMPILE=--compile FP16=fp16
    WORKERS=8 LAYER_REPEATS=10
fi
if [[ $DEV == cuda ]] &&
    ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "no CUDA device on $(hostname): GPU measurements skipped" | tee "$OUT/skipped.txt"
    exit 0
fi
"$PY" - > "$OUT/hardware.txt" <<'PY'
import platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("gpu:", gpu, "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("cpu:", platform.processor() or platform.machine(), "| threads", torch.get_num_threads())
PY
date -u +"%Y-%m-%dT%H:%M:%SZ" >> "$OUT/hardware.txt"

# step NAME LIMIT_S COMMAND...: run with a time limit, stdout to NAME.log, last line to NAME.json
step() {
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    if (( left < limit / 2 )); then
        echo "$name: skipped (${left}s of the budget left)" | tee -a "$OUT/skipped.txt"
        return
    fi
    (( limit > left )) && limit=$left
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 1 "$OUT/$name.log" | "$PY" -c 'import json,sys; json.loads(sys.stdin.read())' \
        2>/dev/null && tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
    echo "$name: rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
}

CK=("$PY" -m cnnkit)
T=("${CK[@]}" bench train alexnet-owt -b "$B" -d "$DEV" --repeats "$REPEATS" $QUICK --json)
# Order: every kind of figure early; torch.compile (minutes of compiling) last, where the budget
# check drops it first if earlier steps ran long.
# 1. training throughput of the flagship (the headline figures first), inference
step train_bf16_cl         60 "${T[@]}" -p bf16 --channels-last
step train_fp16_cl         60 "${T[@]}" -p "$FP16" --channels-last
step train_bf16_nchw       60 "${T[@]}" -p bf16 --no-channels-last
step train_fp16_nchw       60 "${T[@]}" -p "$FP16" --no-channels-last
step train_fp32_nchw       60 "${T[@]}" -p fp32 --no-channels-last
step infer_bf16_cl         60 "${CK[@]}" bench infer alexnet-owt -b "$B" -d "$DEV" -p bf16 $QUICK --json
# 2. the peer comparison
step vs_torchvision        90 "$PY" benchmarks/train_vs_torchvision.py --device "$DEV" --batch "$B" \
    --repeats "$REPEATS" --warmup 3 --json
# 3. real training runs: synthetic data, then packed data (synthesised, packed, trained, loaded)
RUN="$OUT/runs"
mkdir -p "$RUN"
cat > "$RUN/synthetic.yaml" <<YAML
name: alexnet-synthetic
model: alexnet-owt
data: {source: synthetic, shape: [3, 224, 224], num_classes: 1000, train_size: $TRAIN_SIZE,
       val_size: $B, batch_size: $B}
train: {epochs: 2, device: $DEV}
YAML
step train_synthetic       90 "${CK[@]}" train "$RUN/synthetic.yaml" --out "$RUN/synthetic" --quiet
step synth_shapes          60 "${CK[@]}" synth shapes "$RUN/shapes" --classes 10 \
    --per-class "$PER_CLASS" --size 256
step pack                  60 "${CK[@]}" pack "$RUN/shapes" "$RUN/packed" --size 256
cat > "$RUN/packed.yaml" <<YAML
name: alexnet-packed
model: alexnet-owt
data: {source: packed, path: $RUN/packed, crop: 224, batch_size: $B, workers: $WORKERS}
train: {epochs: 3, device: $DEV}
YAML
step train_packed          90 "${CK[@]}" train "$RUN/packed.yaml" --out "$RUN/packed-run" --quiet
step loader                60 "${CK[@]}" bench loader "$RUN/packed" -j "$WORKERS" -b "$B" --batches 20 \
    -d "$DEV" --crop 224 --json
# 4. the scaling study (CPU half and GPU half in one run), per-layer times, the 2012 AlexNet
step scaling              150 "${CK[@]}" bench scaling --devices "cpu,$DEV" -o "$OUT/scaling" $QUICK --json
step layers_bf16           60 "${CK[@]}" bench layers alexnet-owt -b "$B" -d "$DEV" -p bf16 \
    --channels-last --repeats "$LAYER_REPEATS" --json
step train_alexnet2012_bf16 60 "${CK[@]}" bench train alexnet -b "$B" -d "$DEV" -p bf16 $QUICK --json
# 5. torch.compile
step train_bf16_cl_compile 120 "${T[@]}" -p bf16 --channels-last "$COMPILE"
step train_fp16_cl_compile 120 "${T[@]}" -p "$FP16" --channels-last "$COMPILE"
rm -rf "$RUN/shapes"  # the JPEGs are only input; the results stay

"$PY" - "$OUT" > "$OUT/summary.txt" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    r = json.load(open(path))
    name = os.path.basename(path)[:-5]
    if "images_per_second" in r and "peak_fraction" in r:
        print(f"{name:24s} {r['images_per_second']:10.1f} images/s  step {r['step_ms']:8.2f} ms  "
              f"{r['flops_per_second'] / 1e12:7.2f} TFLOP/s  {100 * r['peak_fraction']:5.1f}% of peak")
    elif "ratio" in r:
        print(f"{name:24s} cnnkit / torchvision = {r['ratio']:.2f}x")
    elif "forward_sum_ms" in r:
        print(f"{name:24s} step {r['step_ms']:.2f} ms as a whole; forward sum {r['forward_sum_ms']:.2f}"
              f" vs whole {r['forward_whole_ms']:.2f} ms; backward sum {r['backward_sum_ms']:.2f}"
              f" vs whole {r['backward_whole_ms']:.2f} ms")
    elif "images_per_second" in r:
        print(f"{name:24s} {r['images_per_second']:10.1f} images/s")
    elif "networks" in r:
        for n in r["networks"]:
            s = n["speedup"] or {}
            print(f"scaling {n['name']:16s} {n['macs'] / 1e6:9.1f} M mult-adds  GPU/CPU speed-up "
                  f"train {s.get('train', float('nan')):6.1f}x  classify {s.get('infer', float('nan')):6.1f}x")
    else:
        print(f"{name:24s} {json.dumps(r)[:160]}")
for run in sorted(glob.glob(os.path.join(out, "runs", "*", "summary.json"))):
    s = json.load(open(run))
    print(f"cnnkit train {run.split(os.sep)[-2]:12s} {s.get('images_per_second')} images/s, "
          f"{s.get('wall_seconds')} s wall")
PY
cat "$OUT/summary.txt"
echo "total $(( $(date +%s) - START ))s; results in $OUT"
