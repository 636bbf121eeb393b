#!/usr/bin/env bash
# A small, fast student from a trained teacher run, in one go: the teacher translates its training
# source (tfm distill) → the student is prepared on that and the original references → trained
# (model.size: student, its shape from the teacher's) → its lexical shortlist → both scored on the
# test set at their shipped settings → the student exported int8 for CTranslate2.
#   scripts/student.sh                          (the teacher: runs/quickstart, README command 1's run)
#   TEACHER=runs/de-en TIME=30m scripts/student.sh
#   ORIGINAL=data/multi30k/train                (the references beside the distilled corpus)
#   CONFIG=configs/student-tiny.yaml            (the student's config; its vocabulary settings must
#                                                be the teacher's)
# Writes STUDENT_DIR (default TEACHER-student/) and its export STUDENT_DIR/export/. Re-running
# continues: distillation and training resume, prepare is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
TEACHER=${TEACHER:-runs/quickstart}
TIME=${TIME:-10m}
STUDENT_DIR=${STUDENT_DIR:-$TEACHER-student}
CONFIG=${CONFIG:-configs/student-tiny.yaml}
ORIGINAL=${ORIGINAL:-data/multi30k/train}
if [ ! -f "$TEACHER/config.yaml" ]; then
  echo "error: $TEACHER/config.yaml: no trained run there to be the teacher (train one first: scripts/quickstart.sh; or give TEACHER=RUN)" >&2
  exit 2
fi
RUN=(--set run_dir="$STUDENT_DIR" --set vocab.from_run="$TEACHER"
     --set "data.train=[$TEACHER/distilled/train,$ORIGINAL]")

tfm distill --config "$TEACHER/config.yaml"
tfm prepare --config "$CONFIG" "${RUN[@]}"
if [ -f "$STUDENT_DIR"/checkpoints/checkpoint_last.pt ]; then
  tfm train --config "$CONFIG" "${RUN[@]}" --set train.max_time="$TIME" --resume
else
  tfm train --config "$CONFIG" "${RUN[@]}" --set train.max_time="$TIME"
fi
tfm shortlist --config "$CONFIG" "${RUN[@]}"
echo "the teacher, at its shipped settings:"
tfm evaluate --config "$TEACHER/config.yaml" --split test --metrics bleu,chrf
echo "the student, at its shipped settings (its config's beam and shortlist):"
tfm evaluate --config "$CONFIG" "${RUN[@]}" --split test --metrics bleu,chrf
tfm export --config "$CONFIG" "${RUN[@]}" --quantization int8 -o "$STUDENT_DIR"/export --force
cat <<EOF

Student:  $STUDENT_DIR/checkpoints/ (--config picks the best-validated checkpoint)
Export:   $STUDENT_DIR/export/ (int8, CTranslate2, its shortlist beside it)
Translate with it:
  echo "Ein Hund rennt über eine Wiese." | tfm translate --model $STUDENT_DIR/export
Its speed against the teacher's (equal and shipped settings): python scripts/bench_distill.py --help
EOF
