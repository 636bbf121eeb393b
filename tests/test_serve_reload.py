"""`tfm serve` takes up a new model on SIGUSR1 without dropping a request, and keeps the old one
when the new one does not load."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest

from tests.conftest import fp32_translator, reverse_task_config, write_reverse_task
from tests.test_serve import Server, post
from tests.test_serve_abuse import send
from transformer_cli.data.prepare import prepare
from transformer_cli.experiment.config import config_from_dict
from transformer_cli.runtime.files import read_lines
from transformer_cli.training.train import train

pytest.importorskip("prometheus_client", reason="tfm serve needs the [serve] extra (CI installs it with [test])")
pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="reload is signalled with SIGUSR1 (POSIX)")


def reloads(port: int) -> dict[str, float]:
    """tfm_model_reloads by outcome, read from /metrics with the Prometheus parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, answer, _ = send(port, None, path="/metrics")
    assert status == 200
    counts = {"ok": 0.0, "failed": 0.0}
    for family in text_string_to_metric_families(answer["text"]):
        for sample in family.samples:
            if sample.name == "tfm_model_reloads_total":
                counts[sample.labels["outcome"]] = sample.value
    return counts


def signal_reload(server: Server, outcome: str, before: dict[str, float]) -> float:
    """Send SIGUSR1 and wait until the reload has ended with `outcome`; when it was seen to."""
    server.process.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = reloads(server.port)
        if now != before:
            assert now[outcome] == before[outcome] + 1, now
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"no reload ({outcome}) within 120 s")


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory):
    """Another model over the same words: it copies its input where the reverse model reverses it, so
    every answer says which of the two made it (a search confident enough to be the same in any batch)."""
    root = tmp_path_factory.mktemp("copy")
    write_reverse_task(root / "data", n_train=3000, n_test=50, seed=1)
    for split in ("train", "valid", "test"):
        shutil.copy(root / "data" / f"{split}.src.gz", root / "data" / f"{split}.tgt.gz")
    config = config_from_dict(reverse_task_config(root / "data", root / "run", max_steps=250, eval_every=250,
                                                  lr_schedule="budget"))
    prepare(config, progress=False)
    return train(config, progress_bar=False).best_checkpoint


def replace(path, source=None, data: bytes | None = None) -> None:
    """Put a new file at `path` the way an operator's deploy should: whole, by a rename."""
    staged = path.with_name(path.name + ".new")
    shutil.copy(source, staged) if source is not None else staged.write_bytes(data or b"")
    os.replace(staged, path)


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_a_reload_under_load_loses_no_request_and_a_bad_checkpoint_keeps_the_model(reverse_model, copy_model, tmp_path,
                                                                                  engine):
    if engine == "ctranslate2":
        pytest.importorskip("ctranslate2")
    config, summary = reverse_model
    lines = read_lines(f"{config.data.test}.src.gz")[:24]
    served, other = tmp_path / "served.pt", tmp_path / "other.pt"
    shutil.copy(summary.best_checkpoint, served)
    shutil.copy(copy_model, other)
    old = [t[0].text for t in fp32_translator(served).translate(lines)]
    new = [t[0].text for t in fp32_translator(other).translate(lines)]
    assert sum(a != b for a, b in zip(old, new)) >= len(lines) // 2  # two models told apart by their answers
    if engine == "torch":  # tfm's engine in fp32: a line's translation does not depend on its batch
        server = Server(served, "--engine", engine)
    else:
        server = Server(served, "--engine", engine, "--compute-type", "float32", fp32=False)
    answers: list[tuple[float, int, int, object]] = []  # (sent at, line, status, translation)
    stop = threading.Event()

    def client(first: int) -> None:
        i = first
        while not stop.is_set():
            sent = time.monotonic()
            status, body = post(server.port, {"text": lines[i % len(lines)]})
            answers.append((sent, i % len(lines), status, body.get("translations", [None])[0]))
            i += 1

    clients = [threading.Thread(target=client, args=(k * 5,)) for k in range(6)]
    try:
        for thread in clients:
            thread.start()
        time.sleep(0.5)  # requests answered by the first model (dozens)
        replace(served, other)
        swapped = signal_reload(server, "ok", {"ok": 0.0, "failed": 0.0})
        time.sleep(0.5)  # ... and by the second
    finally:
        stop.set()
        for thread in clients:
            thread.join()
    assert answers and all(status == 200 for _, _, status, _ in answers), [a for a in answers if a[2] != 200][:3]
    odd = [(i, text, old[i], new[i]) for _, i, _, text in answers if text not in (old[i], new[i])]
    assert not odd, odd[:3]  # each from one model, whole
    assert any(text == old[i] != new[i] for _, i, _, text in answers)  # requests were served while it loaded
    after = [(i, text) for sent, i, _, text in answers if sent > swapped]
    assert after and all(text == new[i] for i, text in after)

    for bad in (b"not a checkpoint", other.read_bytes()[:1000]):  # garbage; a cut-off file
        replace(served, data=bad)
        signal_reload(server, "failed", reloads(server.port))
        status, body = post(server.port, {"text": lines})
        assert status == 200 and body["translations"] == new  # the model loaded before serves on
    code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr
    failures = [line for line in stderr.splitlines() if "reload failed" in line]
    assert len(failures) == 2 and all(str(served) in line or "checkpoint" in line for line in failures), stderr
    assert sum("reloaded the model" in line for line in stderr.splitlines()) == 1, stderr

