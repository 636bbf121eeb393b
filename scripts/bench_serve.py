"""Load on `tfm serve`: requests/s and latency for 1, 16 and 64 concurrent clients, against
`tfm translate`'s throughput on the same sentences (loopback only; bounded in count and time).

    pip install -e '.[serve]'
    python scripts/bench_serve.py --checkpoint runs/de-en/checkpoints/checkpoint_best.pt \
        --src data/multi30k/test_2016_flickr.de.gz

Each client sends one sentence per request, over its own kept-alive connection, and waits for the
answer before sending the next. Per client count: --requests requests (at most --seconds of
sending), requests/s, p50/p99 latency, and how many answers differ from `tfm translate`'s (with the
same engine) for the same sentence (dynamic batching puts a sentence beside other sentences than `tfm translate`
does; in bf16 that may change a word now and then, in fp32 it should not).

Two peers, measured before the server starts: `tfm translate` on the whole file (length-sorted full
batches: the most a server could reach if every sentence were in flight at once), and
`tfm translate` on random groups of as many sentences as there are clients, split over the
decoding processes as the server splits a batch (decode.batching: balanced; the most it can reach
when each client has one sentence in flight). Target: with 64 clients ≥ 0.8x the second; the first shows what one-sentence
requests cost against whole-file translation. `--abusive` adds one client that sends bad requests
throughout (target: 0 errors among the good clients, only 4xx for the bad ones).

`--format text` or `--format html` sends each sentence as a document of that format (`"format"` in the
request; html as `<p>sentence</p>`): what reading and rebuilding a document in its own process
costs against lines (answers compared with their markup removed).

`--engines torch,auto` measures a server on each engine in turn (tfm's own; the default, CTranslate2
where it applies) and prints auto's requests/s over torch's per client count. Target: ≥ 1.5x with
64 clients.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_common import machine_line  # noqa: E402

from transformer_cli.decoding.engine import open_engine  # noqa: E402
from transformer_cli.decoding.translation import TranslationEngine  # noqa: E402
from transformer_cli.runtime.entry import ScriptParser, run_script  # noqa: E402
from transformer_cli.runtime.files import read_lines  # noqa: E402
from transformer_cli.serve.batcher import request_batch_decode  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, engine: str, operator: list[str] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "transformer_cli.cli", "serve", "--checkpoint", args.checkpoint,
               "--port", str(port), "--engine", engine, *[a for s in args.set for a in ("--set", s)], *operator]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"tfm serve exited: {server.stderr.read()}") from None
            time.sleep(0.2)
    raise SystemExit("tfm serve did not start within 120 s")


# What one abusive client sends in turn (--abusive): requests that once failed every request batched
# with them (a lone surrogate, a non-string line), cost the machine (a body over the limit, 10,000
# lines) or are not requests at all, each answered with a 4xx; and the most expensive request within
# every limit (a 1,000-word line, beam 64, 64 hypotheses), answered: it takes its turn at decoding.
ABUSE = [json.dumps({"text": "Ein \ud800 Hund"}), '{"text": ["Ein Hund", 5]}', '{"text": "Hund", "beam": NaN}',
         json.dumps({"text": ["Ein Hund"] * 10_000}), '{"text": "' + "a" * (2 << 20) + '"}',
         json.dumps({"text": "Ein Hund " * 1000, "beam": 64, "nbest": 64}), "not json", '{"text": ' + "[" * 20_000]


def headers(key: str | None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def abusive_client(port: int, done: threading.Event, statuses: list[int], key: str | None = None) -> None:
    i = 0
    while not done.is_set():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            connection.request("POST", "/translate", ABUSE[i % len(ABUSE)], headers(key))
            response = connection.getresponse()
            response.read()
            statuses.append(response.status)
        except (OSError, http.client.HTTPException):
            statuses.append(0)  # the server closed the connection (a refused body): not an answer to count
        finally:
            connection.close()
        i += 1


def request_body(sentence: str, fmt: str) -> str:
    """One request of `sentence`: a line, or a document of `fmt` (text, html)."""
    if fmt == "lines":
        return json.dumps({"text": sentence})
    return json.dumps({"text": f"<p>{sentence}</p>" if fmt == "html" else sentence, "format": fmt})


def answer_text(answer: str) -> str:
    """An answer as words: a document's markup removed."""
    return " ".join(re.sub(r"<[^>]+>", " ", answer).split())


def load(port: int, sentences: list[str], clients: int, requests: int, seconds: float, abusive: bool = False,
         keys: list[str] | None = None, fmt: str = "lines") -> dict:
    """`clients` threads, each sending one sentence a request until `requests` are sent or time is up;
    with `abusive`, one more thread sends the ABUSE requests meanwhile. `keys`: each client's API key
    (the abusive client's last)."""
    serial = iter(range(clients))
    lock = threading.Lock()
    next_index = [0]
    latencies: list[float] = []
    answers: dict[int, str] = {}
    errors = [0]
    stop_at = time.monotonic() + seconds

    def client() -> None:
        with lock:
            key = keys[next(serial)] if keys else None
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while time.monotonic() < stop_at:
            with lock:
                if next_index[0] >= requests:
                    return
                i = next_index[0]
                next_index[0] += 1
            body = request_body(sentences[i % len(sentences)], fmt)
            started = time.perf_counter()
            connection.request("POST", "/translate", body, headers(key))
            response = connection.getresponse()
            payload = response.read()
            with lock:
                latencies.append(time.perf_counter() - started)
                if response.status == 200:
                    answers[i] = answer_text(json.loads(payload)["translations"][0])
                else:
                    errors[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    abuse: list[int] = []
    done = threading.Event()  # the good clients are done: the abusive one stops too
    abuser = threading.Thread(target=abusive_client, args=(port, done, abuse, keys[-1] if keys else None))
    started = time.perf_counter()
    if abusive:
        abuser.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started  # the good clients' time
    done.set()
    if abusive:
        abuser.join()
    latencies.sort()
    return {"clients": clients, "requests": len(latencies), "errors": errors[0], "per_s": len(latencies) / elapsed,
            "p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "answers": answers, "abuse": abuse}


def grouped_rate(translator: TranslationEngine, sentences: list[str], group: int, limit: int = 256) -> float:
    """Sentences/s of `translator` on random groups of `group` sentences (at most `limit` in all,
    a fixed shuffle), each group's batches split over the decoding processes as `tfm serve` does."""
    lines = random.Random(0).sample(sentences, min(limit, len(sentences)))
    decode = request_batch_decode(translator.decode, group, translator.decoding_processes)
    started = time.perf_counter()
    for start in range(0, len(lines), group):
        translator.translate(lines[start : start + group], decode=decode)
    return len(lines) / (time.perf_counter() - started)


def main() -> None:
    parser = ScriptParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--src", required=True, help="Source sentences (plain or .gz).")
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--requests", type=int, default=1000, help="Requests per client count (at most).")
    parser.add_argument("--seconds", type=float, default=60.0, help="Sending time per client count (at most).")
    parser.add_argument("--set", action="append", default=[], help="decode.* settings for both (e.g. decode.beam=1).")
    parser.add_argument("--abusive", action="store_true", help="One more client sending bad requests throughout "
                        "(target: 0 errors among the good clients, a 4xx for every bad request).")
    parser.add_argument("--keys", action="store_true", help="Serve with API keys (one per client, one for the "
                        "abusive client) and an access log; with --abusive, each client count is measured with and "
                        "without the abusive client (target: the good clients keep ≥ 90%% of their requests/s).")
    parser.add_argument("--format", default="lines", choices=("lines", "text", "html"), help="Each request a line "
                        "(default), or a document of this format holding the sentence.")
    parser.add_argument("--engines", default="auto", help="Comma-separated engines, each served in turn "
                        "(torch, auto, ctranslate2); with torch and auto, auto's requests/s over torch's.")
    args = parser.parse_args()
    sentences = read_lines(args.src)
    print(machine_line())
    client_counts = [int(c) for c in args.clients.split(",")]
    rates: dict[str, dict[int, float]] = {}
    for engine in args.engines.split(","):
        rates[engine] = measure(args, engine, sentences, client_counts)
    if "torch" in rates and "auto" in rates:
        for clients in client_counts:
            target = ", target ≥ 1.5x" if clients == 64 else ""
            print(f"{clients} clients: auto / torch {rates['auto'][clients] / rates['torch'][clients]:.2f}x "
                  f"requests/s{target}")


def measure(args, engine: str, sentences: list[str], client_counts: list[int]) -> dict[int, float]:
    """The table for a server on `engine`; its requests/s per client count."""
    translator = open_engine(None, args.set or None, [Path(args.checkpoint)], device="cpu", engine=engine)
    translator.translate(sentences[:64])  # warm-up (starts the decoding workers)
    started = time.perf_counter()
    expected = [t[0].text for t in translator.translate(sentences)]
    translate_rate = len(sentences) / (time.perf_counter() - started)
    group_rates = {c: grouped_rate(translator, sentences, c) for c in client_counts}
    translator.close()
    print(f"\n--engine {engine}: tfm translate: {len(sentences)} sentences, {translate_rate:.1f} sentences/s "
          f"(beam {translator.decode.beam}, {translator.describe()}); in random groups of "
          + ", ".join(f"{c}: {rate:.1f}" for c, rate in group_rates.items()))

    port = free_port()
    keys, operator, folder = operator_options(args.keys, max(client_counts))
    server = start_server(args, port, engine, operator)
    rates = {}
    try:
        load(port, sentences, 4, 64, 30, keys=keys)  # warm-up
        print("| clients | requests | errors | requests/s | vs tfm translate | vs groups of as many | p50 ms | p99 ms "
              "| answers ≠ translate |")
        print("|---|---|---|---|---|---|---|---|---|")
        for clients in client_counts:
            if args.keys and args.abusive:  # the same clients alone first: what the abusive one costs them
                alone = load(port, sentences, clients, args.requests, args.seconds, False, keys[:clients] + keys[-1:])
            result = load(port, sentences, clients, args.requests, args.seconds, args.abusive,
                          keys[:clients] + keys[-1:] if keys else None, args.format)
            rates[clients] = result["per_s"]
            differ = sum(text != answer_text(expected[i % len(sentences)]) for i, text in result["answers"].items())
            print(f"| {clients} | {result['requests']} | {result['errors']} | {result['per_s']:.1f} | "
                  f"{result['per_s'] / translate_rate:.2f}x | {result['per_s'] / group_rates[clients]:.2f}x | "
                  f"{1000 * result['p50']:.0f} | {1000 * result['p99']:.0f} | "
                  f"{differ} |")
            if args.keys and args.abusive:
                print(f"  beside the abusive client the good clients keep {result['per_s'] / alone['per_s']:.0%} of "
                      f"their requests/s alone ({alone['per_s']:.1f}; target ≥ 90%), {result['errors']} errors")
            if args.abusive:
                codes = sorted(set(result["abuse"]))
                print(f"  abusive client: {len(result['abuse'])} bad requests, statuses {codes} "
                      f"(target: 4xx, 0 = connection closed after a refused body, 200 = the beam-64 request "
                      f"within every limit; good clients: 0 errors)")
    finally:
        server.terminate()
        server.wait(timeout=60)
        if folder is not None:
            folder.cleanup()
    print(f"server exit code after SIGTERM: {server.returncode}")
    return rates


def operator_options(with_keys: bool, clients: int) -> tuple[list[str] | None, list[str], tempfile.TemporaryDirectory | None]:
    """With keys: one key per client and one for the abusive client (its last), the server's
    --api-keys and --access-log options, and the folder holding their files."""
    if not with_keys:
        return None, [], None
    from transformer_cli.serve.access import new_api_key

    folder = tempfile.TemporaryDirectory(prefix="bench-serve-")
    key_file = Path(folder.name) / "keys.txt"
    keys = [new_api_key(key_file, f"client-{i}") for i in range(clients + 1)]
    return keys, ["--api-keys", str(key_file), "--access-log", str(Path(folder.name) / "access.jsonl")], folder


if __name__ == "__main__":
    run_script(main)
