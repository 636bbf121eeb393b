"""`tfm serve` run by an operator: API keys, quotas, fair share between clients, Prometheus
metrics, the access log, /languages and /detect."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import tfm_in_process
from tests.test_serve import Server
from tests.test_serve_abuse import send
from transformer_cli.serve.access import ApiKeys, Quotas, hash_key
from transformer_cli.serve.batcher import RECENT, FairQueue, Job

pytest.importorskip("prometheus_client", reason="tfm serve needs the [serve] extra (CI installs it with [test])")


def make_keys(path: Path, *names: str) -> dict[str, str]:
    keys = {}
    for name in names:
        result = tfm_in_process("api-key", "--api-keys", path, "--name", name)
        assert result.exit_code == 0, result.stderr
        keys[name] = result.stdout.strip()
    return keys


@pytest.fixture(scope="module")
def keyed(reverse_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed")
    keys = make_keys(root / "keys.txt", "alice", "bob", "flood", "single", "detector")
    server = Server(reverse_model[1].best_checkpoint, "--api-keys", str(root / "keys.txt"), "--access-log",
                    str(root / "access.log"), "--quota-chars", "400", "--workers", "1")
    yield server, keys, root
    code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr, stderr
    for key in keys.values():  # never written anywhere by the server
        assert key not in stderr and key not in (root / "access.log").read_text()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_key_file_holds_hashes_only(keyed):
    _, keys, root = keyed
    text = (root / "keys.txt").read_text()
    assert all(key not in text and f"sha256:{hash_key(key)} {name}" in text for name, key in keys.items())
    loaded = ApiKeys.load(root / "keys.txt")
    assert loaded.identify(f"Bearer {keys['bob']}") == "bob" and loaded.identify(f"bearer {keys['bob']}") == "bob"
    assert loaded.identify(f"Bearer {keys['bob']}x") is None and loaded.identify(keys["bob"]) is None


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer tfm-wrong"}, {"Authorization": "Basic abc"},
                                     {"Authorization": "Bearer "}])
def test_without_a_right_key_every_endpoint_but_health_is_401(keyed, headers):
    server, _, _ = keyed
    for path, body in (("/translate", b'{"text": "wa"}'), ("/detect", b'{"text": "wa"}'), ("/languages", None),
                       ("/metrics", None), ("/docs", None), ("/openapi.json", None)):
        status, answer, _ = send(server.port, body, headers=headers, path=path)
        assert status == 401 and "Authorization: Bearer" in answer["error"], path
    assert send(server.port, None, headers=headers, path="/health")[:2] == (200, {"status": "ok"})


def test_a_right_key_translates_and_the_access_log_names_its_key_never_the_text(keyed):
    server, keys, root = keyed
    status, answer, _ = send(server.port, json.dumps({"text": ["wa wb wc", "wd"]}).encode(), headers=bearer(keys["alice"]))
    assert status == 200 and len(answer["translations"]) == 2
    deadline = time.monotonic() + 10  # the line is written once the answer is sent: a moment after it arrives
    while True:
        records = [json.loads(line) for line in (root / "access.log").read_text().splitlines()]
        mine = [r for r in records if r["client"] == "alice" and r["path"] == "/translate" and r["status"] == 200]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert mine and mine[-1]["chars"] == len("wa wb wc") + len("wd") and mine[-1]["lines"] == 2
    assert set(mine[-1]) == {"time", "client", "method", "path", "status", "chars", "lines", "ms"}
    assert "wa wb wc" not in (root / "access.log").read_text()


def test_past_the_character_quota_a_client_gets_429_with_retry_after_and_others_go_on(keyed):
    server, keys, _ = keyed
    line = "wa wb wc wd we wf wg wh " * 4  # 96 characters
    statuses = []
    for _ in range(6):  # 576 characters against a quota of 400 a minute
        request = urllib_request(server.port, {"text": line}, keys["bob"])
        statuses.append(request)
    assert statuses[:4] == [(200, None)] * 4 and statuses[4][0] == 429
    retry_after = int(statuses[4][1])
    assert 1 <= retry_after <= 60
    assert send(server.port, json.dumps({"text": line}).encode(), headers=bearer(keys["alice"]))[0] == 200
    too_big = send(server.port, json.dumps({"text": ["wa " * 100, "wb " * 100]}).encode(), headers=bearer(keys["single"]))
    assert too_big[0] == 413 and "quota of 400" in too_big[1]["error"]


def test_detect_spends_the_same_character_quota_as_translate(keyed):
    server, keys, _ = keyed
    line = "Ein Hund läuft über die grüne Wiese. " * 2  # 74 characters
    statuses = [send(server.port, json.dumps({"text": line}).encode(), headers=bearer(keys["detector"]),
                     path="/detect")[0] for _ in range(6)]
    assert statuses[:5] == [200] * 5 and statuses[5] == 429  # 444 characters against 400 a minute
    status, answer, _ = send(server.port, json.dumps({"text": "wa wb wc " * 10}).encode(), headers=bearer(keys["detector"]))
    assert status == 429 and "quota of 400 characters" in answer["error"]  # spent on /detect
    too_big = send(server.port, json.dumps({"text": ["wa " * 100, "wb " * 100]}).encode(),
                   headers=bearer(keys["single"]), path="/detect")
    assert too_big[0] == 413 and "quota of 400" in too_big[1]["error"]


def test_a_document_spends_the_characters_it_sends_even_where_it_has_nothing_to_translate(keyed):
    """A document with no sentence (160 kB of `<!--` were logged as 0 characters) pays what it sends:
    reading it is work. Over the quota it is refused before a parser sees it."""
    server, keys, root = keyed
    comments = b"<!--" * 60  # 240 characters, no sentence
    first = send(server.port, comments, headers=bearer(keys["flood"]), path="/translate/file?name=a.html")
    assert first[0] == 200, first  # nothing a reader sees: the document comes back as it was
    second = send(server.port, comments, headers=bearer(keys["flood"]), path="/translate/file?name=a.html")
    assert second[0] == 429 and "quota of 400 characters" in second[1]["error"], second  # 480 against 400
    too_big = send(server.port, b"<!--" * 101, headers=bearer(keys["single"]), path="/translate/file?name=a.md")
    assert too_big[0] == 413 and "quota of 400" in too_big[1]["error"], too_big
    page = "<p>" + "wa " * 70 + "</p>"  # 210 characters of words, 217 read
    documents = send(server.port, json.dumps({"text": [page, page], "format": "html"}).encode(),
                     headers=bearer(keys["single"]))
    assert documents[0] == 413 and f"{2 * len(page)} characters" in documents[1]["error"], documents
    logged = [json.loads(line) for line in (root / "access.log").read_text().splitlines()]
    assert any(entry["path"].startswith("/translate/file") and entry["status"] == 200 and entry["chars"] == 240
               for entry in logged), logged[-5:]


def urllib_request(port: int, body: dict, key: str) -> tuple[int, str | None]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **bearer(key)})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, None
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("Retry-After")


def test_metrics_parse_with_the_prometheus_parser_and_count_what_happened(keyed):
    from prometheus_client.parser import text_string_to_metric_families

    server, keys, _ = keyed
    send(server.port, json.dumps({"text": ["wa wb", "wc"]}).encode(), headers=bearer(keys["alice"]))
    status, answer, _ = send(server.port, None, headers=bearer(keys["alice"]), path="/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(answer["text"])}
    assert {"tfm_requests", "tfm_request_seconds", "tfm_characters", "tfm_sentences", "tfm_batch_lines",
            "tfm_queue_requests", "tfm_decoding_processes", "tfm_model_info", "tfm_quota_rejections"} <= set(families)
    translated = sum(s.value for s in families["tfm_requests"].samples
                     if s.labels.get("endpoint") == "/translate" and s.labels.get("status") == "200")
    assert translated >= 1 and families["tfm_sentences"].samples[0].value >= 2
    unauthorized = sum(s.value for s in families["tfm_requests"].samples if s.labels.get("status") == "401")
    assert unauthorized >= 1
    info = families["tfm_model_info"].samples[0].labels
    assert "best" in info["model"] and info["engine"]


def test_languages_and_detect(keyed):
    server, keys, _ = keyed
    status, answer, _ = send(server.port, None, headers=bearer(keys["alice"]), path="/languages")
    assert status == 200 and answer["source"] == ["src"] and answer["target"] == ["tgt"] and not answer["multilingual"]
    body = json.dumps({"text": ["Ein Hund läuft über die grüne Wiese.", "A dog runs across the green meadow.", ""]})
    status, answer, _ = send(server.port, body.encode(), headers=bearer(keys["alice"]), path="/detect")
    assert status == 200 and [d["language"] for d in answer["detections"]] == ["de", "en", None]
    assert 0.5 < answer["detections"][0]["confidence"] <= 1.0
    auto = send(server.port, json.dumps({"text": ["wa wb"], "src_lang": "auto"}).encode(), headers=bearer(keys["alice"]))
    assert auto[0] == 200 and len(auto[1]["src_lang"]) == 1
    wrong = send(server.port, json.dumps({"text": "wa", "src_lang": "fr"}).encode(), headers=bearer(keys["alice"]))
    assert wrong[0] == 422 and "translates from src" in wrong[1]["error"]


@pytest.fixture(scope="module")
def unlimited(reverse_model, tmp_path_factory):
    """A server with keys and no quota, tfm's engine (one batch decoding at a time)."""
    root = tmp_path_factory.mktemp("fair")
    keys = make_keys(root / "keys.txt", "flood", "single")
    server = Server(reverse_model[1].best_checkpoint, "--api-keys", str(root / "keys.txt"), "--workers", "1")
    yield server, keys
    server.stop()


def batches(times: list[float], gap: float = 0.05) -> int:
    """How many batches answered at these times (answers of one batch come within `gap` seconds)."""
    times = sorted(times)
    return sum(1 for i, t in enumerate(times) if i == 0 or t - times[i - 1] > gap)


@pytest.mark.slow  # a server of its own and 24 clients
def test_a_flooding_client_cannot_hold_back_another_clients_single_request(unlimited):
    """Fair share: while one client keeps 24 heavy requests queued, another client's single line
    goes in the next batch. Bound: between its arrival and its answer at most two of the flood's
    batches end (the one decoding when it arrives, and one collected at that moment); first in,
    first out it would wait for the ~4 batches of flood requests queued before it."""
    server, keys = unlimited
    heavy = json.dumps({"text": ["wa wb wc wd we wf wg wh wi"] * 40, "beam": 8}).encode()
    finished: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            status, _, _ = send(server.port, heavy, headers=bearer(keys["flood"]), timeout=600)
            assert status == 200
            with lock:
                finished.append(time.monotonic())

    with ThreadPoolExecutor(24) as clients:
        floods = [clients.submit(flood) for _ in range(24)]
        # The flood is queued and under way (three of its batches done: seconds, more on a slow CPU).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with lock:
                if batches(list(finished)) >= 3:
                    break
            time.sleep(0.05)
        sent = time.monotonic()
        status, answer, _ = send(server.port, b'{"text": "wa wb"}', headers=bearer(keys["single"]), timeout=600)
        answered = time.monotonic()
        time.sleep(0.5)
        stop.set()
        for future in floods:
            future.result()
    assert status == 200 and len(answer["translations"]) == 1
    assert batches([t for t in finished if t < sent]) >= 3, "the flood was not under way: nothing was tested"
    assert batches([t for t in finished if sent < t <= answered]) <= 2


@pytest.mark.slow  # a server of its own, four flooding clients
def test_detect_floods_take_turns_and_never_hold_the_event_loop(unlimited):
    """Four clients loop /detect requests of ~0.9 MB (100 lines of 9,000 characters) while another
    asks for /health and a one-line translation: identification runs off the event loop, a chunk of
    lines a turn, so their answers stay within a small multiple of what they take alone (once the
    flood identified on the event loop: /health took ~0.6 s, the translation ~1.4 s)."""
    server, keys = unlimited

    def timed(path: str, body: bytes | None) -> float:
        status, _, seconds = send(server.port, body, headers=bearer(keys["single"]), path=path)
        assert status == 200
        return seconds

    one_line = b'{"text": "wa wb"}'
    alone = sorted(timed("/translate", one_line) for _ in range(5))[2]
    flood_body = json.dumps({"text": ["Ein Hund läuft über die grüne Wiese und bellt. " * 190] * 100},
                            ensure_ascii=False).encode()
    assert len(flood_body) < 1 << 20  # --max-body-bytes
    stop, flooded = threading.Event(), []

    def flood() -> None:
        while not stop.is_set():
            status, answer, _ = send(server.port, flood_body, headers=bearer(keys["flood"]), path="/detect", timeout=600)
            assert status == 200 and answer["detections"][99]["language"] == "de"
            flooded.append(1)

    with ThreadPoolExecutor(4) as clients:
        floods = [clients.submit(flood) for _ in range(4)]
        deadline = time.monotonic() + 120
        while len(flooded) < 2 and time.monotonic() < deadline and not any(f.done() for f in floods):
            time.sleep(0.05)
        health = sorted(timed("/health", None) for _ in range(9))[4]
        translate = sorted(timed("/translate", one_line) for _ in range(9))[4]
        stop.set()
        for future in floods:
            future.result()
    assert len(flooded) >= 4, "the flood was not under way: nothing was tested"
    assert health < 0.25 and translate < 5 * alone + 0.25, (health, translate, alone)


def test_fair_queue_takes_the_client_that_used_least_and_holds_one_over_its_share():
    import asyncio

    async def scenario() -> None:
        queue = FairQueue()
        loop = asyncio.get_running_loop()
        for client in ("flood", "flood", "flood", "a", "b"):
            queue.put(Job(["x"], None, loop.create_future(), client=client, settings="{}"))  # type: ignore[arg-type]
        queue.charge("flood", 5.0)  # it decoded for 5 s lately
        assert [queue.take().client, queue.take().client] == ["a", "b"]  # the least used first, in arrival order
        queue.started({"a", "b"})
        assert queue.take() is None  # a and b decode: the flood, over its share, waits
        queue.ended({"a", "b"})
        assert queue.take() is None  # a and b were answered just now: they are sending their next requests
        queue.answered = {c: t - 2 * RECENT for c, t in queue.answered.items()}
        assert queue.take().client == "flood"  # alone, it takes everything: the engine never idles
        queue.started({"flood"})
        assert queue.take().client == "flood"  # (even a second batch beside its first)

    asyncio.run(scenario())


def test_quotas_refill_and_bound_requests_in_flight():
    quotas = Quotas(chars_per_minute=120, concurrent=1)
    assert quotas.admit("c", 100) is None
    status, message, retry = quotas.admit("c", 10)
    assert status == 429 and "requests of this client" in message  # one in flight already
    quotas.release("c")
    status, message, retry = quotas.admit("c", 30)
    assert status == 429 and 1 <= retry <= 6, (message, retry)  # 10 left, 20 more at 2 a second: 10 s
    assert quotas.admit("other", 30) is None
    assert quotas.admit("c", 500)[0] == 413


def test_a_bad_key_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "keys.txt"
    bad.write_text("tfm-plain-key-not-hashed\n")
    result = tfm_in_process("serve", "--checkpoint", tmp_path / "x.pt", "--api-keys", bad)
    assert result.exit_code == 2 and "line 1: not 'sha256:<64 hex digits> [name]'" in result.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("# no keys yet\n")
    result = tfm_in_process("serve", "--checkpoint", tmp_path / "x.pt", "--api-keys", empty)
    assert result.exit_code == 2 and "holds no key" in result.stderr
    result = tfm_in_process("api-key", "--api-keys", bad)
    assert result.exit_code == 2 and "line 1" in result.stderr and bad.read_text() == "tfm-plain-key-not-hashed\n"


@pytest.mark.slow  # two servers of their own
def test_x_forwarded_for_names_the_client_only_from_a_proxy_the_operator_trusts(reverse_model, tmp_path):
    """Without keys, a client is its address: a forged X-Forwarded-For must not make each request a
    new client with a fresh quota (nor write the forged address in the access log), unless
    --forwarded-allow-ips names the proxy the request came through."""
    line = json.dumps({"text": "wa wb wc wd we wf wg wh " * 4}).encode()  # 96 characters, quota 200
    for trusted in (None, "127.0.0.1"):
        log = tmp_path / f"access-{trusted}.log"
        extra = ["--forwarded-allow-ips", trusted] if trusted else []
        server = Server(reverse_model[1].best_checkpoint, "--quota-chars", "200", "--access-log", str(log),
                        "--workers", "1", *extra)
        try:
            statuses = [send(server.port, line, headers={"X-Forwarded-For": f"203.0.113.{k}"})[0] for k in range(1, 4)]
        finally:
            code, stderr = server.stop()
        assert code == 0 and "Traceback" not in stderr, stderr
        clients = [json.loads(record)["client"] for record in log.read_text().splitlines()]
        if trusted is None:
            assert statuses == [200, 200, 429] and set(clients) == {"127.0.0.1"}
        else:
            assert statuses == [200, 200, 200] and clients[-3:] == ["203.0.113.1", "203.0.113.2", "203.0.113.3"]


def test_key_files_that_cannot_hold_keys_are_one_line_errors_and_stay_as_they_were(tmp_path):
    """A directory, bytes that are not UTF-8, a path through a file: `tfm serve --api-keys` and
    `tfm api-key` name the file and what is wrong, and append nothing."""
    from transformer_cli.runtime.errors import TfmError
    from transformer_cli.serve.access import ApiKeys, new_api_key

    folder, latin = tmp_path / "folder", tmp_path / "latin.txt"
    folder.mkdir()
    latin.write_bytes(b"sha256:\xff\n")
    for path, says in ((folder, "a directory, not a key file"), (latin, "not UTF-8 text"),
                       (latin / "keys.txt", "cannot be read (Not a directory)")):
        with pytest.raises(TfmError, match=rf"^--api-keys {path}: {re.escape(says)}"):
            ApiKeys.load(path)
    for path, says in ((folder, "not a regular file"), (latin, "not UTF-8 text")):
        with pytest.raises(TfmError, match=rf"^--api-keys {path}: {says}"):
            new_api_key(path, "x")
    assert latin.read_bytes() == b"sha256:\xff\n" and list(folder.iterdir()) == []


def test_the_access_log_never_fails_a_request_and_proxies_are_trusted_only_when_named():
    from transformer_cli.serve.access import AccessLog, trusted_proxy_addresses

    AccessLog(None).write("alice", "POST", "/translate", 200, 5, 1, 0.01)  # no log asked for
    closed = io.StringIO()
    closed.close()
    AccessLog(closed).write("alice", "POST", "/translate", 200, 5, 1, 0.01)  # a log that went away
    assert trusted_proxy_addresses(None) is None
    assert trusted_proxy_addresses("*, 10.0.0.0/8,127.0.0.1") == "*,10.0.0.0/8,127.0.0.1"
