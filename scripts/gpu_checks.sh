#!/usr/bin/env bash
# The GPU checks in one run, for a machine with one CUDA GPU, within a time budget (default 520 s,
# so the whole call, wheel installs included, stays under 9 minutes). Sections in their order: the
# targets first (env to tests fit the default budget together), then the open questions and the rest:
#   env              the GPU, torch, transformers, CTranslate2, the host CPU
#   bench_wmt_big    scripts/bench_train.py --device cuda on configs/wmt14-en-de-big.yaml as `tfm train` runs
#                    it (its batch size, 32,768 tokens; its train.compile: true) at WMT14 en-de's sentence
#                    lengths (--synthetic wmt, no corpus): tfm vs HF MarianMT, steady state, back to back, the
#                    first pass over new batch shapes, and a profile of where the GPU's time goes
#                    (targets: MFU >= 30%, >= 1.3x HF)
#   bench_wmt_base   the same as bench_wmt_big on configs/wmt14-en-de-base.yaml (targets: MFU >= 15%, >= 1.3x HF;
#                    compiled, it needs ~95 s)
#   train            tfm train --config configs/de-en-gpu.yaml for TRAIN_TIME (150s), then tfm evaluate on
#                    test2016, beam 5, at the config's length penalty (target: BLEU >= 41), and at 0.6 on
#                    test and valid (valid picks the penalty), the GPU's clocks sampled while it trains
#                    (train.clocks); its run directory is runs/gpu-checks/de-en-gpu, made afresh on every call
#   tests            the CUDA DDP test (torchrun, nccl)
#   auto             tfm train --config configs/de-en.yaml (model.size: auto) for TRAIN_TIME on the GPU: what
#                    the probe times and chooses there, then test2016 beam 5 (run dir runs/gpu-checks/de-en-auto)
#   auto_base        the same config with the paper's base shape pinned (512, 8 heads, 6+6, FFN 2048) at
#                    8,192-token batches, dropout 0.3, peak lr 7e-4: its valid BLEU at every evaluation is
#                    the curve that lets `auto` weigh that shape (runs/gpu-checks/de-en-auto-base)
#   train_budget     the same with train.lr_schedule=budget (the cosine decay to 0 when max_time ends that
#                    the CPU configs use) in runs/gpu-checks/de-en-gpu-budget: test and valid BLEU
#   big_bf16_weights bench_wmt_big with tfm's weights in bf16 and fp32 master copies in Adam (--bf16-weights)
#                    instead of bf16 autocast over fp32 weights: the elementwise work between matmuls at
#                    half the bytes (HF as before)
#   bench_loss       scripts/bench_loss.py --device cuda at the big shape's batch (28,000 target tokens,
#                    d_model 1024, 32k vocabulary): the output loss with its chunks eager vs fused by
#                    torch.compile (what train.compile: true trains with)
#   eager_big        bench_wmt_big without torch.compile (--compile off)
#   eager_base       bench_wmt_base without torch.compile
#   bench_base       bench_train.py on configs/de-en-gpu.yaml (the base shape on Multi30k's batches, what
#                    `train` trains), also timing `tfm train`'s own loop
#   bench_base_cudnn bench_base with SDPA allowed to pick cuDNN's attention (torch's default; tfm
#                    leaves it out): the first pass over new shapes is where the two differ
#   decode           scripts/bench_engines.py --device cuda on train's checkpoint: tfm vs CTranslate2
#   big_no_flash     bench_wmt_big with flash attention left out too (--no-flash-attention): decoder
#                    self-attention through the memory-efficient kernel, for tfm and HF alike (on an H200
#                    as fast as flash for tfm: kept for other GPUs)
#   bench_small      bench_train.py on configs/de-en.yaml
# `tfm prepare` of the Multi30k runs (the two configs' and the two train sections') runs in the
# background from the start, on the host's cores. The benchmarks skip their peak-memory child runs
# (--no-memory) to fit the budget.
#
# Usage: bash scripts/gpu_checks.sh OUT_DIR [section ...]   (default: all, in the order above)
#   BUDGET=SECONDS   the whole run's limit (520); a section gets what is left, capped at its own
#                    limit, and is skipped when less than its minimum is left
#   TRAIN_TIME=150s  the max_time of train, train_budget, auto and auto_base (whole seconds or minutes)
#   PLAN=1           print each section's command and limits instead of running it
# OUT_DIR receives summary.md (the final table, also printed; scripts/gpu_summary.py), sections.tsv
# and logs.tar.gz (every section's whole log, rewritten after each section: a run stopped from
# outside keeps what finished). A missing Python package travels as a wheel in .whl/ (see
# docs/performance.md, "The GPU checks"); Multi30k is found by scripts/get_data.sh.
set -u
out=${1:?usage: gpu_checks.sh OUT_DIR [section ...]}
shift
all="env bench_wmt_big bench_wmt_base train tests auto auto_base train_budget big_bf16_weights bench_loss eager_big eager_base bench_base bench_base_cudnn decode big_no_flash bench_small"
sections=${*:-$all}
for s in $sections; do
    case " $all " in *" $s "*) ;; *) echo "gpu_checks.sh: unknown section '$s' ($all)" >&2; exit 2 ;; esac
done
train_time=${TRAIN_TIME:-150s}
[[ $train_time =~ ^[0-9]+[sm]?$ ]] || { echo "gpu_checks.sh: TRAIN_TIME '$train_time' is not whole seconds (150s) or minutes (5m)" >&2; exit 2; }
train_seconds=${train_time%s}  # for the limits of the sections that train that long
[[ $train_time == *m ]] && train_seconds=$((${train_time%m} * 60))
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-checks.XXXXXX")  # the logs; OUT_DIR gets them as one archive
trap 'rm -rf "$work"' EXIT
budget=${BUDGET:-520}
gpu_config=configs/de-en-gpu.yaml  # what train and train_budget train
train_dir=runs/gpu-checks/de-en-gpu  # train's run (configs/de-en-gpu.yaml's own runs/de-en-gpu is left alone)
budget_dir=runs/gpu-checks/de-en-gpu-budget  # train_budget's
auto_dir=runs/gpu-checks/de-en-auto  # auto's
base_dir=runs/gpu-checks/de-en-auto-base  # auto_base's
base_shape="--set model.d_model=512 --set model.n_heads=8 --set model.enc_layers=6 --set model.dec_layers=6 \
--set model.d_ff=2048 --set model.dropout=0.3 --set train.max_tokens=8192 --set train.lr=0.0007"
plan=${PLAN:-0}
started=$SECONDS
: >"$work/sections.tsv"
export PYTHONUNBUFFERED=1

# Packages the GPU image lacks, carried as wheels; the checkout itself on the path (not installed there).
if [ "$plan" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$work/site" .whl/*.whl || echo "gpu_checks.sh: the wheels in .whl/ did not install" >&2
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
tfm() { python3 -m transformer_cli "$@"; }
export -f tfm

cublas12_shim() {  # CTranslate2's PyPI wheel links CUDA 12's cuBLAS; a CUDA 13 machine has only .so.13
    # (CTranslate2 counts the GPU either way: whether cuBLAS 12 loads is what decides)
    python3 -c 'import ctypes; ctypes.CDLL("libcublas.so.12"); ctypes.CDLL("libcublasLt.so.12")' 2>/dev/null && return
    mkdir -p "$work/cublas12"
    python3 - "$work/cublas12" <<'EOF'
import glob, os, site, subprocess, sys
found = {}
cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.split("\n")
for lib in ("libcublas", "libcublasLt"):
    paths = [line.split("=>")[-1].strip() for line in cache if f"{lib}.so.13 " in line]
    for base in site.getsitepackages():
        paths += sorted(glob.glob(os.path.join(base, "nvidia", "**", f"{lib}.so.13*"), recursive=True))
    if paths:
        os.symlink(paths[0], os.path.join(sys.argv[1], f"{lib}.so.12"))
        found[lib] = paths[0]
print("cuBLAS 12 names linked to CUDA 13's libraries (indicative, not a supported setup):", found or "none found")
EOF
    export LD_LIBRARY_PATH="$work/cublas12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
export -f cublas12_shim

evaluate_at() {  # evaluate_at CONFIG RUN_DIR SPLIT [LENGTH_PENALTY]: beam 5 on a trained run, after a
    # line gpu_summary.py reads as the label of the scores that follow (no penalty: the config's)
    echo "evaluate: $3, length penalty ${4:-of the config}"
    tfm evaluate --config "$1" --set run_dir="$2" --split "$3" --beam 5 ${4:+--set decode.length_penalty=$4}
}
export -f evaluate_at

gpu_clocks() {  # gpu_clocks FILE: the GPU's SM clock, power and temperature every 5 s until killed (at
    # most 400 s: a section cut by its timeout leaves none behind), and what holds the clock down
    # where this driver names it: is the GPU slower over 150 s of `tfm train` than in a bench's burst?
    local fields=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu
    nvidia-smi -i 0 --query-gpu=$fields,clocks_event_reasons.active --format=csv,noheader >/dev/null 2>&1 &&
        fields=$fields,clocks_event_reasons.active
    exec timeout 400 nvidia-smi -i 0 --query-gpu=$fields --format=csv,noheader -lms 5000 >"$1" 2>&1
}
export -f gpu_clocks

sampled_train() {  # sampled_train CLOCKS_FILE TFM_TRAIN_ARGS...: tfm train, gpu_clocks sampling meanwhile
    gpu_clocks "$1" &
    local clocks=$! trained
    shift
    tfm train "$@"
    trained=$?
    kill "$clocks"
    return "$trained"
}
export -f sampled_train
export work

prepare_pid=""
start_prepare() {  # the four Multi30k run directories, in the background (CPU work)
    [ "$plan" = 1 ] && { echo "== prepare (background): configs/de-en.yaml, configs/de-en-gpu.yaml, $train_dir, $budget_dir, $auto_dir and $base_dir"; return; }
    # this script's own runs: a call with `train` trains afresh; one without (decode on a still-warm
    # machine) keeps the checkpoint an earlier call trained (prepare leaves a prepared run as it is)
    case " $sections " in *" train "*) rm -rf "$train_dir" ;; esac
    case " $sections " in *" train_budget "*) rm -rf "$budget_dir" ;; esac
    case " $sections " in *" auto "*) rm -rf "$auto_dir" ;; esac
    case " $sections " in *" auto_base "*) rm -rf "$base_dir" ;; esac
    # Bounded like a section (a download that hangs offline must not hold the sections that wait for it).
    timeout -k 10 "$((budget / 2))" bash -c 'scripts/get_data.sh multi30k && {
      tfm prepare --config configs/de-en.yaml & p1=$!
      tfm prepare --config configs/de-en-gpu.yaml & p2=$!
      tfm prepare --config configs/de-en-gpu.yaml --set run_dir="$2" & p4=$!
      tfm prepare --config configs/de-en.yaml --set run_dir="$3" & p5=$!
      tfm prepare --config configs/de-en.yaml --set run_dir="$4" & p6=$!
      tfm prepare --config configs/de-en-gpu.yaml --set run_dir="$1"; r3=$?
      wait $p1; r1=$?; wait $p2; r2=$?; wait $p4; r4=$?; wait $p5; r5=$?; wait $p6; r6=$?
      echo $SECONDS >"$work/prepare.seconds"; exit $((r1 || r2 || r3 || r4 || r5 || r6)); }' \
        prepare "$train_dir" "$budget_dir" "$auto_dir" "$base_dir" >"$work/prepare.log" 2>&1 &
    prepare_pid=$!
    prepare_start=$SECONDS
}
await_prepare() {  # 0 once the four run directories are prepared
    [ "$plan" = 1 ] && return 0
    [ -n "$prepare_pid" ] || return 1
    if [ "$prepare_pid" != done ]; then
        wait "$prepare_pid"; prepare_rc=$?
        # its own duration (the wait for it may come long after it ended)
        printf 'prepare\t%s\t%s\t-\n' "$prepare_rc" "$(cat "$work/prepare.seconds" 2>/dev/null ||
            echo $((SECONDS - prepare_start)))" >>"$work/sections.tsv"
        prepare_pid=done
    fi
    return "$prepare_rc"
}

section() {  # section NAME MIN_SECONDS LIMIT_SECONDS COMMAND
    local name=$1 least=$2 limit=$3 command=$4
    local left=$((budget - (SECONDS - started)))
    ((limit > left)) && limit=$left
    if [ "$plan" = 1 ]; then
        printf '== %s (at least %ss, at most %ss)\n%s\n' "$name" "$least" "$3" "$command"
        return
    fi
    if ((left < least)); then
        echo "== $name skipped: ${left}s of the ${budget}s budget left, it needs ${least}s"
        printf '%s\tskipped\t0\t%s\n' "$name" "$least" >>"$work/sections.tsv"
        return
    fi
    echo "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    local start=$SECONDS
    timeout -k 10 "$limit" bash -c "$command" >"$work/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$work/sections.tsv"
    echo "   exit $rc after $((SECONDS - start)) s"
    tail -n 6 "$work/$name.log" | cut -c1-240
    archive
}

archive() {  # every log so far into OUT_DIR (a run stopped from outside keeps what finished)
    tar -czf "$out/logs.tar.gz" -C "$work" --exclude site --exclude cublas12 . 2>/dev/null
}

needs_data() {  # section NAME: skipped (with the reason) when prepare failed
    await_prepare && return 0
    echo "== $1 skipped: tfm prepare failed (prepare.log)"
    printf '%s\tno data\t0\t-\n' "$1" >>"$work/sections.tsv"
    return 1
}

case " $sections " in *" train"*|*" bench_base"*|*" bench_small "*|*" decode "*|*" tests "*|*" auto"*) start_prepare ;; esac
bench="python3 scripts/bench_train.py --device cuda"
for s in $sections; do
    case $s in
    env)
        section env 10 30 "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
            lscpu | grep 'Model name'; python3 -c 'import torch, transformers; print(\"torch\", torch.__version__,
            \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__)';
            python3 -c 'import ctranslate2; print(\"ctranslate2\", ctranslate2.__version__,
            \"cuda devices\", ctranslate2.get_cuda_device_count())'"
        ;;
    bench_base)
        needs_data bench_base && section bench_base 30 100 "$bench --config configs/de-en-gpu.yaml --max-tokens 8192 --steps 60 --warmup 20 --no-memory"
        ;;
    train)
        needs_data train && section train 220 270 "sampled_train $work/train.clocks --config $gpu_config --set run_dir=$train_dir --set train.max_time=$train_time &&
            evaluate_at $gpu_config $train_dir test && evaluate_at $gpu_config $train_dir test 0.6 &&
            evaluate_at $gpu_config $train_dir valid && evaluate_at $gpu_config $train_dir valid 0.6"
        ;;
    auto)
        needs_data auto && section auto $((train_seconds + 30)) $((train_seconds + 90)) "tfm train --config configs/de-en.yaml --set run_dir=$auto_dir --set train.max_time=$train_time &&
            evaluate_at configs/de-en.yaml $auto_dir test"
        ;;
    auto_base)
        needs_data auto_base && section auto_base $((train_seconds + 30)) $((train_seconds + 90)) "tfm train --config configs/de-en.yaml --set run_dir=$base_dir --set train.max_time=$train_time $base_shape &&
            evaluate_at configs/de-en.yaml $base_dir test"
        ;;
    train_budget)
        needs_data train_budget && section train_budget 180 250 "sampled_train $work/train_budget.clocks --config $gpu_config --set run_dir=$budget_dir --set train.max_time=$train_time --set train.lr_schedule=budget &&
            evaluate_at $gpu_config $budget_dir test && evaluate_at $gpu_config $budget_dir valid"
        ;;
    bench_wmt_big)
        section bench_wmt_big 60 150 "$bench --config configs/wmt14-en-de-big.yaml --synthetic wmt --max-tokens 32768 --steps 20 --warmup 5 --no-memory --profile 3"
        ;;
    bench_wmt_base)
        section bench_wmt_base 100 130 "$bench --config configs/wmt14-en-de-base.yaml --synthetic wmt --max-tokens 32768 --steps 30 --warmup 5 --no-memory --profile 3"
        ;;
    bench_base_cudnn)
        needs_data bench_base_cudnn && section bench_base_cudnn 40 90 "$bench --config configs/de-en-gpu.yaml --max-tokens 8192 --steps 20 --warmup 5 --no-memory --no-train-loop --cudnn-attention"
        ;;
    tests)
        needs_data tests && section tests 25 60 "python3 -m pytest -q -p no:cacheprovider tests/test_distributed.py -k cuda -rA"
        ;;
    decode)
        needs_data decode && section decode 60 120 "cublas12_shim; python3 scripts/bench_engines.py --device cuda --rounds 2 --batch-size 64 \
            --checkpoint $train_dir/checkpoints/checkpoint_best.pt \
            --src data/multi30k/test_2016_flickr.de.gz --ref data/multi30k/test_2016_flickr.en.gz"
        ;;
    eager_big)
        section eager_big 40 100 "$bench --config configs/wmt14-en-de-big.yaml --synthetic wmt --max-tokens 32768 --steps 20 --warmup 5 --no-memory --compile off --profile 3"
        ;;
    bench_loss)
        section bench_loss 20 60 "python3 scripts/bench_loss.py --device cuda --rows 28000 --d-model 1024 --vocab 32000"
        ;;
    big_no_flash)
        section big_no_flash 60 150 "$bench --config configs/wmt14-en-de-big.yaml --synthetic wmt --max-tokens 32768 --steps 20 --warmup 5 --no-memory --profile 3 --no-flash-attention"
        ;;
    big_bf16_weights)
        section big_bf16_weights 60 150 "$bench --config configs/wmt14-en-de-big.yaml --synthetic wmt --max-tokens 32768 --steps 20 --warmup 5 --no-memory --profile 3 --bf16-weights"
        ;;
    eager_base)
        section eager_base 40 80 "$bench --config configs/wmt14-en-de-base.yaml --synthetic wmt --max-tokens 32768 --steps 30 --warmup 5 --no-memory --compile off --profile 3"
        ;;
    bench_small)
        needs_data bench_small && section bench_small 30 60 "$bench --config configs/de-en.yaml --steps 60 --warmup 20 --no-memory"
        ;;
    esac
done
[ "$plan" = 1 ] && exit 0
[ -n "$prepare_pid" ] && [ "$prepare_pid" != done ] && await_prepare
cp "$work/sections.tsv" "$out/sections.tsv"
archive
python3 scripts/gpu_summary.py "$work" | tee "$out/summary.md"
echo "whole run: $((SECONDS - started)) s of the ${budget}s budget; logs in $out/logs.tar.gz"
