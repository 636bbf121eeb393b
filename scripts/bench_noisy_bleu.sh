#!/usr/bin/env bash
# What corpus cleaning buys at equal training budget: test2016 BLEU of the quickstart's model trained
# on clean Multi30k, on Multi30k + 50% injected noise (scripts/make_noisy.py), and on the noisy corpus
# through the default filters (and, with ARMS including lexical, the lexical filter too; with model,
# the model filter, its runs given as FORWARD (de→en) and/or BACKWARD (en→de), or without them the
# models `tfm prepare` trains itself, data.filters.model.train_updates each: 4 x 1,000 updates by default).
#   TIME=10m scripts/bench_noisy_bleu.sh           (training budget per arm; default 10m)
#   ARMS="clean noisy filtered lexical" scripts/bench_noisy_bleu.sh
#   ARMS="clean model" FORWARD=runs/de-en BACKWARD=runs/en-de scripts/bench_noisy_bleu.sh
# Targets: noisy + default filters within 1.0 BLEU of clean; + the model filter within 0.5.
# Writes runs/noisy-bleu/<arm>/.
set -euo pipefail
cd "$(dirname "$0")/.."
TIME=${TIME:-10m}
ARMS=${ARMS:-clean noisy filtered}
OUT=${OUT:-runs/noisy-bleu}
CONFIG=configs/de-en.yaml
OFF=()
for f in text length copies characters repeats numbers language lexical duplicates; do
  OFF+=(--set "data.filters.$f.enabled=false")
done
scripts/get_data.sh multi30k
[ -f data/noisy-multi30k/train.labels ] || python scripts/make_noisy.py --data data/multi30k -o data/noisy-multi30k
NOISY=(--set data.train=data/noisy-multi30k/train)
mkdir -p "$OUT"
gzip -dc data/multi30k/test_2016_flickr.en.gz > "$OUT/test.ref.en"
for arm in $ARMS; do
  case $arm in
    clean) SETS=("${OFF[@]}") ;;
    noisy) SETS=("${NOISY[@]}" "${OFF[@]}") ;;
    filtered) SETS=("${NOISY[@]}") ;;
    lexical) SETS=("${NOISY[@]}" --set data.filters.lexical.enabled=true) ;;
    model)
      SETS=("${NOISY[@]}" --set data.filters.model.enabled=true)
      [ -n "${FORWARD:-}" ] && SETS+=(--set "data.filters.model.forward=$FORWARD")
      [ -n "${BACKWARD:-}" ] && SETS+=(--set "data.filters.model.backward=$BACKWARD") ;;
    *) echo "error: ARMS: unknown arm '$arm' (clean, noisy, filtered, lexical, model)" >&2; exit 2 ;;
  esac
  # the quickstart's schedule (scripts/quickstart.sh, inverse_sqrt); dropout pinned at 0.1, what
  # model.size auto chooses for 10 minutes, so that every arm trains alike
  RUN=(--set run_dir="$OUT/$arm" --set model.dropout=0.1 --set train.lr_schedule=inverse_sqrt "${SETS[@]}")
  tfm prepare --config "$CONFIG" "${RUN[@]}" --force --discard-checkpoints > "$OUT/$arm.prepare.txt"
  tfm train --config "$CONFIG" "${RUN[@]}" --set train.max_time="$TIME" 2> "$OUT/$arm.train.log"
  gzip -dc data/multi30k/test_2016_flickr.de.gz | tfm translate --config "$CONFIG" "${RUN[@]}" --beam 5 > "$OUT/$arm.hyp.en"
  echo "$arm: $(grep -E '^(read|kept)' "$OUT/$arm.prepare.txt" | tr -s ' ' | paste -sd ';') $(tfm evaluate --hyp "$OUT/$arm.hyp.en" --ref "$OUT/test.ref.en" --metrics bleu,chrf 2>&1 | grep -E '^(BLEU|chrF2) =' | cut -d' ' -f1-3 | paste -sd ' ')"
done
