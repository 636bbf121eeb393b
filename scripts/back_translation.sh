#!/usr/bin/env bash
# Back-translation, measured on Multi30k: half of the training pairs are kept as parallel data, the
# other half's English stands in for monolingual text (its German is thrown away). An en→de model
# trained on the parallel half samples German for that English, and de→en is trained twice for the
# same time: on the parallel half alone, and on the parallel half + the synthetic pairs
# (data.train listing both corpora).
#   scripts/back_translation.sh                 (TIME=12m each of the three trainings)
#   TIME=5m SAMPLING="--sample" scripts/back_translation.sh
#   TAG="<bt>" scripts/back_translation.sh      (tagged back-translation, Caswell et al. 2019: each
#                                                synthetic source line starts with TAG, so the model
#                                                can tell synthetic from real input; test input has none)
# Prints BLEU/chrF on Multi30k test2016 (beam 5) for both de→en models.
set -euo pipefail
cd "$(dirname "$0")/.."
TIME=${TIME:-12m}
SAMPLING=${SAMPLING:---sample --top-k 10}  # restricted sampling: the en→de model is small (Edunov et al. 2018)
SEED=${SEED:-1}
TAG=${TAG:-}

scripts/get_data.sh multi30k >/dev/null
bt=data/back-translation
mkdir -p "$bt"
for lang in de en; do  # 29,000 pairs: 14,500 parallel, then 14,500 English as "monolingual"
  gzip -dc data/multi30k/train.$lang.gz | sed -n '1,14500p' | gzip -c > "$bt/parallel.$lang.gz"
done
gzip -dc data/multi30k/train.en.gz | sed -n '14501,29000p' | gzip -c > "$bt/mono.en.gz"

common=(--set data.valid=data/multi30k/val --set data.test=data/multi30k/test_2016_flickr
        --set train.max_time="$TIME" --set train.seed="$SEED")
# 1. en→de on the parallel half, then German sampled for the monolingual English.
EN_DE=(--config configs/en-de.yaml --set run_dir=runs/bt-en-de --set data.train="$bt/parallel" "${common[@]}")
tfm prepare "${EN_DE[@]}"
tfm train "${EN_DE[@]}"
gzip -dc "$bt/mono.en.gz" | tfm translate "${EN_DE[@]}" $SAMPLING --seed "$SEED" | gzip -c > "$bt/synthetic.de.gz"
cp "$bt/mono.en.gz" "$bt/synthetic.en.gz"
synthetic=$bt/synthetic
if [ -n "$TAG" ]; then  # the tag as plain text: the joint vocabulary learns it from the training data
  synthetic=$bt/synthetic-tagged
  gzip -dc "$bt/synthetic.de.gz" | sed "s/^/$TAG /" | gzip -c > "$synthetic.de.gz"
  cp "$bt/synthetic.en.gz" "$synthetic.en.gz"
fi

# 2. de→en on the parallel half alone, and on parallel + synthetic pairs, for the same time.
BASE=(--config configs/de-en.yaml --set run_dir=runs/bt-de-en-parallel --set data.train="$bt/parallel" "${common[@]}")
BT=(--config configs/de-en.yaml --set run_dir=runs/bt-de-en-synthetic${TAG:+-tagged}
    --set "data.train=[$bt/parallel, $synthetic]" "${common[@]}")
for run in BASE BT; do
  declare -n args=$run
  tfm prepare "${args[@]}"
  tfm train "${args[@]}"
done

for run in BASE BT; do
  declare -n args=$run
  printf '%-36s ' "$run ($([ $run = BASE ] && echo "14.5k real pairs" || echo "+ 14.5k sampled back-translations"))"
  tfm evaluate "${args[@]}" --split test --beam 5 --metrics bleu,chrf --json |
    python -c 'import json,sys; r=json.load(sys.stdin); print(" ".join(k + " " + format(v["score"], ".2f") for k, v in r["scores"].items()))'
done
