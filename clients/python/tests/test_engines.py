"""Engines found through a real etcd (Debian's etcd-server, started here on
loopback), and the router over many of them: registration, leaving (deleted
at exit, or the lease running out after kill -9), round robin and
least-loaded picks, an engine that leaves no longer picked. The engines are
small HTTP servers answering as vLLM's API servers do; test_vllm.py runs the
router over real vLLM engines."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import EtcdServer
from kvrail.engines import EngineDirectory, EngineRecord, EngineRegistration, engines_prefix, wait_for
from kvrail.etcd import Etcd, EtcdError
from kvrail.routing import Engine, NoEngine, Pools, estimate_tokens
from kvrail.vllm_router import Router, follow_etcd

PREFIX = "/kvrail/test"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = EtcdServer(tmp_path)
    try:
        yield Etcd(server.url)
    finally:
        server.stop()


class FakeEngine(ThreadingHTTPServer):
    """Answers /v1/completions as a vLLM API server with kvrail's connector
    would: a prefill engine with kv_transfer_params naming itself, a decode
    engine with its own name as the text. ``hold`` keeps decode calls open
    until set."""

    daemon_threads = True

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.calls: list[dict[str, Any]] = []
        self.hold = threading.Event()
        self.hold.set()
        #: Decode: cut every call without answering (an engine dying mid-request).
        self.broken = False
        #: Decode: answer every call as aborted (an engine shutting down).
        self.aborting = False
        self.entered = threading.Semaphore(0)
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, mode: str = "pull") -> EngineRecord:
        return EngineRecord(self.name, self.role, self.url, f"node-{self.name}", f"vllm-{self.name}", mode)

    def close(self) -> None:
        self.hold.set()
        self.shutdown()
        self.server_close()


class _EngineHandler(BaseHTTPRequestHandler):
    server: FakeEngine
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        e = self.server
        e.calls.append(body)
        if e.role == "prefill":
            reply = {
                "choices": [{"text": "x"}],
                "usage": {"prompt_tokens": len(body["prompt"]) // 4 + 1},
                "kv_transfer_params": {"do_remote_prefill": True, "remote_node": e.name},
            }
        else:
            if e.broken:
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if e.aborting:
                # What vLLM answers for the requests it holds as it shuts down.
                data = json.dumps({"choices": [{"text": "", "finish_reason": "abort"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            e.entered.release()
            e.hold.wait(30)
            reply = {"choices": [{"text": e.name}], "from": body.get("kv_transfer_params")}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def complete(router: Router, prompt: str) -> dict[str, Any]:
    c = http.client.HTTPConnection("127.0.0.1", router.server_address[1], timeout=30)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    assert r.status == 200, (r.status, data)
    # The router relays the decode's reply chunked; http.client undoes that.
    return json.loads(data)


@pytest.fixture
def cluster(etcd: Etcd) -> Iterator[tuple[Etcd, list[FakeEngine], list[EngineRegistration]]]:
    engines = [FakeEngine(f"p{i}", "prefill") for i in range(2)] + [FakeEngine(f"d{i}", "decode") for i in range(3)]
    regs = [EngineRegistration(etcd, PREFIX, e.record(), ttl_s=10) for e in engines]
    try:
        yield etcd, engines, regs
    finally:
        for r in regs:
            r.close()
        for e in engines:
            e.close()


@contextmanager
def routing(etcd: Etcd, policy: str) -> Iterator[tuple[Router, EngineDirectory]]:
    """A router following the engines in etcd, stopped on the way out."""
    pools = Pools(policy)
    directory = EngineDirectory(etcd, PREFIX)
    follow_etcd(directory, pools, "pull")
    router = Router(("127.0.0.1", 0), [], [], 30.0, pools=pools, push=False)
    threading.Thread(target=router.serve_forever, daemon=True).start()
    try:
        yield router, directory
    finally:
        router.shutdown()
        router.server_close()
        directory.close()


def test_pools_pick_in_turn_or_by_least_queued_tokens() -> None:
    pools = Pools("round_robin")
    engines = [Engine(f"http://e{i}", name=f"e{i}") for i in range(3)]
    pools.set_engines("decode", engines)
    assert [pools.pick("decode", 1).name for _ in range(6)] == ["e0", "e1", "e2", "e0", "e1", "e2"]
    with pytest.raises(NoEngine, match="no prefill engine"):
        pools.pick("prefill", 1)

    pools = Pools("least_loaded")
    pools.set_engines("decode", engines)
    big = pools.pick("decode", 1000)
    assert big.name == "e0"
    # e0 holds 1000 tokens: the next ones go to e1 and e2, and on by load.
    assert [pools.pick("decode", 10).name for _ in range(4)] == ["e1", "e2", "e1", "e2"]
    pools.release("decode", big, 1000)
    assert pools.pick("decode", 10).name == "e0"
    assert pools.queued("decode") == {"http://e0": 10, "http://e1": 20, "http://e2": 20}
    # One leaves: never picked again, though it was the least loaded.
    pools.set_engines("decode", engines[1:])
    assert {pools.pick("decode", 1).name for _ in range(4)} == {"e1", "e2"}
    with pytest.raises(ValueError):
        Pools("random")


def test_token_estimates() -> None:
    assert estimate_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_tokens({"prompt": "a" * 400}) == 101
    assert estimate_tokens({"messages": [{"role": "user", "content": "b" * 40}]}) == 11
    assert estimate_tokens({"prompt": {"odd": 1}}) == 1


def test_records_are_checked() -> None:
    prefix = engines_prefix(PREFIX)
    good = EngineRecord("e", "decode", "http://h:1", "n", "w", "pull")
    assert EngineRecord.parse(prefix + "e", good.to_json(), prefix) == good
    for text, why in [
        ("{", "Expecting"),
        ('{"format": 2}', "format 1"),
        (good.to_json().replace('"decode"', '"router"'), "role"),
        (good.to_json().replace('"pull"', '"poll"'), "mode"),
        (good.to_json().replace("http://h:1", "file:///etc/passwd"), "url"),
        (good.to_json().replace('"w"', "7"), "worker"),
        ("x" * 5000, "bytes"),
    ]:
        with pytest.raises(ValueError, match=why):
            EngineRecord.parse(prefix + "e", text, prefix)
    with pytest.raises(ValueError, match="not its key"):
        EngineRecord.parse(prefix + "other", good.to_json(), prefix)


def test_engines_join_and_leave_through_etcd(etcd: Etcd, tmp_path: Path) -> None:
    directory = EngineDirectory(etcd, PREFIX)
    assert directory.synced.wait(10)
    a = EngineRegistration(etcd, PREFIX, EngineRecord("a", "prefill", "http://h:1", "n1", "w1", "pull"), ttl_s=10)
    b = EngineRegistration(etcd, PREFIX, EngineRecord("b", "decode", "http://h:2", "n2", "w2", "pull"), ttl_s=10)
    assert wait_for(directory, lambda es: [e.engine for e in es] == ["a", "b"], 10)
    # A record that is not an engine's is ignored, not fatal.
    etcd.put(engines_prefix(PREFIX) + "junk", "not json")
    b.close()  # an engine that exits deletes its record at once
    assert wait_for(directory, lambda es: [e.engine for e in es] == ["a"], 5)
    # An engine killed (-9) leaves when its lease runs out.
    script = (
        "import sys, time\n"
        "from kvrail.engines import EngineRecord, EngineRegistration\n"
        "from kvrail.etcd import Etcd\n"
        "r = EngineRegistration(Etcd(sys.argv[1]), sys.argv[2], EngineRecord('k', 'decode', 'http://h:3', 'n', 'w', 'pull'), ttl_s=2)\n"
        "while r.lease is None: time.sleep(0.01)\n"
        "print('registered', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, etcd.endpoints[0], PREFIX], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        assert wait_for(directory, lambda es: "k" in [e.engine for e in es], 5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        assert wait_for(directory, lambda es: "k" not in [e.engine for e in es], 10)
        # Not before the 2 s lease could run out (renewed every 2/3 s).
        assert time.monotonic() - killed > 1.0
    finally:
        proc.kill()
    a.close()
    directory.close()


def test_an_engine_cut_off_from_etcd_registers_again(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path)
    etcd = Etcd(server.url)
    reg = EngineRegistration(etcd, PREFIX, EngineRecord("a", "prefill", "http://h:1", "n", "w", "pull"), ttl_s=2)
    try:
        deadline = time.monotonic() + 10
        while reg.lease is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The engine's record deleted behind its back (an operator, a
        # compaction of a lost lease): written again with a new lease.
        etcd.revoke(reg.lease)
        deadline = time.monotonic() + 10
        while engines_prefix(PREFIX) + "a" not in etcd.get_prefix(PREFIX)[1]:
            assert time.monotonic() < deadline, "the record was not written again"
            time.sleep(0.05)
    finally:
        reg.close()
        server.stop()
    with pytest.raises(EtcdError, match="no etcd endpoint answered"):
        etcd.get_prefix(PREFIX)


def test_the_router_spreads_requests_over_engines_from_etcd(cluster) -> None:
    etcd, engines, regs = cluster
    with routing(etcd, "round_robin") as (router, directory):
        assert wait_for(directory, lambda es: len(es) == 5, 10)
        served = [complete(router, f"prompt {i}")["choices"][0]["text"] for i in range(6)]
        assert sorted(served) == ["d0", "d0", "d1", "d1", "d2", "d2"]
        assert [len(e.calls) for e in engines[:2]] == [3, 3]
        # Each decode got the kv_transfer_params of the prefill that ran its prompt.
        for d in engines[2:]:
            assert all(c["kv_transfer_params"]["remote_node"] in ("p0", "p1") for c in d.calls)
        # d2 leaves (its engine exits): the next requests go to d0 and d1 only.
        regs[4].close()
        assert wait_for(directory, lambda es: "d2" not in [e.engine for e in es], 5)
        served = [complete(router, f"after {i}")["choices"][0]["text"] for i in range(4)]
        assert sorted(served) == ["d0", "d0", "d1", "d1"]
        # No decode engine at all: 503 naming why, not a hang.
        for r in regs[2:4]:
            r.close()
        assert wait_for(directory, lambda es: all(e.role == "prefill" for e in es), 5)
        c = http.client.HTTPConnection("127.0.0.1", router.server_address[1], timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
        r = c.getresponse()
        assert r.status == 503 and "no decode engine" in json.loads(r.read())["error"]


def test_least_loaded_routes_around_an_engine_busy_with_a_long_prompt(cluster) -> None:
    etcd, engines, _ = cluster
    d0 = engines[2]
    with routing(etcd, "least_loaded") as (router, directory):
        assert wait_for(directory, lambda es: len(es) == 5, 10)
        d0.hold.clear()  # d0 keeps what it gets
        long = threading.Thread(target=complete, args=(router, "L" * 40_000), daemon=True)
        long.start()
        assert d0.entered.acquire(timeout=10), "the long prompt should go to d0 first"
        queued = router.pools.queued("decode")
        assert queued[d0.url] > 10_000 and queued[engines[3].url] == 0
        # While d0 holds 10,000 tokens, short prompts go to d1 and d2.
        served = [complete(router, f"short {i}")["choices"][0]["text"] for i in range(6)]
        assert sorted(served) == ["d1", "d1", "d1", "d2", "d2", "d2"]
        d0.hold.set()
        long.join(30)
        # Released once the router has relayed the reply (just after the client has it).
        deadline = time.monotonic() + 10
        while router.pools.queued("decode") != {e.url: 0 for e in engines[2:]}:
            assert time.monotonic() < deadline, router.pools.queued("decode")
            time.sleep(0.01)


def test_a_decode_engine_that_fails_mid_request_hands_it_to_another(cluster) -> None:
    etcd, engines, _ = cluster
    with routing(etcd, "round_robin") as (router, directory):
        assert wait_for(directory, lambda es: len(es) == 5, 10)
        engines[2].broken = True  # d0 takes requests and dies on each
        served = [complete(router, f"p {i}")["choices"][0]["text"] for i in range(6)]
        assert "d0" not in served and len(served) == 6
        assert len(engines[2].calls) >= 1
        for e in engines[2:]:
            e.broken = True
        c = http.client.HTTPConnection("127.0.0.1", router.server_address[1], timeout=30)
        c.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
        r = c.getresponse()
        error = json.loads(r.read())["error"]
        # Every decode engine tried once, each named with what it did.
        assert r.status == 502 and error.count("unreachable or cut") == 3, error


def test_engines_and_the_router_over_tls_etcd(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path, tls=True)
    files = server.client_files()
    try:
        etcd = Etcd(server.url, **files)
        engines = [FakeEngine("p0", "prefill"), FakeEngine("d0", "decode")]
        regs = [EngineRegistration(etcd, PREFIX, e.record(), ttl_s=10) for e in engines]
        try:
            with routing(etcd, "round_robin") as (router, directory):
                assert wait_for(directory, lambda es: len(es) == 2, 10)
                assert complete(router, "over tls")["choices"][0]["text"] == "d0"
        finally:
            for r in regs:
                r.close()
            for e in engines:
                e.close()
        # Without a client certificate etcd refuses; without its CA, the
        # client refuses etcd; plain http to a TLS etcd gets nowhere.
        with pytest.raises(EtcdError, match="no etcd endpoint answered"):
            Etcd(server.url, ca=files["ca"]).get_prefix(PREFIX)
        with pytest.raises(EtcdError, match="need etcd's CA"):
            Etcd(server.url)
        with pytest.raises(EtcdError, match="no etcd endpoint answered"):
            Etcd(server.url.replace("https", "http")).get_prefix(PREFIX)
        with pytest.raises(EtcdError, match="needs its key"):
            Etcd(server.url, ca=files["ca"], cert=files["cert"])
    finally:
        server.stop()


def test_a_decode_engine_that_aborts_as_it_shuts_down_hands_the_request_over(cluster) -> None:
    etcd, engines, _ = cluster
    with routing(etcd, "round_robin") as (router, directory):
        assert wait_for(directory, lambda es: len(es) == 5, 10)
        engines[2].aborting = True  # d0 answers 200 with finish_reason "abort"
        served = [complete(router, f"p {i}")["choices"][0]["text"] for i in range(6)]
        assert "" not in served and "d0" not in served and len(served) == 6
        assert len(engines[2].calls) >= 1
