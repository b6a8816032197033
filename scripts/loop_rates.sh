# The training loop's rate at several batch sizes, one run after another on one device: fine-tuning from scratch
# (configs/baselines/vit_scratch_cpu.yaml) and MAE pretraining (configs/pretrain/cpu.yaml, decoder 128 wide with 2
# blocks), each the median of its 25-step records after the first. RESULTS.md ("One GPU: search round 2") has its figures.
#
#   bash scripts/loop_rates.sh PATH [OUT]          # PATH: CIFAR-10's train/ (shared/data/README); OUT: runs/loop_rates
#   MODEL=vit_cifar_small BATCHES="256 1024" IMAGES=307200 DEVICE=cuda bash scripts/loop_rates.sh PATH   # the defaults
#
# Each run trains IMAGES images (1200 steps at batch 256), with run.compile=off (the step is still one CUDA graph on a
# GPU). These are loop rates of sequential runs, not the bench's interleaved rounds (scripts/bench.py): nothing else
# should share the device while they run.
set -euo pipefail
DATA=${1:?usage: bash scripts/loop_rates.sh PATH [OUT]}
OUT=${2:-runs/loop_rates}
MODEL=${MODEL:-vit_cifar_small}; BATCHES=${BATCHES:-256 1024}; IMAGES=${IMAGES:-307200}; DEVICE=${DEVICE:-cuda}
export PYTHONPATH=${PYTHONPATH:-.}
mkdir -p "$OUT"  # the runs, and each run's output as <run>.log beside them
R=(run.tracker=none run.progress=false run.dir="$OUT" run.overwrite=true data.root="$DATA" run.device="$DEVICE" run.compile=off
   run.log_every=25 model.name="$MODEL")
for b in $BATCHES; do
  steps=$((IMAGES / b))
  python -m finetune --config configs/baselines/vit_scratch_cpu.yaml "${R[@]}" run.name="ft_b$b" optim.batch_size="$b" \
    schedule.max_steps="$steps" > "$OUT/ft_b$b.log" 2>&1 || { echo "ft_b$b failed: $OUT/ft_b$b.log"; exit 1; }
  python -m pretrain --config configs/pretrain/cpu.yaml "${R[@]}" run.name="mae_b$b" optim.batch_size="$b" schedule.max_steps="$steps" \
    mae.knn_every=0 mae.val_every=1000 run.figure_every=0 mae.decoder_embed_dim=128 mae.decoder_depth=2 mae.decoder_num_heads=4 \
    > "$OUT/mae_b$b.log" 2>&1 || { echo "mae_b$b failed: $OUT/mae_b$b.log"; exit 1; }
done
python - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

for summary in sorted(Path(sys.argv[1]).glob("*/summary.json")):
    s = json.loads(summary.read_text())
    rates = [r for r in (json.loads(line).get("images_per_sec") for line in (summary.parent / "metrics.jsonl").read_text().splitlines()) if r]
    median = round(statistics.median(rates[1:] or rates)) if rates else None
    print(f"{summary.parent.name}: {median} img/s (median of {len(rates[1:] or rates)} records after the first), {s['steps']} steps, "
          f"GPU busy {s.get('gpu_busy_percent')}%, {s['precision']}, {s['host'].get('gpu') or s['host']['cpu']}, torch {s['host']['torch']}")
PY
