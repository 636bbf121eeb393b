"""Who may use a server and how much: API keys, per-client quotas, and the access log.

- **API keys** (`tfm serve --api-keys FILE`): the file holds one key a line, hashed
  (`sha256:<64 hex digits> <name>`; `tfm api-key --api-keys FILE` makes one and prints it once). With
  keys, every endpoint but /health needs `Authorization: Bearer <key>`: 401 otherwise. A presented
  key is hashed and compared with every stored hash in constant time (`hmac.compare_digest`, no
  early exit), so the answer's timing says nothing about how much of a key was right. A key is
  never logged: the log and the metrics name its `name` (or the start of its hash).
- **Quotas**, per client (its key, or its address without keys): characters of text per minute
  (a token bucket refilled continuously) and requests at once; past them 429 with `Retry-After`
  (the seconds until the request's characters fit again); a request larger than the whole minute's
  quota is 413.
- **Access log** (`--access-log FILE`, `-` for stderr): one JSON line per request — time, client,
  method, path, status, characters, lines, latency — never the text.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..runtime.errors import TfmError
from ..runtime.files import atomic_write_text

KEY_LINE = re.compile(r"^sha256:([0-9a-f]{64})(?:[ \t]+(\S.*))?$")
MAX_KEYS = 100_000


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass
class ApiKeys:
    """The hashed keys of `--api-keys FILE` and their names."""

    hashes: list[bytes]
    names: list[str]

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        """Read a key file; a line that is not `sha256:<hex> [name]` (or blank, or a # comment) is a
        TfmError naming it. An empty file is an error too: a server with no key would refuse everyone."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TfmError(f"--api-keys {path}: no such file (make one with `tfm api-key --api-keys {path}`)") from None
        except IsADirectoryError:
            raise TfmError(f"--api-keys {path}: a directory, not a key file") from None
        except UnicodeDecodeError:
            raise TfmError(f"--api-keys {path}: not UTF-8 text") from None
        except OSError as exc:
            raise TfmError(f"--api-keys {path}: cannot be read ({exc.strerror})") from None
        keys = cls.parse(text, path)
        if not keys.hashes:
            raise TfmError(f"--api-keys {path}: holds no key (add one with `tfm api-key --api-keys {path}`)")
        return keys

    @classmethod
    def parse(cls, text: str, path: Path) -> ApiKeys:
        hashes, names = [], []
        text = text.removeprefix("\ufeff")  # a byte-order mark an editor saved at its start
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            found = KEY_LINE.match(line)
            if not found:
                raise TfmError(f"--api-keys {path} line {number}: not 'sha256:<64 hex digits> [name]' (keys are stored "
                               "hashed: add one with `tfm api-key`)")
            hashes.append(bytes.fromhex(found.group(1)))
            names.append(found.group(2) or f"key-{found.group(1)[:8]}")
            if len(hashes) > MAX_KEYS:
                raise TfmError(f"--api-keys {path}: more than {MAX_KEYS} keys")
        return cls(hashes, names)

    def identify(self, authorization: str | None) -> str | None:
        """The name of the key an `Authorization: Bearer <key>` header presents, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        presented = hashlib.sha256(key.strip().encode("utf-8", "replace")).digest()
        found = None
        for stored, name in zip(self.hashes, self.names):  # every one compared: the time is the same for any key
            if hmac.compare_digest(stored, presented):
                found = name
        return found


def new_api_key(path: Path, name: str | None) -> str:
    """A new random key, its hash appended to the key file (written atomically); returns the key."""
    if name is not None and (not name.strip() or any(c.isspace() for c in name) or len(name) > 64):
        raise TfmError("--name: one word of at most 64 characters, without spaces")
    existing = ""
    if path.exists():
        if not path.is_file():
            raise TfmError(f"--api-keys {path}: not a regular file (a key file is rewritten whole)")
        try:
            existing = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TfmError(f"--api-keys {path}: not UTF-8 text") from None
        ApiKeys.parse(existing, path)  # a malformed file is not appended to
        if existing and not existing.endswith("\n"):
            existing += "\n"
    key = "tfm-" + secrets.token_urlsafe(32)
    digest = hash_key(key)
    atomic_write_text(path, existing + f"sha256:{digest} {name or 'key-' + digest[:8]}\n")
    return key


@dataclass
class _Bucket:
    tokens: float
    updated: float
    in_flight: int = 0


@dataclass
class Quotas:
    """Characters per minute and requests at once, per client; 0 = no limit."""

    chars_per_minute: int = 0
    concurrent: int = 0
    clients: dict[str, _Bucket] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _bucket(self, client: str, now: float) -> _Bucket:
        bucket = self.clients.get(client)
        if bucket is None:
            if len(self.clients) > 100_000:  # idle, full buckets carry nothing: forget them
                self.clients = {k: b for k, b in self.clients.items()
                                if b.in_flight or b.tokens + (now - b.updated) * self.chars_per_minute / 60
                                < self.chars_per_minute}
            bucket = self.clients[client] = _Bucket(float(self.chars_per_minute), now)
        if self.chars_per_minute:
            rate = self.chars_per_minute / 60.0
            bucket.tokens = min(float(self.chars_per_minute), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        return bucket

    def admit(self, client: str, chars: int) -> tuple[int, str, int] | None:
        """None: admitted (the caller must `release` it); else (status, message, Retry-After seconds)."""
        with self.lock:
            now = time.monotonic()
            bucket = self._bucket(client, now)
            if self.concurrent and bucket.in_flight >= self.concurrent:
                return 429, (f"{self.concurrent} requests of this client are being answered already "
                             "(tfm serve --quota-concurrent)"), 1
            if self.chars_per_minute:
                if chars > self.chars_per_minute:
                    return 413, (f"text: {chars} characters, more than this client's quota of {self.chars_per_minute} "
                                 "a minute (tfm serve --quota-chars): send less at once"), 0
                if bucket.tokens < chars:
                    wait = max(1, math.ceil((chars - bucket.tokens) * 60.0 / self.chars_per_minute))
                    return 429, (f"this client's quota of {self.chars_per_minute} characters a minute is used up "
                                 f"(tfm serve --quota-chars): {chars} fit again in {wait} s"), wait
                bucket.tokens -= chars
            bucket.in_flight += 1
            return None

    def release(self, client: str) -> None:
        with self.lock:
            bucket = self.clients.get(client)
            if bucket is not None and bucket.in_flight:
                bucket.in_flight -= 1


class AccessLog:
    """One JSON line per request to a stream; a write that fails never fails the request."""

    def __init__(self, stream: IO[str] | None):
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, client: str, method: str, path: str, status: int, chars: int, lines: int, seconds: float) -> None:
        if self.stream is None:
            return
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "client": client, "method": method,
                  "path": path, "status": status, "chars": chars, "lines": lines, "ms": round(seconds * 1000, 1)}
        with self.lock:
            try:
                self.stream.write(json.dumps(record) + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass


def trusted_proxy_addresses(value: str | None) -> str | None:
    """--forwarded-allow-ips as uvicorn takes it (None: trust no proxy header): each comma-separated
    item an IP address, a network (10.0.0.0/8) or *; anything else is a TfmError naming it."""
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    for item in items:
        if item == "*":
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise TfmError(f"--forwarded-allow-ips {value!r}: {item!r} is not an IP address or network "
                           "(e.g. 127.0.0.1,10.0.0.0/8, or * for any)") from None
    return ",".join(items)
