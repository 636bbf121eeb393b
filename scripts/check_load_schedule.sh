#!/usr/bin/env bash
# The budget schedule under load: a TIME run of configs/de-en.yaml whose CPU is shared with a hog
# (two busy processes) for its first third, against an undisturbed run that makes the same number
# of steps. Target: test2016 BLEU (beam 5) of the hogged run within 1.0 of the undisturbed one.
#   TIME=9m scripts/check_load_schedule.sh        (writes runs/load-hog and runs/load-calm)
set -euo pipefail
cd "$(dirname "$0")/.."
TIME=${TIME:-9m}
C=configs/de-en.yaml
seconds=$(python -c "from transformer_cli.experiment.config import parse_duration as p; print(int(p('$TIME')))")
scripts/get_data.sh multi30k > /dev/null
rm -rf runs/load-hog runs/load-calm
tfm prepare --config $C --set run_dir=runs/load-hog > /dev/null
cp -r runs/load-hog runs/load-calm
for _ in 1 2; do timeout $((seconds / 3)) python -c "while True: pass" & done
tfm train --config $C --set run_dir=runs/load-hog --set train.max_time="$TIME" 2> runs/load-hog.log
wait
steps=$(python -c "
import torch
print(torch.load('runs/load-hog/checkpoints/checkpoint_last.pt', weights_only=False)['progress']['step'])")
tfm train --config $C --set run_dir=runs/load-calm --set train.max_time=null --set train.max_steps="$steps" \
  2> runs/load-calm.log
for run in hog calm; do
  bleu=$(tfm evaluate --config runs/load-$run/config.yaml --split test --json 2>/dev/null |
         python -c "import json, sys; print(round(json.load(sys.stdin)['scores']['bleu']['score'], 2))")
  echo "$run: $steps steps, test2016 BLEU $bleu"
done
