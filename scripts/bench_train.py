"""Training throughput: tfm vs HuggingFace MarianMTModel, same shape, identical batches, alternated.

    pip install -e '.[bench]'
    tfm prepare --config configs/de-en.yaml
    python scripts/bench_train.py --config configs/de-en.yaml [--steps 200 --warmup 20]
    python scripts/bench_train.py --device cuda            # on a GPU: bf16 autocast for both

Both models get the same token-bucketed Multi30k batches (tfm's batcher, --max-tokens), the same
label smoothing (HF through torch's fused cross_entropy) and one optimizer step per batch; steps
alternate tfm/HF so both see the same machine state. Prints steady-state target tokens/s and the
ratio. See --hf-optimizer and --system-malloc for what each side runs with.

Also printed:
- model FLOP utilisation (MFU): the model's matmul FLOPs per second (`training_flops`) against the
  device's peak; on CPU the peak is measured in the same run, as the best of a few large square
  matmuls in the training precision on the same threads (`matmul_peak`), on H100/H200 the data
  sheet's dense peak;
- peak memory of each toolkit training alone: on CPU the peak resident set size of a child
  process that trains only that model on the same batches (`--only`), on CUDA the peak allocated
  GPU memory. Targets on an AVX512_BF16 CPU: tfm ≥ 2.3x HF's tokens/s at HF's best precision.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from bench_common import hf_model, machine_line, tfm_model

from transformer_cli.data.batches import ParallelData
from transformer_cli.experiment.config import load_config
from transformer_cli.experiment.rundir import RunDirectory
from transformer_cli.model.kernels import compile_for_training, leave_out_cudnn_attention
from transformer_cli.model.special_tokens import PAD_ID
from transformer_cli.runtime.allocator import loaded_allocator, use_allocator
from transformer_cli.runtime.cpu import keep_freed_memory, limit_training_kernel_cache
from transformer_cli.runtime.entry import ScriptParser, run_script
from transformer_cli.runtime.precision import autocast_dtype, choose_precision
from transformer_cli.training.loss import batch_loss
from transformer_cli.training.master_weights import MasterWeights
from transformer_cli.training.schedule import learning_rate


def build_parser() -> argparse.ArgumentParser:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/de-en.yaml")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per toolkit")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per toolkit first")
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="padded tokens per batch (the configs' train.max_tokens is what `tfm train` uses)")
    parser.add_argument("--steady-state", action="store_true",
                        help="first run every timed batch once, untimed, for both toolkits: on CPU oneDNN "
                             "builds a matmul kernel for each new matrix shape, which a training run pays in "
                             "its first epoch only (Multi30k: ~160 of a 30-minute run's ~2,000 steps)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf-optimizer", choices=["adamw", "fused"], default="adamw",
                        help="adamw: torch.optim.AdamW with its defaults, what HF's Trainer uses (default); "
                             "fused: the same fused Adam as tfm")
    parser.add_argument("--system-malloc", action="store_true",
                        help="glibc's malloc with its default settings; without it the process runs on the "
                             "allocator `tfm train` uses (mimalloc where installed, else glibc with "
                             "keep_freed_memory). It is process-wide: HF trains on it too")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense peak for MFU (default: 989 bf16 / 495 tf32-fp32 on H100/H200; "
                             "none on other devices)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="for both toolkits; auto: as `tfm train` (bf16 autocast on CUDA and AMX CPUs)")
    parser.add_argument("--synthetic", choices=["wmt"], default=None,
                        help="random token ids with WMT14 en-de's sentence lengths instead of the prepared run's "
                             "data (no corpus or run directory needed; vocabulary: the config's vocab.size)")
    parser.add_argument("--only", choices=["tfm", "hf"], default=None,
                        help="train only this toolkit's model and print its peak memory (the peak-RSS child runs)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory child runs (each trains every batch again in a new process)")
    parser.add_argument("--cudnn-attention", action="store_true",
                        help="on CUDA, let SDPA pick cuDNN's attention (torch's default on Hopper); without it "
                             "both toolkits run as `tfm` does, cuDNN left out (kernels.leave_out_cudnn_attention)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="on CUDA, leave flash attention out of SDPA's choice too (process-wide: HF gets the "
                             "same): decoder self-attention (is_causal) then runs the memory-efficient kernel, as "
                             "the padded attentions do. On an H200 flash's backward took ~1 ms a call at WMT "
                             "lengths, the memory-efficient one ~0.45 ms, yet the big shape's whole step ran "
                             "as fast either way (tfm keeps flash)")
    parser.add_argument("--no-train-loop", action="store_true",
                        help="skip timing `tfm train`'s own loop (on a prepared run it is timed by default)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timing, profile STEPS steady-state steps of each toolkit and print where "
                             "the device's time goes (kernels grouped: matmuls, attention, loss, optimizer, the "
                             "rest) and how busy the device was over the wall clock")
    parser.add_argument("--compile", choices=["config", "on", "off"], default="config",
                        help="tfm's encoder and decoder layers through torch.compile (kernels.compile_for_training; "
                             "HF stays eager): as the config's train.compile (default), or on / off; the "
                             "steady-state pass compiles every batch shape before timing")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="tfm's parameters held in bf16, Adam on fp32 master copies (transformer_cli."
                             "master_weights), no autocast: against `tfm train`'s bf16 autocast over fp32 "
                             "weights (HF stays on --precision)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if not args.system_malloc:
        use_allocator("auto", [__file__, *sys.argv[1:]])  # as `tfm train`: may start this script again
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        leave_out_cudnn_attention(not args.cudnn_attention)  # process-wide: HF gets the same kernels
        torch.backends.cuda.enable_flash_sdp(not args.no_flash_attention)
    limit_training_kernel_cache()  # as `tfm train`, before torch's first kernel (process-wide: HF gets it too)
    amp_dtype = autocast_dtype(choose_precision(args.precision, device))
    if not args.system_malloc and device.type == "cpu":
        keep_freed_memory()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = load_config(args.config)
    compiled = args.compile == "on" or (args.compile == "config" and config.train.compile)
    time_train_loop = not (args.synthetic or compiled or args.no_train_loop)  # a prepared run, eager
    needed = args.warmup + args.steps
    if args.synthetic:
        vocab = config.vocab.size
        host_batches = synthetic_wmt_batches(vocab, args.max_tokens, needed)
    else:
        vocab = RunDirectory(config.run_path).load_manifest().vocab_size["tgt"]
        data = ParallelData(config.run, "train")
        order = []
        epoch = 0
        while len(order) < needed:
            order += data.batches(args.max_tokens, seed=epoch)
            epoch += 1
        host_batches = [data.collate(b) for b in order[:needed]]
    batches = [b.to(device) for b in host_batches]
    smoothing = config.train.label_smoothing

    tfm = tfm_model(config, vocab).to(device).train() if args.only != "hf" else None
    masters = MasterWeights(tfm) if tfm is not None and args.bf16_weights else None  # casts tfm to bf16
    if tfm is not None and compiled:
        compile_for_training(tfm)  # its layers, in place
    hf = hf_model(config, vocab).to(device).train() if args.only != "tfm" else None
    print(machine_line(device))
    print(f"shape: d_model {config.model.d_model}, heads {config.model.n_heads}, layers "
          f"{config.model.enc_layers}+{config.model.dec_layers}, ffn {config.model.d_ff}, vocab {vocab}; "
          f"params tfm {tfm.num_parameters() if tfm else 0:,} / HF {sum(p.numel() for p in hf.parameters()) if hf else 0:,}; "
          f"batches of <= {args.max_tokens} tokens; {device}, {'bf16 autocast' if amp_dtype else 'fp32'}"
          f"{'; tfm: bf16 weights, fp32 master copies, no autocast' if args.bf16_weights else ''}"
          f"{'; tfm layers through torch.compile' if compiled else ''}"
          f"{'' if device.type != 'cuda' else '; SDPA with cuDNN' if args.cudnn_attention else '; SDPA without cuDNN'}"
          f"{'; SDPA without flash attention' if device.type == 'cuda' and args.no_flash_attention else ''}")

    # tfm: what `tfm train` uses. HF: what its Trainer uses unless --hf-optimizer fused.
    adam = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    opt_tfm = None if tfm is None else masters.optimizer(**adam) if masters else torch.optim.Adam(tfm.parameters(), **adam)
    if hf is None:
        opt_hf = None
    elif args.hf_optimizer == "fused":
        opt_hf = torch.optim.Adam(hf.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    else:
        opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
    malloc = "glibc defaults" if args.system_malloc else loaded_allocator()
    print(f"optimizers: tfm fused Adam, HF {args.hf_optimizer}; allocator (both): "
          f"{'glibc + keep_freed_memory' if malloc == 'system' else malloc}")

    def tfm_step(batch, step):
        for g in opt_tfm.param_groups:
            g["lr"] = learning_rate(step, config.train, config.model.d_model)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None and masters is None):
            loss, _ = batch_loss(tfm, batch, smoothing)
        (loss / batch.n_tgt_tokens).backward()
        if masters:
            masters.step(opt_tfm)  # the update on the fp32 copies, cast back into tfm
            return
        opt_tfm.step()
        opt_tfm.zero_grad(set_to_none=True)

    def hf_step(batch, step):
        for g in opt_hf.param_groups:
            g["lr"] = learning_rate(step, config.train, config.model.d_model)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = hf(input_ids=batch.src, attention_mask=(batch.src != PAD_ID).long(),
                     decoder_input_ids=batch.tgt_in, decoder_attention_mask=(batch.tgt_in != PAD_ID).long())
        loss = F.cross_entropy(out.logits.float().view(-1, vocab), batch.tgt_out.view(-1), ignore_index=PAD_ID,
                               label_smoothing=smoothing, reduction="sum")
        (loss / batch.n_tgt_tokens).backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    def sync():  # GPU work is asynchronous: time it to completion
        if device.type == "cuda":
            torch.cuda.synchronize()

    if args.only:  # a child: one toolkit alone, for its peak memory
        step_fn = tfm_step if args.only == "tfm" else hf_step
        for i, batch in enumerate(batches):
            step_fn(batch, i + 1)
        sync()
        rss = peak_rss_gib()
        gpu = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"peak {args.only}: RSS {rss:.2f} GiB{gpu}")
        return
    # On a GPU, a batch shape's first step pays for allocator growth and kernel choice that a long
    # run pays once per shape: timing first-seen shapes put tfm at a third of what `tfm train` logs
    # over thousands of steps. So on CUDA every timed batch runs once first, and steps are timed
    # with CUDA events.
    if args.steady_state or compiled or device.type == "cuda":
        first = first_pass_rates({"tfm": tfm_step, "hf": hf_step}, batches[args.warmup:], sync)
        print(f"first pass over the timed batches (shapes new to both, wall clock): tfm {first['tfm']:.0f}, "
              f"HF {first['hf']:.0f} target tokens/s")
        print("steady state: every timed batch ran once before (kernels built for its shapes)")
    seconds = {"tfm": 0.0, "hf": 0.0}
    tokens = 0
    flops = 0.0
    events: dict[str, list] = {"tfm": [], "hf": []}
    for i, batch in enumerate(batches):
        timed = i >= args.warmup
        for name, fn in (("tfm", tfm_step), ("hf", hf_step)) if i % 2 == 0 else (("hf", hf_step), ("tfm", tfm_step)):
            if device.type == "cuda":  # the step's time on the GPU's own clock
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                sync()
                start_event.record()
                fn(batch, i + 1)
                end_event.record()
                if timed:
                    events[name].append((start_event, end_event))
                continue
            sync()
            start = time.perf_counter()
            fn(batch, i + 1)
            sync()
            if timed:
                seconds[name] += time.perf_counter() - start
        if timed:
            tokens += batch.n_tgt_tokens
            flops += training_flops(config, batch, vocab)
        if (i + 1) % 20 == 0:
            print(f"  step {i + 1}/{needed}", flush=True)

    sync()
    for name, pairs in events.items():
        if pairs:
            seconds[name] = sum(start.elapsed_time(end) for start, end in pairs) / 1000
    back_to_back = back_to_back_rates({"tfm": tfm_step, "hf": hf_step}, batches[args.warmup:], sync)
    if time_train_loop:
        loop_rates = {ahead: trainer_loop_rate(config, device, args.steps, ahead) for ahead in (True, False)}
    tfm_rate, hf_rate = tokens / seconds["tfm"], tokens / seconds["hf"]
    print(f"timed {args.steps} steps each ({tokens:,} target tokens) after {args.warmup} warm-up steps")
    print(f"tfm           {tfm_rate:8.0f} target tokens/s")
    print(f"HF MarianMT   {hf_rate:8.0f} target tokens/s")
    print(f"ratio tfm/HF  {tfm_rate / hf_rate:8.2f}x")
    print(f"tfm back to back, as `tfm train` steps (wall clock, no wait between steps): {back_to_back['tfm']:.0f} "
          f"target tokens/s ({back_to_back['tfm'] / tfm_rate:.2f}x the timed steps)")
    print(f"HF back to back: {back_to_back['hf']:.0f} target tokens/s; ratio back to back tfm/HF "
          f"{back_to_back['tfm'] / back_to_back['hf']:.2f}x")
    if time_train_loop:
        for ahead, rate in loop_rates.items():
            print(f"tfm train's own loop ({'batches collated ahead on a thread' if ahead else 'batches collated in the loop'}"
                  f", clip, skip check, step ledger; no logging or validation), back to back: {rate:.0f} target "
                  f"tokens/s ({rate / back_to_back['tfm']:.2f}x the bench's steps back to back)")
    peak, source = args.peak_tflops, "given"
    bf16_matmuls = amp_dtype is not None or args.bf16_weights  # tfm's matmuls: bf16, or fp32 (tf32 on a GPU)
    if peak is None and device.type == "cuda" and any(n in torch.cuda.get_device_name(device) for n in ("H100", "H200")):
        peak, source = (989.0 if bf16_matmuls else 494.5), "data sheet, dense SXM"  # bf16 / tf32 tensor cores
    if peak is None and device.type == "cpu":
        peak = matmul_peak(torch.bfloat16 if bf16_matmuls else torch.float32)
        source = f"measured: {'bf16' if bf16_matmuls else 'fp32'} matmul"
    if peak:
        matmul = matmul_parameters(config, vocab)
        for name in ("tfm", "hf"):
            achieved = flops / seconds[name] / 1e12
            print(f"MFU {name:<4} {achieved:7.3f} TFLOP/s of {peak:.3f} ({source}) = {100 * achieved / peak:5.1f}% "
                  "(model FLOPs: 3 x forward matmuls, see training_flops)")
        for name, rate in (("tfm", tfm_rate), ("hf", hf_rate)):
            print(f"MFU {name:<4} 6·N·tokens/s = {100 * 6 * matmul * rate / (peak * 1e12):5.1f}% (N = {matmul:,} matmul "
                  "parameters: attention and FFN projections, the output projection once; no embeddings)")
        print(f"MFU tfm back to back 6·N·tokens/s = {100 * 6 * matmul * back_to_back['tfm'] / (peak * 1e12):5.1f}% "
              "(the steps as a training run takes them: no wait between steps)")
    print(f"attention kernels in one tfm step: {attention_kernels(tfm_step, batches[-1])}")
    if args.profile:
        for name, fn in (("tfm", tfm_step), ("hf", hf_step)):
            print(device_time_profile(name, fn, batches[args.warmup:][:args.profile], sync, device))
    for name in () if args.no_memory else ("tfm", "hf"):  # each alone in a child process, on the same batches
        child = [sys.executable, __file__, *sys.argv[1:], "--only", name]
        out = subprocess.run(child, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("peak ")]
        print(lines[-1] if lines else f"peak {name}: the child failed: {out.stderr.strip()[-300:]}")


def first_pass_rates(steps: dict, batches: list, sync) -> dict[str, float]:
    """Each toolkit's target tokens/s over batches whose shapes it has not seen, on the wall clock
    (steps alternating): what a run pays for new shapes (kernel choice, cuDNN graphs, compilation),
    most of a short run's first epoch."""
    seconds = dict.fromkeys(steps, 0.0)
    for i, batch in enumerate(batches):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step(batch, i + 1)
            sync()
            seconds[name] += time.perf_counter() - start
    tokens = sum(b.n_tgt_tokens for b in batches)
    return {name: tokens / spent for name, spent in seconds.items()}


def back_to_back_rates(steps: dict, batches: list, sync) -> dict[str, float]:
    """Each toolkit's target tokens/s with its steps one after the other, nothing waited for between
    them, as a training run takes them (`tfm train`'s log divides log_every steps' tokens by their
    wall time)."""
    rates = {}
    tokens = sum(b.n_tgt_tokens for b in batches)
    for name, step in steps.items():
        sync()
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            step(batch, i + 1)
        sync()
        rates[name] = tokens / (time.perf_counter() - start)
    return rates


def trainer_loop_rate(config, device: torch.device, steps: int, ahead: bool) -> float:
    """Target tokens/s of `tfm train`'s own Trainer (training/train.py) over `steps` updates back to back, after
    as many untimed ones (shapes seen): what its log reports, minus logging and validation; `ahead`:
    train.prefetch (a thread collates the next update, into pinned memory on CUDA). It trains in a
    temporary run directory that links the prepared data (a trained run_dir is not touched)."""
    import tempfile
    from pathlib import Path

    from transformer_cli.training.distributed import World
    from transformer_cli.training.train import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        for entry in config.run_path.iterdir():
            if entry.name not in ("checkpoints", "metrics.jsonl", "eval", "config.yaml", "tensorboard"):
                Path(tmp, entry.name).symlink_to(entry.resolve())
        train_cfg = config.train.model_copy(update={"prefetch": ahead})
        trainer = Trainer(config.model_copy(update={"run_dir": tmp, "train": train_cfg}), World(), device,
                          resume=False, progress_bar=False, on_step=None)
        trainer.model.train()
        trainer.started = time.perf_counter()  # what Trainer.run sets before its loop
        try:
            for timed in (False, True):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start, tokens = time.perf_counter(), 0
                for _ in range(steps):
                    update = trainer.updates.next()
                    trainer.set_learning_rate()
                    step = trainer.loss_step(update)
                    trainer.update(step)
                    tokens += step.tokens
                trainer.ledger.read(new_window=True)  # the one wait for the device, as at a log point
                if timed:
                    return tokens / (time.perf_counter() - start)
        finally:
            trainer.updates.close()
    raise AssertionError("unreachable")


# WMT14 en-de after a 32k joint BPE: sentence lengths in subword tokens average about 27, with a
# long tail to the 250 that training keeps. A log-normal with these parameters has mean 27.0, a
# median of 22.6 and 1.6% of sentences over 100 tokens; German targets run ~5% longer, ±15%.
WMT_LOG_MEAN, WMT_LOG_SIGMA, WMT_MAX = 3.118, 0.6, 250


def synthetic_wmt_batches(vocab: int, max_tokens: int, count: int, seed: int = 0) -> list:
    """`count` batches of random ids (specials excluded) whose source and target lengths follow
    WMT14 en-de's distribution, bucketed by length as `tfm train` buckets (token_batches)."""
    import numpy as np

    from transformer_cli.data.batches import collate, token_batches

    rng = np.random.default_rng(seed)
    pairs = max(20 * count * max_tokens // 27, 10_000)
    src_lens = np.clip(rng.lognormal(WMT_LOG_MEAN, WMT_LOG_SIGMA, pairs).round(), 1, WMT_MAX - 1).astype(np.int64)
    tgt_lens = np.clip((src_lens * rng.lognormal(0.05, 0.15, pairs)).round(), 1, WMT_MAX - 1).astype(np.int64)
    order = token_batches(src_lens, tgt_lens, max_tokens, seed)[:count]
    ids = lambda n: rng.integers(4, vocab, n)  # noqa: E731 (0–3: pad, unk, bos, eos)
    return [collate([ids(src_lens[i]) for i in batch], [ids(tgt_lens[i]) for i in batch]) for batch in order]


def attention_kernels(step, batch) -> str:
    """Which of torch's attention kernels one training step ran (forward and backward), counted:
    on CUDA flash attention takes `is_causal` without a mask, the memory-efficient (or cuDNN)
    kernel a key-padding mask; the math fallback means a materialised mask or an unsupported case."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch, 1)
    counts = Counter(e.name.removeprefix("aten::") for e in prof.events()
                     if "scaled_dot_product" in e.name and e.name != "aten::scaled_dot_product_attention")
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none (no torch SDPA call)"


# Kernel names → what they compute, for the profile's groups (first match wins; CUDA kernel names
# from cuBLAS/CUTLASS, torch's flash/memory-efficient attention and fused optimizers; on CPU aten ops).
KERNEL_GROUPS = (
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "sm80_xmma", "nvjet", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::linear", "aten::matmul")),
    ("loss (softmax, log-probs)", ("softmax", "log_softmax", "logsumexp", "scatter", "gather")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("dropout", ("fused_dropout", "bernoulli", "dropout", "masked_scale")),
    ("layer norm", ("layer_norm", "layernorm")),
)


def device_time_profile(name: str, step, batches: list, sync, device: torch.device, top: int = 12) -> str:
    """Where one toolkit's steps spend the device's time (`batches` already seen: steady state):
    kernel time by group (KERNEL_GROUPS), the `top` kernels, and the device's busy share of the
    wall clock (low: the host cannot launch work fast enough). On CPU: aten ops' self time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for i, batch in enumerate(batches):
            step(batch, i + 1)
        sync()
    wall_us = (time.perf_counter() - start) * 1e6

    def self_time(e) -> float:  # microseconds
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    # Kernels only: a range the profiler annotates on the GPU's timeline ("Optimizer.step#AdamW.step")
    # spans kernels already counted.
    events = [e for e in prof.key_averages()
              if (e.device_type == DeviceType.CUDA and "#" not in e.key if cuda else e.key.startswith("aten::"))
              and self_time(e) > 0]
    total = sum(self_time(e) for e in events) or 1.0
    groups: dict[str, float] = {}
    for e in events:
        lowered = e.key.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(k in lowered for k in keys)), "elementwise and other")
        groups[group] = groups.get(group, 0.0) + self_time(e)
    steps = max(len(batches), 1)
    lines = [f"profile {name}: {len(batches)} steps, {'device' if cuda else 'CPU op'} time {total / steps / 1e3:.2f} ms "
             f"per step over {wall_us / steps / 1e3:.2f} ms of wall clock per step (profiler on): busy "
             f"{100 * total / wall_us:.0f}%"]
    lines += [f"profile {name}   {g:<26} {100 * t / total:5.1f}%  {t / steps / 1e3:8.2f} ms/step"
              for g, t in sorted(groups.items(), key=lambda item: -item[1])]
    for e in sorted(events, key=self_time, reverse=True)[:top]:
        lines.append(f"profile {name}     {100 * self_time(e) / total:5.1f}%  x{e.count // steps:<4} {e.key[:110]}")
    return "\n".join(lines)


def peak_rss_gib() -> float:
    """This process's peak resident set size: VmHWM, which starts anew at exec (getrusage's
    ru_maxrss would include the parent's size when the child was forked)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5, budget: float = 0.5) -> float:
    """This CPU's matmul throughput in TFLOP/s: the best of `repeats` (size × size) @ (size × size)
    products in `dtype` on the current threads, after one untimed (oneDNN builds its kernel). The size
    halves while one product would take over `budget` seconds: bf16 emulated on a CPU without bf16
    instructions takes about a minute for one 2048 × 2048 product, and is as slow at any size."""
    probe = torch.randn(256, 256).to(dtype)
    torch.mm(probe, probe)
    start = time.perf_counter()
    torch.mm(probe, probe)
    seconds = time.perf_counter() - start
    while size > 256 and seconds * (size / 256) ** 3 > budget:
        size //= 2
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def matmul_parameters(config, vocab: int) -> int:
    """The weights a token meets in matrix products: per encoder layer 4d² + 2df, per decoder
    layer 8d² + 2df (self- and cross-attention), and the output projection d·V once (tied to the
    embeddings or not: a lookup costs no FLOPs)."""
    m = config.model
    d, f = m.d_model, m.d_ff
    return m.enc_layers * (4 * d * d + 2 * d * f) + m.dec_layers * (8 * d * d + 2 * d * f) + d * vocab


def training_flops(config, batch, vocab: int) -> float:
    """Model FLOPs of one training step on `batch`: 3 x the forward pass's matmul FLOPs (backward = 2x).

    Per layer, with d = d_model, f = d_ff, B sentences, S/T padded source/target lengths:
    encoder 2·(4d² + 2df)·BS + 2·2·B·S²·d (scores and weighted values); decoder self-attention
    2·4d²·BT + 2·2·B·T²·d, cross-attention 2·2d²·BT + 2·2d²·BS + 2·2·B·T·S·d, FFN 2·2df·BT;
    output projection 2·d·V per real target token. Embeddings, norms and softmax are not counted.
    """
    m = config.model
    d, f = m.d_model, m.d_ff
    b, s_len = batch.src.shape
    t_len = batch.tgt_in.shape[1]
    bs, bt = b * s_len, b * t_len
    encoder = m.enc_layers * (2 * (4 * d * d + 2 * d * f) * bs + 4 * b * s_len * s_len * d)
    decoder = m.dec_layers * (2 * 4 * d * d * bt + 4 * b * t_len * t_len * d + 2 * 2 * d * d * (bt + bs)
                              + 4 * b * t_len * s_len * d + 2 * 2 * d * f * bt)
    output = 2 * d * vocab * batch.n_tgt_tokens
    return 3.0 * (encoder + decoder + output)


if __name__ == "__main__":
    run_script(main)
