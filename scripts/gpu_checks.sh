#!/usr/bin/env bash
# The GPU checks in one run, for a machine with one CUDA GPU and Multi30k under data/multi30k:
#   env     the GPU, torch, the CPU
#   tests   the CUDA DDP test (torchrun, nccl)
#   bench   tfm prepare, then scripts/bench_train.py --device cuda (steady state, CUDA events), tfm vs HF
#           MarianMT: configs/de-en.yaml (small), configs/de-en-gpu.yaml (the paper's base shape on Multi30k)
#           and, without any corpus, the WMT14 shapes at WMT14 en-de's sentence lengths (--synthetic wmt):
#           configs/wmt14-en-de-base.yaml and -big.yaml — tokens/s, MFU (targets: big ≥ 30%, base ≥ 15%,
#           both ≥ 1.3x HF), `tfm train`-like back-to-back tokens/s, peak GPU memory
#   train   tfm train --config configs/de-en-gpu.yaml for TRAIN_TIME (default 150s; after bench's
#           prepare), then tfm evaluate on test2016, beam 5
#   decode  scripts/bench_engines.py --device cuda on that checkpoint: tfm vs CTranslate2 on the GPU
# Usage: bash scripts/gpu_checks.sh OUT_DIR [section ...]   (default: all sections, in that order)
# Every section logs to OUT_DIR/<section>.log and has its own time limit, so one failing section
# does not stop the next.
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [section ...]}
shift
sections=${*:-env tests bench train decode}
mkdir -p "$out"
train_time=${TRAIN_TIME:-150s}
export PYTHONUNBUFFERED=1
tfm() { python3 -m transformer_cli "$@"; }

section() {  # section NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    local start=$SECONDS
    timeout "$limit" bash -c "$*" >"$out/$name.log" 2>&1
    echo "   exit $? after $((SECONDS - start)) s"
    tail -n 25 "$out/$name.log"
}

export -f tfm
for s in $sections; do
    case $s in
    env)
        section env 60 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
            lscpu | grep 'Model name'; python3 -c 'import torch, transformers; print(\"torch\", torch.__version__,
            \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__)';
            python3 -c 'import ctranslate2; print(\"ctranslate2\", ctranslate2.__version__,
            \"cuda devices\", ctranslate2.get_cuda_device_count())';
            ldconfig -p | grep -E 'libcublas(Lt)?\.so' || echo 'no libcublas in the loader cache'"
        ;;
    tests)
        section tests 150 "python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k cuda -rA"
        ;;
    bench)
        section prepare 120 "tfm prepare --config configs/de-en.yaml &
            tfm prepare --config configs/de-en-gpu.yaml & wait"
        section bench_small 120 "python3 scripts/bench_train.py --config configs/de-en.yaml --device cuda --steps 60 --warmup 20"
        section bench_base 120 "python3 scripts/bench_train.py --config configs/de-en-gpu.yaml --device cuda --max-tokens 8192 --steps 60 --warmup 20"
        section bench_wmt_base 120 "python3 scripts/bench_train.py --config configs/wmt14-en-de-base.yaml --synthetic wmt --device cuda --max-tokens 12288 --steps 40 --warmup 10"
        section bench_wmt_big 150 "python3 scripts/bench_train.py --config configs/wmt14-en-de-big.yaml --synthetic wmt --device cuda --max-tokens 16384 --steps 40 --warmup 10"
        ;;
    train)
        section train 330 "tfm train --config configs/de-en-gpu.yaml --set train.max_time=$train_time &&
            tfm evaluate --config configs/de-en-gpu.yaml --split test --beam 5"
        ;;
    decode)
        section decode 240 "python3 scripts/bench_engines.py --device cuda --rounds 2 --batch-size 64 \
            --checkpoint runs/de-en-gpu/checkpoints/checkpoint_best.pt \
            --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz"
        ;;
    *) echo "unknown section: $s (env tests bench train decode)" >&2; exit 2 ;;
    esac
done
