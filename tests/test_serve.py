"""`tfm serve` as a real process on loopback: concurrent clients get what `tfm translate` gives,
bad requests get a 4xx JSON error without disturbing anyone, SIGTERM lets requests in flight finish."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.warm_processes import preexec
from transformer_cli.decoding.torch_engine import Translator
from transformer_cli.runtime.files import read_lines

pytest.importorskip("fastapi", reason="tfm serve needs the [serve] extra (CI installs it with [test])")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body, raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# In the server's process before exec: the signals a server stops on as a shell would leave them. An
# ignored disposition is inherited across exec, and late in a full test run the test process was found
# with SIGINT and SIGHUP ignored (the server then, rightly, kept ignoring them).
_default_signal_dispositions = preexec(default_signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


class Server:
    def __init__(self, checkpoint, *extra: str, fp32: bool = True):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "transformer_cli.cli", "serve", "--checkpoint", str(checkpoint), "--port",
             str(self.port), *(["--set", "decode.precision=fp32"] if fp32 else []), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signal_dispositions)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as answer:
                    assert json.loads(answer.read()) == {"status": "ok"}
                    return
            except (urllib.error.URLError, ConnectionError):
                assert self.process.poll() is None, self.process.communicate()
                time.sleep(0.2)
        raise AssertionError("tfm serve did not answer /health within 120 s")

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        _, stderr = self.process.communicate(timeout=60)
        return self.process.returncode, stderr


@pytest.fixture(scope="module")
def server(reverse_model):
    running = Server(reverse_model[1].best_checkpoint, "--max-lines", "50", "--max-chars", "500")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def sentences(reverse_model):
    config, _ = reverse_model
    return read_lines(f"{config.data.test}.src.gz")


def test_concurrent_clients_get_what_translate_gives(server, reverse_model, sentences):
    lines = (sentences * 2)[:200]
    translator = Translator.from_checkpoint(reverse_model[1].best_checkpoint, device="cpu",
                                            overrides=["decode.precision=fp32"])
    expected = [t[0].text for t in translator.translate(lines)]
    with ThreadPoolExecutor(max_workers=16) as clients:  # 16 clients, one sentence a request
        answers = list(clients.map(lambda line: post(server.port, {"text": line}), lines))
    assert [status for status, _ in answers] == [200] * len(lines)
    assert [body["translations"] for _, body in answers] == [[e] for e in expected]
    status, body = post(server.port, {"text": lines[:5], "beam": 3, "nbest": 2, "alignment": True})
    assert status == 200 and body["translations"] == expected[:5]
    assert [len(n) for n in body["nbest"]] == [2] * 5 and all(body["alignments"])


@pytest.mark.parametrize("raw, body, status, says", [
    (b"not json", None, 422, "JSON"),
    (None, {"txt": "wa"}, 422, "text"),
    (None, {"text": 5}, 422, "text"),
    (None, {"text": ["wa", None]}, 422, "text"),
    (None, {"text": ["wa"] * 51}, 413, "51 lines"),
    (None, {"text": "wa " * 200}, 413, "600 characters"),
    (None, {"text": "wa\nwb"}, 422, "line break"),
    (None, {"text": "wa", "beam": 0}, 422, "beam"),
    (None, {"text": "wa", "beam": True}, 422, "beam: true is a boolean"),
    (None, {"text": "wa", "nbest": False}, 422, "nbest: false is a boolean"),
    (None, {"text": "wa", "alignment": 1}, 422, "alignment: 1 is not a boolean"),
    (None, {"text": "wa", "nbest": 5, "beam": 2}, 422, "nbest"),
    (None, {"text": "wa", "sample": True, "top_p": 2}, 422, "top_p"),
    (None, {"text": "wa", "temperature": -1}, 422, "temperature"),
    (None, {"text": "wa", "precision": "int8"}, 422, "precision"),
    (None, {"text": ["wa", "wb"], "prefix": ["wa"]}, 422, "prefix: 1 given for 2 lines"),
    (None, {"text": "wa", "prefix": "wa\nwb"}, 422, "line break"),
    (None, {"text": "wa", "prefix": 5}, 422, "prefix"),
    (None, {"text": "wa", "prefix": "wa " * 200}, 413, "prefix line 1: 600 characters"),
    (None, {"text": ["wa", "wb"], "constraints": [["wa"]]}, 422, "constraints: 1 given for 2 lines"),
    (None, {"text": "wa", "constraints": ["wa"]}, 422, "constraints"),
    (None, {"text": "wa", "constraints": [[""]]}, 422, "constraints line 1: an empty term"),
    (None, {"text": "wa", "constraints": [["wa\twb"]]}, 422, "constraints line 1: a tab"),
    (None, {"text": "wa", "constraints": [["wa\nwb"]]}, 422, "line break"),
    (None, {"text": "wa", "constraints": [[5]]}, 422, "constraints"),
    (None, {"text": "wa", "constraints": [["wb"] * 33]}, 413, "constraints line 1: 33 terms"),
    (None, {"text": "wa", "constraints": [["wb " * 200]]}, 413, "constraints line 1: 600 characters"),
    (None, {"text": "wa", "constraints": [["wb"]], "beam": 1}, 422, "need beam search"),
    (None, {"text": "wa", "constraints": [["wb wc"]], "avoid": ["wc"]}, 422, "contains the avoided term 'wc'"),
    (None, {"text": ["wa", "wb"], "avoid": [["wa"]]}, 422, "avoid: 1 given for 2 lines"),
    (None, {"text": "wa", "avoid": [["wa"], "wb"]}, 422, "avoid"),
    (None, {"text": "wa", "avoid": ["wa", " "]}, 422, "avoid line 1: an empty term"),
    (None, {"text": "wa", "tgt_lang": "fr"}, 422, "tgt_lang fr: this model translates into tgt only"),
    (None, {"text": "wa", "tgt_lang": "a b"}, 422, "tgt_lang"),
])
def test_bad_requests_get_an_error_and_the_server_goes_on(server, raw, body, status, says):
    got, answer = post(server.port, body, raw=raw)
    assert got == status and says in json.dumps(answer), answer
    status, answer = post(server.port, {"text": ["wa wb wc", ""]})
    assert (status, answer["translations"]) == (200, ["wc wb wa", ""])
    # Each line's score: the model's mean log-probability per token (an empty line has none).
    assert answer["scores"][1] is None and -1.0 < answer["scores"][0] <= 0.0


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_and_exits_cleanly(reverse_model, sentences):
    server = Server(reverse_model[1].best_checkpoint, "--max-lines", "1000")
    answers = []
    requests = [threading.Thread(target=lambda: answers.append(post(server.port, {"text": sentences, "beam": 8})))
                for _ in range(4)]
    for thread in requests:
        thread.start()
    time.sleep(0.3)  # the requests are being decoded
    code, stderr = server.stop()
    for thread in requests:
        thread.join()
    assert code == 0 and "Traceback" not in stderr, stderr
    assert [status for status, _ in answers] == [200] * 4
    assert all(len(body["translations"]) == len(sentences) for _, body in answers)
    with pytest.raises(urllib.error.URLError):
        post(server.port, {"text": "wa"}, timeout=5)
    assert "stopped" in stderr


def test_a_port_in_use_is_one_line(reverse_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "transformer_cli.cli", "serve", "--checkpoint",
                               str(reverse_model[1].best_checkpoint), "--port", str(port)],
                              capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: cannot serve on 127.0.0.1:{port}" in proc.stderr
    assert "http://" not in proc.stderr  # no "serving on …" line for an address it cannot serve on


def test_the_server_runs_the_model_on_the_main_thread_only():
    """The event loop's calls of the engine are made on the thread running `run_until` (the main
    thread in `tfm serve`: torch's OpenMP threads then stay one team), results and errors reach
    the awaiting request, and `run_until` returns once it is told to and nothing is left."""
    import asyncio

    from transformer_cli.serve.batcher import MainThreadDecoder

    decoder = MainThreadDecoder()
    answers: dict = {}

    def on_model_thread(value: int) -> tuple[int, bool]:
        if value < 0:
            raise ValueError("negative")
        return value * 2, threading.current_thread() is threading.main_thread()

    async def requests() -> None:
        answers["ok"] = await asyncio.gather(*(decoder.run(lambda v=v: on_model_thread(v)) for v in range(5)))
        try:
            await decoder.run(lambda: on_model_thread(-1))
        except ValueError as error:
            answers["error"] = str(error)

    loop_thread = threading.Thread(target=lambda: asyncio.run(requests()))
    loop_thread.start()
    decoder.run_until(lambda: not loop_thread.is_alive())
    loop_thread.join()
    assert threading.current_thread() is threading.main_thread()
    assert answers == {"ok": [(0, True), (2, True), (4, True), (6, True), (8, True)], "error": "negative"}


def test_constraints_and_avoided_terms_per_line(server, reverse_model, sentences):
    """Requests with constraints, avoided terms and none, batched together: each line gets its own
    terms, the others translate as they do alone; a term that cannot be placed is reported."""
    translator = Translator.from_checkpoint(reverse_model[1].best_checkpoint, device="cpu",
                                            overrides=["decode.precision=fp32"])
    lines = sentences[:12]
    plain = [t[0].text for t in translator.translate(lines)]
    words = [f"w{c}" for c in "abcdefghijklmnop"]
    wanted = [next(w for w in words if w not in p.split()) if i % 3 == 0 else None for i, p in enumerate(plain)]
    avoided = [p.split()[0] if i % 3 == 1 else None for i, p in enumerate(plain)]

    def request(i: int) -> dict:
        body: dict = {"text": [lines[i]]}
        if wanted[i]:
            body["constraints"] = [[wanted[i]]]
        if avoided[i]:
            body["avoid"] = [avoided[i]]
        return body

    with ThreadPoolExecutor(max_workers=6) as clients:
        answers = list(clients.map(lambda i: post(server.port, request(i)), range(len(lines))))
    for i, (status, body) in enumerate(answers):
        assert status == 200, body
        text = body["translations"][0]
        if wanted[i]:
            assert wanted[i] in text.split() and body["unmet"] == [[]]
        elif avoided[i]:
            assert avoided[i] not in text.split()
        else:
            assert text == plain[i] and "unmet" not in body
    status, body = post(server.port, {"text": lines[:2], "constraints": [["wa"], ["w\u00e4"]], "nbest": 2})
    assert status == 200 and "wa" in body["translations"][0].split() and body["unmet"][1] == ["w\u00e4"]
    assert all("wa" in h["text"].split() for h in body["nbest"][0])


def test_a_prefix_per_line_stays_with_its_line(server, reverse_model, sentences):
    """Requests with and without prefixes, batched together: each translation starts with its own
    line's prefix, and lines without one translate as they do alone."""
    translator = Translator.from_checkpoint(reverse_model[1].best_checkpoint, device="cpu",
                                            overrides=["decode.precision=fp32"])
    lines = sentences[:12]
    plain = [t[0].text for t in translator.translate(lines)]
    prefixes = [line.split()[0] if i % 3 == 0 else "" for i, line in enumerate(lines)]  # another line's word
    with ThreadPoolExecutor(max_workers=6) as clients:
        answers = list(clients.map(lambda i: post(server.port, {"text": lines[i], "prefix": prefixes[i]}),
                                   range(len(lines))))
    for i, (status, body) in enumerate(answers):
        assert status == 200
        if prefixes[i]:
            assert body["translations"][0].startswith(prefixes[i])
        else:
            assert body["translations"] == [plain[i]]
    status, body = post(server.port, {"text": lines[:3], "prefix": prefixes[:3], "beam": 3, "nbest": 2})
    assert status == 200 and all(h["text"].startswith(prefixes[0]) for h in body["nbest"][0])
    assert body["translations"][1:] == plain[1:3]


def test_an_all_caps_or_title_case_line_is_answered_in_its_casing(server, reverse_model, sentences):
    """decode.casing through the server: the lines read in lower case, their translations cased back."""
    lines = sentences[:6]
    translator = Translator.from_checkpoint(reverse_model[1].best_checkpoint, device="cpu",
                                            overrides=["decode.precision=fp32"])
    expected = [t[0].text for t in translator.translate(lines)]
    shouting = [line.upper() for line in lines[:3]]
    titled = [" ".join(word.capitalize() for word in line.split()) for line in lines[3:]]
    status, body = post(server.port, {"text": shouting + titled})
    assert status == 200
    assert body["translations"][:3] == [e.upper() for e in expected[:3]]
    assert body["translations"][3:] == [" ".join(w[:1].upper() + w[1:] for w in e.split()) for e in expected[3:]]
