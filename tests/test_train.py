import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.warm_processes import preexec
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.checkpoint import load_checkpoint
from transformer_cli.experiment.config import TrainConfig, config_from_dict, load_config
from transformer_cli.runtime.errors import TfmError
from transformer_cli.runtime.precision import autocast_dtype, choose_precision, cpu_has_fast_bf16, measure_bf16_speedup
from transformer_cli.training.loss import compiled_chunk_loss, fused_chunk_loss, output_layer_loss, smoothed_chunk_loss
from transformer_cli.training.schedule import budget_used, learning_rate, warmup_steps
from transformer_cli.training.train import train

from .conftest import (
    ROOT,
    assert_same_final_weights,
    multi30k_config,
    tfm_in_process,
    tiny_run,
    wait_until_training,
)


def test_noam_schedule_values():
    cfg = TrainConfig(lr_schedule="noam", warmup=4000, lr_factor=1.0)
    d = 512
    assert learning_rate(1, cfg, d) == pytest.approx(d**-0.5 * 4000**-1.5)
    peak = learning_rate(4000, cfg, d)
    assert peak == pytest.approx(d**-0.5 * 4000**-0.5)
    assert learning_rate(16000, cfg, d) == pytest.approx(peak / 2)
    assert learning_rate(2000, cfg, d) == pytest.approx(peak / 2)


def test_inverse_sqrt_and_constant_schedules():
    cfg = TrainConfig(lr_schedule="inverse_sqrt", warmup=100, lr=1e-3)
    assert learning_rate(1, cfg, 256) == pytest.approx(1e-5)
    assert learning_rate(100, cfg, 256) == pytest.approx(1e-3)
    assert learning_rate(400, cfg, 256) == pytest.approx(5e-4)
    const = TrainConfig(lr_schedule="constant", warmup=0, lr=3e-4)
    assert learning_rate(1, const, 256) == learning_rate(10_000, const, 256) == 3e-4


def test_budget_schedule_warms_up_then_reaches_lr_min_when_the_budget_ends():
    cfg = TrainConfig(lr_schedule="budget", warmup=100, lr=1e-3, lr_min=1e-5, max_steps=1000)
    assert budget_used(500, 0.0, cfg) == 0.5
    lrs = [learning_rate(step, cfg, 256, budget_used(step - 1, 0.0, cfg)) for step in range(1, 1001)]
    assert lrs[0] < lrs[49] < lrs[99]  # warm-up
    assert lrs[99] == pytest.approx(1e-3 * (1e-5 / 1e-3 + (1 - 1e-5 / 1e-3) * 0.5 * (1 + math.cos(math.pi * 0.099))))
    assert all(a >= b for a, b in zip(lrs[100:], lrs[101:]))  # then only down
    assert lrs[-1] == pytest.approx(1e-5, rel=1e-3)
    assert learning_rate(1000, cfg, 256, 1.0) == pytest.approx(1e-5)
    timed = TrainConfig(lr_schedule="budget", warmup=0, lr=1e-3, max_time="30m", max_steps=100_000)
    assert budget_used(10, 900.0, timed) == 0.5  # the wall-clock budget is further along than the steps
    assert learning_rate(10, timed, 256, budget_used(10, 900.0, timed)) == pytest.approx(5e-4)
    assert learning_rate(10, timed, 256, budget_used(10, 1800.0, timed)) == pytest.approx(0.0)


def test_warmup_ratio_ends_the_warmup_at_a_fraction_of_the_budget():
    # max_steps: exact. 400 warm-up steps would be 40% of a 1,000-step run; the ratio caps it at 100.
    cfg = TrainConfig(lr_schedule="inverse_sqrt", warmup=400, warmup_ratio=0.1, lr=1e-3, max_steps=1000)
    lr = lambda step: learning_rate(step, cfg, 256, budget_used(step, 0.0, cfg))  # noqa: E731
    assert warmup_steps(50, cfg, budget_used(50, 0.0, cfg)) == pytest.approx(100)
    assert lr(50) == pytest.approx(5e-4)
    assert lr(100) == pytest.approx(1e-3)  # the peak, at 10% of the run
    assert lr(400) == pytest.approx(5e-4)  # then 1/sqrt decay from there
    # A long run keeps its `warmup`: 10% of 100,000 steps is more than 400.
    long = cfg.model_copy(update={"max_steps": 100_000})
    assert warmup_steps(200, long, budget_used(200, 0.0, long)) == 400
    assert learning_rate(400, long, 256, budget_used(400, 0.0, long)) == pytest.approx(1e-3)
    # max_time: the budget's length in steps is projected from the pace so far. 30 steps in 60 s of a
    # 10-minute budget -> 300 steps in all -> the warm-up is 30 steps: the peak is reached now.
    timed = TrainConfig(lr_schedule="budget", warmup=400, warmup_ratio=0.1, lr=1e-3, max_time="10m")
    assert warmup_steps(30, timed, budget_used(30, 60.0, timed)) == pytest.approx(30)
    assert learning_rate(15, timed, 256, budget_used(15, 30.0, timed)) == pytest.approx(
        1e-3 * 0.5 * 0.5 * (1 + math.cos(math.pi * 0.05)))
    # Without warmup_ratio, nothing changes (the configs' 400 steps stay 400 steps).
    plain = timed.model_copy(update={"warmup_ratio": None})
    assert warmup_steps(30, plain, budget_used(30, 60.0, plain)) == 400


@pytest.mark.slow
def test_budget_schedule_in_a_real_run_ends_at_lr_min(tiny_prepared, tmp_path):
    from transformer_cli.experiment.config import load_config

    from .conftest import tiny_run

    config = load_config(tiny_run(tiny_prepared, tmp_path, lr_schedule="budget", lr=0.003, lr_min=1e-4,
                                  warmup=5, max_steps=40, log_every=1, eval_every=40))
    train(config, progress_bar=False)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    lrs = [row["lr"] for row in rows if row["kind"] == "train"]
    assert len(lrs) == 40 and max(lrs) == lrs[4] and lrs[-1] == pytest.approx(1e-4, rel=0.05)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def identity_projection(size: int, dtype=torch.float32) -> torch.nn.Linear:
    """A vocabulary projection that passes its input through: the states are the logits."""
    layer = torch.nn.Linear(size, size, bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(size, dtype=dtype))
    return layer


def test_label_smoothed_loss_by_hand():
    probs = torch.tensor([[0.5, 0.25, 0.25]])
    target = torch.tensor([0])
    eps = 0.1
    loss, nll = output_layer_loss(probs.log(), identity_projection(3), target, eps)
    ln2 = math.log(2)
    expected = (1 - eps) * ln2 + eps * (ln2 + 2 * ln2 + 2 * ln2) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert nll.item() == pytest.approx(ln2, rel=1e-6)


def test_model_learns_the_reverse_task(reverse_model):
    config, summary = reverse_model
    assert summary.best_score >= 90, f"valid BLEU {summary.best_score}"
    records = [json.loads(line) for line in (config.run_path / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert train_losses[-1] < 0.2 * train_losses[0]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_resume_gives_identical_weights(tiny_prepared, tmp_path, precision):
    """20 steps straight = 10, stop, resume, 10 more: the same weights to the bit, past an epoch's end,
    with dropout on (its random state travels in the checkpoint). The 23k-parameter
    model: forced bf16 on a CPU without bf16 instructions (AVX2-only) runs ~100x slower matmuls."""
    def config_of(name: str) -> Path:
        config = tiny_run(tiny_prepared, tmp_path / name, max_steps=10, eval_every=10, precision=precision)
        raw = json.loads(config.read_text())
        raw["model"]["dropout"] = 0.1
        config.write_text(json.dumps(raw))
        return config

    straight, split = config_of("straight"), config_of("split")
    train(load_config(straight, ["train.max_steps=20"]), progress_bar=False)
    train(load_config(split), progress_bar=False)
    with pytest.raises(TfmError, match="already holds a training run"):
        train(load_config(split, ["train.max_steps=20"]), progress_bar=False)
    train(load_config(split, ["train.max_steps=20"]), resume=True, progress_bar=False)
    assert_same_final_weights(tmp_path / "straight/run/checkpoints/checkpoint_last.pt",
                              tmp_path / "split/run/checkpoints/checkpoint_last.pt", 20)


@pytest.mark.slow
def test_same_seed_same_loss_curve(multi30k_2k, tmp_path):
    curves = []
    for name in ("a", "b"):
        raw = multi30k_config(multi30k_2k, tmp_path / name, train={"max_steps": 20, "eval_every": 20,
                                                                   "log_every": 5, "eval_bleu_sentences": 5})
        config = config_from_dict(raw)
        prepare(config, progress=False)
        train(config, progress_bar=False)
        lines = (config.run_path / "metrics.jsonl").read_text().splitlines()
        curves.append([json.loads(x)["loss"] for x in lines])
    assert curves[0] == curves[1]


@pytest.mark.slow
def test_end_to_end_cli_tiny_config_valid_loss_falls(multi30k_2k, tmp_path):
    """configs/tiny.yaml through the command line's prepare and train (in this process: the README's
    main job runs them as real processes in test_quickstart.py)."""
    sets = [f"--set=run_dir={tmp_path / 'run'}", f"--set=data.train={multi30k_2k / 'train'}",
            f"--set=data.valid={multi30k_2k / 'val'}", f"--set=data.test={multi30k_2k / 'test_2016_flickr'}",
            "--set=train.max_steps=100", "--set=train.eval_every=25", "--set=train.eval_bleu_sentences=20"]
    config = str(ROOT / "configs" / "tiny.yaml")
    prep = tfm_in_process("prepare", "--config", config, *sets)
    assert prep.exit_code == 0, prep.stderr
    assert "unk%" in prep.stdout
    again = tfm_in_process("prepare", "--config", config, *sets)
    assert "reused" in again.stdout
    run = tfm_in_process("train", "--config", config, *sets)
    assert run.exit_code == 0, run.stderr
    assert "done (max_steps=100)" in run.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["loss"] for r in records if r["kind"] == "valid"]
    assert len(valid) == 4 and valid[-1] < valid[0] - 0.5  # 6.04 → 5.16 (fp32, bf16, AVX2)
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_best.pt").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
    train_records = [r for r in records if r["kind"] == "train"]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["padding"] < 0.5 for r in train_records)


@pytest.mark.parametrize("chunk_loss", [smoothed_chunk_loss, fused_chunk_loss])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [3, 64])
def test_chunked_output_loss_matches_autograd_through_the_projection(bias, chunk_rows, chunk_loss):
    """The loss computes its gradients chunk by chunk in the forward pass; they must equal what
    autograd gives through nn.Linear and torch's label-smoothed cross-entropy, scaled by the
    gradient that arrives from above. Both ways of computing a chunk (in place; for compiling)."""
    torch.manual_seed(0)
    projection = torch.nn.Linear(5, 11, bias=bias).double()
    hidden = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (10,))
    loss, nll = output_layer_loss(hidden, projection, target, 0.1, chunk_rows=chunk_rows, chunk_loss=chunk_loss)
    (2.5 * loss).backward()
    ours = [p.grad.clone() for p in (hidden, *projection.parameters())]
    hidden.grad = None
    projection.zero_grad()
    ref = torch.nn.functional.cross_entropy(projection(hidden), target, label_smoothing=0.1, reduction="sum")
    (2.5 * ref).backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    ref_nll = torch.nn.functional.cross_entropy(projection(hidden), target, reduction="sum")
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-12)
    for got, want in zip(ours, (hidden.grad, *[p.grad for p in projection.parameters()])):
        assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("chunk_loss", [smoothed_chunk_loss, fused_chunk_loss])
def test_chunked_output_loss_under_bf16_autocast_matches_the_unchunked_projection(chunk_loss):
    """In bf16 autocast the chunked loss multiplies in bf16 as nn.Linear would; its loss and
    gradients stay within bf16 rounding of autograd's whole-batch path."""
    torch.manual_seed(0)
    projection = torch.nn.Linear(16, 300)
    hidden = torch.randn(200, 16, requires_grad=True)
    target = torch.randint(0, 300, (200,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = output_layer_loss(hidden, projection, target, 0.1, chunk_rows=64, chunk_loss=chunk_loss)
        ref = torch.nn.functional.cross_entropy(projection(hidden).float(), target, label_smoothing=0.1,
                                                reduction="sum")
    loss.backward()
    ours = [p.grad.clone() for p in (hidden, *projection.parameters())]
    hidden.grad = None
    projection.zero_grad()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    for got, want in zip(ours, (hidden.grad, *[p.grad for p in projection.parameters()])):
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


def output_loss_and_gradients(hidden: torch.Tensor, projection: torch.nn.Linear, target: torch.Tensor,
                              chunk_loss, autocast: bool) -> list[torch.Tensor]:
    """Loss, NLL and the gradients of the states, weight and bias of `output_layer_loss`."""
    hidden = hidden.detach().requires_grad_()
    projection.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, nll = output_layer_loss(hidden, projection, target, 0.1, chunk_rows=64, chunk_loss=chunk_loss)
    loss.backward()
    return [loss.detach(), nll, hidden.grad, projection.weight.grad,
            None if projection.bias is None else projection.bias.grad]


@pytest.mark.slow
def test_the_compiled_chunk_loss_equals_the_eager_one():
    """`train.compile`'s output loss: `fused_chunk_loss` through torch's own compiler (inductor, on
    CPU), dynamic in the rows (chunks of 64 and a last one of 8), in the two precisions training
    runs in, with and without an output bias. Its loss, NLL and gradients equal the eager in-place
    version's within a relative 1e-5 in fp32 and within bf16 rounding in bf16 autocast; without
    gradients it computes none. (Its formula, eager, equals autograd's to 1e-12 in fp64 above; each
    kind of chunk compiles anew, a few seconds of C++ each. The fp32 one without a bias is the graph
    bench_loss.py's test compiles: inductor's cache builds it once a run.)"""
    torch.manual_seed(0)
    compiled = compiled_chunk_loss()
    target = torch.randint(0, 300, (200,))
    for autocast, bias, tolerance in ((False, False, 1e-5), (True, True, 0.01)):
        projection = torch.nn.Linear(16, 300, bias=bias)
        hidden = torch.randn(200, 16)
        ours = output_loss_and_gradients(hidden, projection, target, compiled, autocast)
        eager = output_loss_and_gradients(hidden, projection, target, smoothed_chunk_loss, autocast)
        assert (ours[4] is None) == (not bias)
        for got, want in zip(ours, eager):
            if want is not None:
                assert (got - want).abs().max() <= tolerance * want.abs().max(), (autocast, got, want)
        if not autocast:
            fp32_case = projection, hidden, ours[0]
    projection, hidden, loss_with_gradients = fp32_case
    with torch.no_grad():  # another compiled graph: the loss of a compiled fp32 run's validation
        loss, _ = output_layer_loss(hidden, projection, target, 0.1, chunk_rows=64, chunk_loss=compiled)
    assert loss.grad_fn is None and loss.item() == pytest.approx(loss_with_gradients.item(), rel=1e-5)


def test_loss_without_gradients_computes_none():
    projection = identity_projection(4)
    hidden = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        loss, _ = output_layer_loss(hidden, projection, torch.tensor([0, 1, 2]), 0.1)
    assert not loss.requires_grad and loss.grad_fn is None


def test_logits_for_target_rows_equal_the_full_projection():
    from transformer_cli.model.transformer import Transformer, TransformerConfig
    from transformer_cli.training.loss import target_rows

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, d_model=16, n_heads=2, enc_layers=1, dec_layers=1, d_ff=32)).eval()
    src = torch.tensor([[5, 6, 3], [7, 3, 0]])
    tgt_in, tgt_out = torch.tensor([[2, 8, 9], [2, 8, 0]]), torch.tensor([[8, 9, 3], [8, 3, 0]])
    rows, targets = target_rows(tgt_out)
    assert rows.tolist() == [0, 1, 2, 3, 4] and targets.tolist() == [8, 9, 3, 8, 3]
    full = model(src, tgt_in).reshape(-1, 30)
    assert torch.allclose(model(src, tgt_in, rows), full[rows], atol=1e-6)


@pytest.fixture
def quiet_machine(monkeypatch):
    """A measurement taken as on an idle machine (the test suite's own workers keep this one busy)."""
    from transformer_cli.runtime import precision

    monkeypatch.setattr(precision, "others_share", lambda start, end, threads: 0.0)
    precision.forget_busy_measurements()


def test_precision_auto_follows_the_device_and_the_measured_cpu_speedup(monkeypatch, tmp_path, quiet_machine):
    monkeypatch.delenv("TFM_PRECISION", raising=False)
    monkeypatch.setenv("TFM_CACHE", str(tmp_path))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype(choose_precision("auto", cuda)) is torch.bfloat16
    assert autocast_dtype(choose_precision("fp32", cuda)) is None
    assert autocast_dtype(choose_precision("bf16", cpu)) is torch.bfloat16
    choice = choose_precision("auto", cpu, (64, 128))
    cache = json.loads((tmp_path / "bf16_speedup.json").read_text()) if not cpu_has_fast_bf16() else {}
    if cpu_has_fast_bf16():
        assert choice.bf16 and "AMX" in choice.reason
        return
    (key, measured), = cache.items()  # measured once, for this CPU, torch, threads and shape
    assert "64x128" in key.split("|")[-2] and measured > 0
    assert choice.bf16 == (measured >= 1.5) and "measured on this CPU" in choice.reason
    for speedup, bf16 in ((0.6, False), (1.4, False), (4.2, True)):  # the decision follows the cached figure
        (tmp_path / "bf16_speedup.json").write_text(json.dumps({key: speedup}))
        assert choose_precision("auto", cpu, (64, 128)).bf16 is bf16
    # The same CPU with its kernels capped (as on a CPU without bf16) is another machine: measured again.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    choose_precision("auto", cpu, (64, 128))
    keys = json.loads((tmp_path / "bf16_speedup.json").read_text())
    assert len(keys) == 2 and key in keys and any("oneDNN avx512_core" in k for k in keys)


def test_the_precision_measurement_leaves_the_global_rng_alone(monkeypatch, tmp_path, quiet_machine):
    """Training seeds, then chooses the precision: a first, uncached measurement that drew from the
    global RNG made a run's initial weights differ from a later run's with the same seed."""
    monkeypatch.setenv("TFM_CACHE", str(tmp_path))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    measure_bf16_speedup(64, 128, tokens=64)
    assert (tmp_path / "bf16_speedup.json").is_file()  # it did measure
    assert torch.equal(torch.get_rng_state(), state)


def test_emulated_bf16_is_screened_on_a_few_rows_and_real_bf16_timed_on_the_full_shape(monkeypatch, tmp_path,
                                                                                      quiet_machine):
    """Where bf16 is emulated (~100x slower) timing the full shape took a minute: a few rows decide
    that; a CPU not clearly slower on them is timed on the model's full shape."""
    from transformer_cli.runtime import precision

    monkeypatch.setenv("TFM_CACHE", str(tmp_path))
    bf16_rows, screen_flops = [], [0.0]

    def matmul_flops(a, b, seconds=0.08):
        if a.dtype != torch.bfloat16:
            return 100.0
        bf16_rows.append(a.size(0))
        return screen_flops[0] if a.size(0) == 2 else 300.0  # the screen's 64 // 32 rows, or the full shape

    monkeypatch.setattr(precision, "_matmul_flops", matmul_flops)
    full = [2, 64, 64, 64]  # the screen, then the full shape in turn with fp32, three times
    for rows_flops, expected, timed in ((1.0, 0.01, [2]), (20.0, 0.2, [2]), (30.0, 3.0, full), (250.0, 3.0, full)):
        (tmp_path / "bf16_speedup.json").unlink(missing_ok=True)
        bf16_rows.clear()
        screen_flops[0] = rows_flops
        assert measure_bf16_speedup(16, 32, tokens=64) == pytest.approx(expected)
        assert bf16_rows == timed


def test_the_bf16_measurement_takes_each_precisions_fastest_round_and_keeps_no_busy_answer(monkeypatch, tmp_path):
    """fp32 and bf16 timed in turn: a moment's load on one round of either leaves the figure true
    (the one-after-another measurement read 1.3x for 5.6x so). A measurement during which other
    work took the CPUs holds for this process only, until a probe measures again; a quiet one is cached."""
    from transformer_cli.runtime import precision

    monkeypatch.setenv("TFM_CACHE", str(tmp_path))
    calls = {"fp32": 0, "bf16": 0}

    def matmul_flops(a, b, seconds=0.08):
        kind = "bf16" if a.dtype == torch.bfloat16 else "fp32"
        calls[kind] += 1
        if kind == "bf16" and a.size(0) == 2:
            return 500.0  # the screen's rows: real bf16
        slowed = calls[kind] == 1 if kind == "bf16" else calls[kind] == 2  # one round each, loaded
        return (400.0 if kind == "bf16" else 100.0) / (4.0 if slowed else 1.0)

    monkeypatch.setattr(precision, "_matmul_flops", matmul_flops)
    share = {"busy": 0.0}
    monkeypatch.setattr(precision, "others_share", lambda start, end, threads: share["busy"])
    precision.forget_busy_measurements()
    assert measure_bf16_speedup(16, 32, tokens=64) == pytest.approx(4.0)
    assert (tmp_path / "bf16_speedup.json").is_file()
    (tmp_path / "bf16_speedup.json").unlink()
    share["busy"], calls["fp32"], calls["bf16"] = 0.8, 0, 0
    assert measure_bf16_speedup(16, 32, tokens=64) == pytest.approx(4.0)
    assert not (tmp_path / "bf16_speedup.json").exists()  # busy: not kept as the machine's
    before = dict(calls)
    assert measure_bf16_speedup(16, 32, tokens=64) == pytest.approx(4.0) and calls == before  # this process's
    precision.forget_busy_measurements()
    share["busy"] = 0.0
    measure_bf16_speedup(16, 32, tokens=64)
    assert calls != before and (tmp_path / "bf16_speedup.json").is_file()  # measured again, quiet: cached


def test_others_share_sees_other_processes_taking_the_cpus():
    """Real processes: one spinning per usable core while this one spins too: its thread waits for a
    CPU (or /proc/stat shows the others' time), and the share says so."""
    import subprocess
    import sys
    import time as clock

    from transformer_cli.runtime.cpu import cpu_reading, others_share, usable_cores

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    try:
        clock.sleep(0.3)
        start, began = cpu_reading(), clock.perf_counter()
        while clock.perf_counter() - began < 1.0:
            pass
        share = others_share(start, cpu_reading(), threads=1)
    finally:
        for burner in burners:
            burner.kill()
    assert share >= 0.2, share


def test_tfm_precision_env_decides_auto_only(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for forced, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16)):
        monkeypatch.setenv("TFM_PRECISION", forced)
        assert autocast_dtype(choose_precision("auto", cpu)) is dtype
        assert autocast_dtype(choose_precision("auto", cuda)) is dtype
    monkeypatch.setenv("TFM_PRECISION", "bf16")
    assert autocast_dtype(choose_precision("fp32", cpu)) is None  # explicit settings win
    monkeypatch.setenv("TFM_PRECISION", "fp16")
    with pytest.raises(TfmError, match="TFM_PRECISION='fp16': expected fp32, bf16 or auto"):
        autocast_dtype(choose_precision("auto", cpu))


@pytest.mark.slow
def test_tfm_precision_env_error_is_one_line_exit_2(multi30k_2k, tmp_path):
    raw = multi30k_config(multi30k_2k, tmp_path / "run")
    config = config_from_dict(raw)
    prepare(config, progress=False)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(json.dumps(raw))
    env = {**os.environ, "TFM_PRECISION": "half"}
    proc = subprocess.run([sys.executable, "-m", "transformer_cli.cli", "train", "--config", str(cfg_path)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "TFM_PRECISION='half'" in proc.stderr and "Traceback" not in proc.stderr


def signal_test_config(data: Path, run_dir: Path) -> Path:
    raw = multi30k_config(data, run_dir, train={"max_steps": 30, "eval_every": 1000, "log_every": 1,
                                                "eval_bleu_sentences": 5, "precision": "fp32"})
    prepare(config_from_dict(raw), progress=False)
    path = run_dir.with_suffix(".yaml")
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def straight_30_steps(multi30k_2k, tmp_path_factory) -> Path:
    """checkpoint_last.pt of an uninterrupted 30-step `tfm train` process (shared by both signals)."""
    run_dir = tmp_path_factory.mktemp("signals") / "straight"
    train(load_config(signal_test_config(multi30k_2k, run_dir)), progress_bar=False)
    return run_dir / "checkpoints/checkpoint_last.pt"


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_a_step_boundary_and_resume_is_exact(multi30k_2k, straight_30_steps, tmp_path, signum, code):
    """A real `tfm train` process is signalled mid-run; resumed, it ends where an uninterrupted run does."""
    tfm = [sys.executable, "-m", "transformer_cli.cli", "train", "--config"]
    stopped = signal_test_config(multi30k_2k, tmp_path / "stopped")
    # With the signal at its default, as in a terminal, even where this suite runs with SIGINT ignored
    # (`pytest &` from a script): tfm keeps an ignored signal ignored.
    proc = subprocess.Popen([*tfm, str(stopped)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec(default_signals=(signum,)))
    wait_until_training(tmp_path / "stopped")
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and "continue with --resume" in stderr
    saved = load_checkpoint(tmp_path / "stopped/checkpoints/checkpoint_last.pt")["progress"]["step"]
    assert 5 <= saved < 30, f"stopped at step {saved}"
    train(load_config(stopped), resume=True, progress_bar=False)  # the save is the process's; resuming it is not
    assert_same_final_weights(straight_30_steps, tmp_path / "stopped/checkpoints/checkpoint_last.pt", 30)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no terminals to hang up on Windows")
@pytest.mark.parametrize("output", ["terminal", "pipe"])
def test_hangup_saves_at_a_step_boundary_and_resume_is_exact(multi30k_2k, straight_30_steps, tmp_path, output):
    """`tfm train` in a terminal that goes away (ssh connection dropped, window closed): the kernel
    hangs the terminal up and sends SIGHUP. From then on every write to the terminal fails (EIO), and
    so does every write into a pipe whose reader went with it (`tfm train 2>&1 | tee log`: EPIPE),
    the progress bar's included. tfm must still save at a step boundary, exit 129, resume exactly."""
    import select

    tfm = [sys.executable, "-m", "transformer_cli.cli", "train", "--config"]
    stopped = signal_test_config(multi30k_2k, tmp_path / "stopped")
    master, terminal = os.openpty()
    reader, writer = os.pipe()

    own_the_terminal = preexec(default_signals=(signal.SIGHUP,), own_terminal=True)  # as a login shell's job
    proc = subprocess.Popen([*tfm, str(stopped)], stdin=terminal, stdout=terminal,
                            stderr=terminal if output == "terminal" else writer, preexec_fn=own_the_terminal)
    os.close(terminal)
    os.close(writer)
    shown = []

    # What the terminal shows (and the pipe, where stderr goes there; otherwise that pipe is at its end
    # at once, and selecting it would spin a core that the training process needs).
    sources = [master, reader] if output == "pipe" else [master]

    def keep_reading() -> None:  # as a terminal does
        shown.extend(os.read(ready, 65536) for ready in select.select(sources, [], [], 0.05)[0])

    wait_until_training(tmp_path / "stopped", meanwhile=keep_reading)
    shown = b"".join(shown)
    os.close(reader)  # `tee` got the hang-up too (or nobody read it at all)
    os.close(master)  # the terminal goes away: the kernel hangs it up and sends SIGHUP
    assert proc.wait(timeout=120) == 129, shown.decode(errors="replace")[-2000:]
    assert b"Traceback" not in shown and b"model:" in shown  # it did write there while it could
    saved = load_checkpoint(tmp_path / "stopped/checkpoints/checkpoint_last.pt")["progress"]["step"]
    assert 5 <= saved < 30, f"stopped at step {saved}"
    if output == "pipe":
        return  # the same save as the terminal's; resuming it once is enough
    train(load_config(stopped), resume=True, progress_bar=False)  # the save is the process's; resuming it is not
    assert_same_final_weights(straight_30_steps, tmp_path / "stopped/checkpoints/checkpoint_last.pt", 30)


@pytest.mark.slow
def test_importing_tfm_enlarges_onednn_kernel_cache_unless_the_user_set_it():
    """oneDNN reads ONEDNN_PRIMITIVE_CACHE_CAPACITY once, at its first matmul: importing tfm sets it
    (before any torch op of ours runs), and a value the user exported is kept."""
    code = "import os, transformer_cli; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(ours.stdout) == 16384
    users = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "77"},
                           capture_output=True, text=True, check=True)
    assert users.stdout.strip() == "77"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
@pytest.mark.slow
def test_memory_kept_for_reuse_goes_back_to_the_os_when_released():
    """Training keeps freed memory in the heap (keep_freed_memory); release_freed_memory, run after
    each validation, hands it back: the resident set shrinks by what was freed."""
    script = (
        "import torch\n"
        "from transformer_cli.runtime.cpu import keep_freed_memory, release_freed_memory\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20\n"
        "assert keep_freed_memory()\n"
        "blocks = [torch.ones(2**22) for _ in range(64)]  # 1 GiB in 16 MiB blocks, touched\n"
        "del blocks\n"
        "kept = rss()\n"
        "assert release_freed_memory()\n"
        "print(kept, rss())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, released = map(int, out.stdout.split())
    assert kept - released > 800, (kept, released)  # MiB


@pytest.mark.parametrize("user_setting, expected", [(None, "16"), ("64", "64")])
def test_training_keeps_few_kernels_unless_the_user_says(user_setting, expected):
    """`tfm train` bounds oneDNN's kernel cache (memory); decoding keeps the large one; a user's
    ONEDNN_PRIMITIVE_CACHE_CAPACITY always wins."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    if user_setting is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = user_setting
    script = ("import os, transformer_cli\n"
              "from transformer_cli.runtime.cpu import limit_training_kernel_cache\n"
              "decoding = os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY']\n"
              "limit_training_kernel_cache()\n"
              "print(decoding, os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [user_setting or "16384", expected]
