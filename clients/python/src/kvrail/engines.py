"""vLLM engines in etcd: each engine's connector (its scheduler side)
registers the engine under ``<prefix>/engines/<engine id>`` with a lease it
keeps alive, and the router follows the prefix.

A record is JSON::

    {"format": 1, "engine": "prefill-0", "role": "prefill",
     "url": "http://10.0.0.5:8100", "kvrail_node": "node-a",
     "worker": "vllm-prefill-0", "mode": "pull", "model": "..."}

``role`` is ``prefill`` (kv_producer), ``decode`` (kv_consumer) or ``both``
(kv_both). The record goes when the engine exits (deleted) or dies (its
lease expires, 10 s by default); an engine cut off from etcd writes it again
once etcd answers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvrail.etcd import Etcd, EtcdError

log = logging.getLogger("kvrail.engines")

ROLES = ("prefill", "decode", "both")
#: Longest record accepted (a record is a few hundred bytes).
MAX_RECORD_BYTES = 4096
#: Seconds between attempts while etcd does not answer.
RETRY_S = 1.0


def engines_prefix(cluster_prefix: str) -> str:
    return cluster_prefix.rstrip("/") + "/engines/"


@dataclass(frozen=True)
class EngineRecord:
    engine: str
    role: str
    url: str
    kvrail_node: str
    worker: str
    mode: str
    model: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": 1,
                "engine": self.engine,
                "role": self.role,
                "url": self.url,
                "kvrail_node": self.kvrail_node,
                "worker": self.worker,
                "mode": self.mode,
                "model": self.model,
            }
        )

    @staticmethod
    def parse(key: str, text: str, prefix: str) -> EngineRecord:
        """The record under ``key``; ValueError naming what is wrong."""
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError(f"{key}: record of {len(text)} bytes (at most {MAX_RECORD_BYTES})")
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != 1:
            raise ValueError(f"{key}: not an engine record of format 1")
        fields = {}
        for name in ("engine", "role", "url", "kvrail_node", "worker", "mode"):
            v = d.get(name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{key}: {name} missing or not a string")
            fields[name] = v
        if key != prefix + fields["engine"]:
            raise ValueError(f"{key}: names engine {fields['engine']!r}, not its key's")
        if fields["role"] not in ROLES:
            raise ValueError(f"{key}: role {fields['role']!r} is none of {ROLES}")
        if fields["mode"] not in ("pull", "push"):
            raise ValueError(f"{key}: mode {fields['mode']!r} is neither pull nor push")
        if not fields["url"].startswith(("http://", "https://")):
            raise ValueError(f"{key}: url {fields['url']!r} is not http(s)")
        model = d.get("model", "")
        return EngineRecord(model=model if isinstance(model, str) else "", **fields)

    def serves(self, role: str) -> bool:
        return self.role in (role, "both")


class EngineRegistration:
    """Keeps one engine's record in etcd until :meth:`close`: written under a
    lease renewed every third of its TTL from a thread; written again with a
    new lease when the old one is gone (etcd was away longer than the TTL)."""

    def __init__(self, etcd: Etcd, cluster_prefix: str, record: EngineRecord, ttl_s: int = 10) -> None:
        self.etcd = etcd
        self.key = engines_prefix(cluster_prefix) + record.engine
        self.record = record
        self.ttl_s = max(2, ttl_s)
        self.lease: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrail-engine-registration", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        lease = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.key, self.record.to_json(), lease)
        self.lease = lease
        log.info("kvrail: engine %s registered in etcd as %s", self.record.engine, self.key)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.lease is None or not self.etcd.keep_alive(self.lease):
                    self.lease = None
                    self._register()
                wait = self.ttl_s / 3
            except EtcdError as e:
                # Whether etcd was away or the lease is gone, the record is
                # written anew (with a new lease) once etcd answers.
                log.warning("kvrail: engine registration in etcd: %s", e)
                self.lease = None
                wait = RETRY_S
            self._stop.wait(wait)

    def close(self) -> None:
        """Deletes the record (best effort: else its lease ends it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        lease, self.lease = self.lease, None
        try:
            self.etcd.delete(self.key)
            if lease is not None:
                self.etcd.revoke(lease)
        except EtcdError as e:
            log.warning("kvrail: removing engine %s from etcd: %s", self.record.engine, e)


class EngineDirectory:
    """The engines registered under a cluster prefix, kept current by a
    thread that reads the prefix and then watches it (again from a fresh
    read whenever the watch breaks). ``on_change(engine, record or None)``
    is called from that thread."""

    def __init__(
        self,
        etcd: Etcd,
        cluster_prefix: str,
        on_change: Callable[[str, EngineRecord | None], None] | None = None,
    ) -> None:
        self.etcd = etcd
        self.prefix = engines_prefix(cluster_prefix)
        self.on_change = on_change
        self._lock = threading.Lock()
        self._engines: dict[str, EngineRecord] = {}
        self._stop = threading.Event()
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrail-engine-directory", daemon=True)
        self._thread.start()

    def engines(self) -> list[EngineRecord]:
        with self._lock:
            return sorted(self._engines.values(), key=lambda r: r.engine)

    def _set(self, key: str, value: str | None) -> None:
        name = key[len(self.prefix):]
        record = None
        if value is not None:
            try:
                record = EngineRecord.parse(key, value, self.prefix)
            except ValueError as e:
                log.warning("kvrail: ignoring engine record: %s", e)
        with self._lock:
            old = self._engines.pop(name, None)
            if record is not None:
                self._engines[name] = record
        if old != record and self.on_change is not None:
            if record is None:
                log.info("kvrail: engine %s left", name)
            self.on_change(name, record)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                revision, kvs = self.etcd.get_prefix(self.prefix)
                with self._lock:
                    gone = [n for n in self._engines if self.prefix + n not in kvs]
                for name in gone:
                    self._set(self.prefix + name, None)
                for key, value in kvs.items():
                    self._set(key, value)
                self.synced.set()
                for ev in self.etcd.watch_prefix(self.prefix, revision, timeout=None):
                    if self._stop.is_set():
                        return
                    self._set(ev.key, ev.value)
            except EtcdError as e:
                if self._stop.is_set():
                    return
                log.warning("kvrail: following engines in etcd: %s", e)
                self._stop.wait(RETRY_S)

    def close(self) -> None:
        self._stop.set()


def wait_for(directory: EngineDirectory, done: Callable[[list[EngineRecord]], bool], timeout: float) -> bool:
    """Whether ``done(engines)`` held within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(directory.engines()):
            return True
        time.sleep(0.05)
    return done(directory.engines())
