#!/usr/bin/env bash
# Domain adaptation, measured: the Multi30k de→en model (runs/de-en, from configs/de-en.yaml)
# fine-tuned on TED talks (configs/ted-de-en.yaml), against that parent as it is and against a
# model of the same size trained from scratch on the same TED data for the same time.
#   scripts/finetune_ted.sh            (after: tfm prepare/train --config configs/de-en.yaml)
#   TIME=5m scripts/finetune_ted.sh    (the budget of both TED trainings)
# Prints BLEU/chrF on the 1,200 held-out TED sentences and on Multi30k test2016 for each model.
set -euo pipefail
cd "$(dirname "$0")/.."
TIME=${TIME:-5m}
[ -f runs/de-en/checkpoints/checkpoint_last.pt ] || { echo "train the parent first: tfm train --config configs/de-en.yaml" >&2; exit 2; }

# The TED split: IWSLT's raw (cased) talks, split by talk set, never by line.
scripts/get_data.sh iwslt14 >/dev/null
scripts/get_data.sh multi30k >/dev/null
mkdir -p data/ted
for lang in de en; do  # 6,750 lines: 5,050 to train on, then tst2012's 1,700: 500 valid, 1,200 test
  gzip -dc data/iwslt14/test.raw.$lang.gz | sed -n '1,5050p' | gzip -c > data/ted/train.$lang.gz
  gzip -dc data/iwslt14/test.raw.$lang.gz | sed -n '5051,5550p' | gzip -c > data/ted/valid.$lang.gz
  gzip -dc data/iwslt14/test.raw.$lang.gz | sed -n '5551,6750p' | gzip -c > data/ted/test.$lang.gz
done

CHILD=(--config configs/ted-de-en.yaml --set train.max_time="$TIME")
# From scratch: the same model and budget, its own vocabulary, the parent's from-scratch schedule.
SCRATCH=(--config configs/ted-de-en.yaml --set run_dir=runs/ted-de-en-scratch --set vocab.from_run=null
         --set train.init_from=null --set train.lr=0.001 --set train.warmup=400 --set train.warmup_ratio=0.25
         --set train.max_time="$TIME")
for run in CHILD SCRATCH; do
  declare -n args=$run
  tfm prepare "${args[@]}"
  tfm train "${args[@]}"
done

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
score() {  # score NAME CONFIG-ARGS… : beam 5 on TED test and Multi30k test2016
  local name=$1; shift
  for test in data/ted/test data/multi30k/test_2016_flickr; do
    gzip -dc $test.de.gz | tfm translate "$@" --beam 5 2>/dev/null > "$tmp/hyp.en"
    gzip -dc $test.en.gz > "$tmp/ref.en"
    printf '%-28s %-32s ' "$name" "$test"
    tfm evaluate --hyp "$tmp/hyp.en" --ref "$tmp/ref.en" --metrics bleu,chrf --json |
      python -c 'import json,sys; r=json.load(sys.stdin); print(" ".join(k + " " + format(v["score"], ".2f") for k, v in r["scores"].items()))'
  done
}
score "parent (Multi30k)" --config configs/de-en.yaml
score "fine-tuned on TED" --config configs/ted-de-en.yaml
score "from scratch on TED" --config configs/ted-de-en.yaml --set run_dir=runs/ted-de-en-scratch
