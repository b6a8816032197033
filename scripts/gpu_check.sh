#!/usr/bin/env bash
# Every GPU-speed figure of docs/performance.md's H100 table, in one call of under 8 minutes on one GPU:
#
#   bash scripts/gpu_check.sh CIFAR10 [OUT]
#
# CIFAR10: a CIFAR-10 folder or .tar.gz (train/ and test/ trees, or the torchvision folder). OUT (default
# runs/gpu_check, new or empty): where the logs, bench JSON and run summaries go; its log.txt ends with the table of
# figures, under the device each input was measured on.
# In order of importance, each part bounded in time so that a failing part costs its own figures only:
#   1. the bench's pipeline section at the recipes' batch (256), with the defaults (the whole step one CUDA graph, the
#      model compiled inside it): each stage's loop against its bare step, img/s, the GPU's busy share, host reads
#      between records; then the same with the eager model inside the graph (run.compile=off: no compilation);
#   2. configs/pretrain/cpu.yaml and configs/finetune/cpu.yaml with schedule.budget_minutes=$BUDGET (default 1),
#      nvidia-smi sampled beside them; the fine-tuning starts from that pretraining;
#   3. ViT-B/16 at 224 px: our MAE step against Hugging Face's ViTMAE, our encoder step against timm's (eager);
#   4. the pretraining pipeline at batch 1024, the eager model inside the graph (compiling for a new shape alone took
#      about 115 s on an H100 host with an empty cache);
#   5. the loss over $CURVE_STEPS steps: eager steps, the same eager model's step replayed as one CUDA graph, and the
#      defaults (the same masks under compilation: inductor's fallback_random);
#   6. a profile of the pretraining loop (the kernels and host ops that cost most);
#   7. our encoder against torch.compile'd timm (the same mode as ours).
# A part that would end after DEADLINE seconds (default 500) is skipped. Should part 1 fail with the step's CUDA graph,
# it is run again without it (run.cuda_graph=off: the compiler's own CUDA graphs), and every later part runs that way.
# TORCHINDUCTOR_CACHE_DIR, if set, keeps compiled kernels between calls (a warm cache compiles in about 3 s).
# DRY=1 runs every part on a CPU with tiny settings (a check of the script, not a measurement).
set -uo pipefail
DATA=${1:?usage: bash scripts/gpu_check.sh CIFAR10 [OUT]}
OUT=${2:-runs/gpu_check}
BUDGET=${BUDGET:-1}
CURVE_STEPS=${CURVE_STEPS:-100}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
# A part skipped or stopped leaves the files of an earlier check in place, which the table would read as this one's.
if [[ -d $OUT && -n $(ls -A "$OUT") ]]; then
    echo "error: $OUT is not empty (an earlier check's files would be read as this one's): name a new OUT, or empty it" >&2
    exit 2
fi
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

QUICK=() DEVICE=cuda LARGE=1024 BASE=vit_base_p16 RUNS=(run.device=cuda)
if [[ ${DRY:-0} == 1 ]]; then
    QUICK=(--quick --rounds 1) DEVICE=cpu LARGE=64 BASE=vit_cifar_tiny RUNS=(run.device=cpu model.depth=2) BUDGET=0.1 CURVE_STEPS=6
fi
BENCH=("$PY" scripts/bench.py --device "$DEVICE" --data "$DATA" "${QUICK[@]}")
RUN=(run.tracker=none run.progress=false "run.dir=$OUT/runs" run.overwrite=true "data.root=$DATA" data.download=false "${RUNS[@]}")

# part NAME EXPECTED LIMIT COMMAND...: one part, its output into the log, stopped after LIMIT seconds; skipped when
# fewer than EXPECTED seconds are left before DEADLINE (the whole check's seconds, default 500).
DEADLINE=${DEADLINE:-500}
part() {
    local name=$1 expected=$2 limit=$3 start=$SECONDS rc
    shift 3
    if ((SECONDS + expected > DEADLINE)); then
        say "== $name: skipped, $((DEADLINE - SECONDS)) s left of DEADLINE=$DEADLINE"
        return 1
    fi
    ((limit > DEADLINE - SECONDS)) && limit=$((DEADLINE - SECONDS))
    say "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    timeout "$limit" "$@" >"$OUT/part.log" 2>&1
    rc=$?
    cat "$OUT/part.log" >>"$LOG"
    grep -E "^\[|^error|^budget|^compile|^done|Error" "$OUT/part.log"
    say "== $name: rc $rc in $((SECONDS - start)) s"
    return $rc
}
sample_gpu() { nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader,nounits -lms 500 >"$OUT/nvidia_smi_$1.csv" 2>/dev/null & echo $!; }

say "host: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo no GPU) | $("$PY" -c 'import torch, timm; print("torch", torch.__version__, "timm", timm.__version__)')"

GRAPH=auto
if ! part "1 pipeline, batch 256" 120 200 "${BENCH[@]}" --only pipeline --json "$OUT/bench_pipeline_256.json"; then
    GRAPH=off  # the step's CUDA graph failed here: every later part runs without it
    part "1 pipeline, batch 256, run.cuda_graph=off" 120 200 "${BENCH[@]}" --only pipeline --cuda-graph off --json "$OUT/bench_pipeline_256.json"
fi
part "1b pipeline, batch 256, eager model" 40 90 "${BENCH[@]}" --only pipeline --compile off --cuda-graph $GRAPH \
    --json "$OUT/bench_pipeline_eager_256.json"

PID=$(sample_gpu pretrain)
part "2a pretrain, ${BUDGET} min" $((${BUDGET%.*} * 60 + 15)) $((${BUDGET%.*} * 60 + 90)) "$PY" -m pretrain --config configs/pretrain/cpu.yaml \
    "${RUN[@]}" run.name=pretrain run.cuda_graph=$GRAPH "schedule.budget_minutes=$BUDGET"
kill "$PID" 2>/dev/null
PID=$(sample_gpu finetune)
part "2b finetune, ${BUDGET} min" $((${BUDGET%.*} * 60 + 15)) $((${BUDGET%.*} * 60 + 90)) "$PY" -m finetune --config configs/finetune/cpu.yaml \
    "${RUN[@]}" run.name=finetune run.cuda_graph=$GRAPH "finetune.init=$OUT/runs/pretrain" "schedule.budget_minutes=$BUDGET"
kill "$PID" 2>/dev/null

part "3 references, $BASE" 100 200 "${BENCH[@]}" --only "encoder/$BASE/bf16,mae-hf/$BASE/bf16" --models "$BASE" --json "$OUT/bench_refs.json"
part "4 pipeline pretrain, batch $LARGE" 40 90 "${BENCH[@]}" --only pipeline/pretrain --e2e-batch "$LARGE" --compile off --cuda-graph $GRAPH \
    --json "$OUT/bench_pipeline_eager_$LARGE.json"
CURVE=("$PY" -c 'import sys, torch._inductor.config as c; c.fallback_random = True; from pretrain.train import main; sys.exit(main(sys.argv[1:]))')
CURVE_ARGS=(--config configs/pretrain/cpu.yaml "${RUN[@]}" "schedule.max_steps=$CURVE_STEPS" run.log_every=1 mae.knn_every=0 data.val_size=0
            run.figure_every=0 mae.figure_images=0)
part "5a loss curve, eager" 30 60 "${CURVE[@]}" "${CURVE_ARGS[@]}" run.name=curve_off run.compile=off run.cuda_graph=off
part "5b loss curve, eager model, one CUDA graph" 30 60 "${CURVE[@]}" "${CURVE_ARGS[@]}" run.name=curve_graph run.compile=off run.cuda_graph=$GRAPH
part "5c loss curve, defaults" 40 150 "${CURVE[@]}" "${CURVE_ARGS[@]}" run.name=curve_auto run.cuda_graph=$GRAPH
part "6 profile" 25 60 "$PY" scripts/profile_step.py --device "$DEVICE" --data "$DATA" --cuda-graph $GRAPH --out "$OUT/profile.txt"
part "7 encoder against compiled timm" 60 150 "${BENCH[@]}" --only "encoder/$BASE/bf16" --models "$BASE" --compile-ref auto \
    --json "$OUT/bench_timm_compiled.json"

"$PY" scripts/gpu_report.py "$OUT" | tee -a "$LOG"
