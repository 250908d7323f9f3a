"""Real vLLM engines found through a real etcd: one prefill and two decode
engines (the CPU backend, the tiny model), each registered in etcd by kvrail's
connector; the router follows etcd and spreads 20 requests round robin, then
least-loaded. Every output must equal the prefill engine's own greedy output,
with the KV moved through kvrail. A decode engine stopped mid-run is dropped
from the router, and the requests it held are answered by the other one or
fail with an error naming what happened.

Run by tests/vllm_disaggregated.rs after test_vllm.py (skipped where vLLM is
not installed, unless ``KVRAIL_VLLM_REQUIRED`` is set).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import EtcdServer, Pair
from test_vllm import START_TIMEOUT_S, Disaggregated, Engine, _metric, long_prompt, patient_sidecars
import tiny_model

from kvrail.engines import EngineDirectory, wait_for
from kvrail.etcd import Etcd
from kvrail.routing import Pools
from kvrail.vllm_router import Router, follow_etcd

PREFIX = "/kvrail/vllm-cluster"
TIMEOUT_S = 30
REQUESTS = 20


class Cluster:
    def __init__(self, etcd: Etcd, pair: Pair, prefill: Engine, decodes: list[Engine], model: Path) -> None:
        self.etcd, self.pair, self.prefill, self.decodes = etcd, pair, prefill, decodes
        # For its helpers (complete, reference): the prefill engine is the reference.
        self.view = Disaggregated(pair, prefill, decodes[0], model, "pull")

    def router(self, policy: str) -> tuple[Router, EngineDirectory, str]:
        pools = Pools(policy)
        directory = EngineDirectory(self.etcd, PREFIX)
        follow_etcd(directory, pools, "pull")
        router = Router(("127.0.0.1", 0), [], [], 120.0, pools=pools, push=False)
        threading.Thread(target=router.serve_forever, daemon=True).start()
        return router, directory, f"http://127.0.0.1:{router.server_address[1]}"

    def served(self) -> list[float]:
        """Requests each decode engine finished (vLLM's own counter)."""
        return [metric_sum(d.url, "vllm:request_success_total") if d.proc.poll() is None else -1 for d in self.decodes]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    dir = tmp_path_factory.mktemp("vllm-cluster")
    model = tiny_model.build(Path(os.environ.get("KVRAIL_TINY_MODEL", dir / "model")))
    server = EtcdServer(dir)
    etcd = Etcd(server.url)
    pair = Pair(dir, *patient_sidecars(dir, TIMEOUT_S), metrics=True)
    engines: list[Engine] = []
    try:
        registered = {"etcd": server.url, "etcd_prefix": PREFIX, "etcd_lease_ttl_s": 3}
        # Three engines on this machine's cores: the kernel places their
        # threads (pinned, one rank's threads starve another's).
        common = dict(timeout_s=TIMEOUT_S, extra_config=registered, pin_cores=False)
        engines = [
            Engine(dir, model, "prefill", pair.prefill.socket, 0, "pull", **common),
            Engine(dir, model, "decode", pair.decode.socket, 1, "pull", name="decode-a", **common),
            Engine(dir, model, "decode", pair.decode.socket, 0, "pull", name="decode-b", **common),
        ]
        deadline = time.monotonic() + START_TIMEOUT_S
        for e in engines:
            e.wait_ready(deadline)
        for e in engines:
            e.warm_up(model)
        yield Cluster(etcd, pair, engines[0], engines[1:], model)
    finally:
        for e in engines:
            e.stop()
        pair.stop()
        server.stop()


def metric_sum(base: str, name: str) -> float:
    """A metric's samples summed over their labels (finish reasons...)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def ask(base: str, cluster: Cluster, prompt: str) -> tuple[str, Any]:
    """("ok", text) or ("error", (HTTP status, body))."""
    try:
        return "ok", cluster.view.complete(base, prompt)["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        return "error", (e.code, e.read().decode(errors="replace")[:500])


def test_three_engines_register_and_the_router_spreads_requests_both_ways(cluster: Cluster) -> None:
    for policy in ("round_robin", "least_loaded"):
        router, directory, base = cluster.router(policy)
        try:
            assert wait_for(directory, lambda es: len(es) == 3, 30), directory.engines()
            roles = sorted((e.engine, e.role, e.kvrail_node) for e in directory.engines())
            assert roles == [
                ("vllm-decode-a", "decode", "decode"),
                ("vllm-decode-b", "decode", "decode"),
                ("vllm-prefill", "prefill", "prefill"),
            ]
            prompts = [long_prompt(f"{policy} {i}", 8 + i % 5) for i in range(REQUESTS)]
            refs = {p: cluster.view.reference(p) for p in prompts}
            served = cluster.served()
            moved = cluster.pair.decode.metric("kvrail_bytes_received_total")
            with ThreadPoolExecutor(4) as pool:
                outcomes = list(pool.map(lambda p: ask(base, cluster, p), prompts))
            for prompt, (kind, got) in zip(prompts, outcomes):
                assert (kind, got) == ("ok", refs[prompt]), prompt[:60]
            per_engine = [after - before for before, after in zip(served, cluster.served())]
            print(f"{policy}: requests per decode engine {per_engine}")
            assert sum(per_engine) == REQUESTS
            if policy == "round_robin":
                assert per_engine == [REQUESTS / 2, REQUESTS / 2]
            else:
                assert min(per_engine) >= 1, per_engine
            assert cluster.pair.decode.metric("kvrail_bytes_received_total") > moved, "no KV moved through kvrail"
        finally:
            router.shutdown()
            router.server_close()
            directory.close()


def test_a_decode_engine_stopped_mid_run_is_dropped(cluster: Cluster) -> None:
    router, directory, base = cluster.router("round_robin")
    try:
        assert wait_for(directory, lambda es: len(es) == 3, 30)
        stopped = cluster.decodes[1]
        prompts = [long_prompt(f"stop {i}", 10 + i % 4) for i in range(8)]
        refs = {p: cluster.view.reference(p) for p in prompts}
        before = cluster.served()
        with ThreadPoolExecutor(8) as pool:
            results = [pool.submit(ask, base, cluster, p) for p in prompts]
            # Stopped while it holds requests (vLLM's gauges, or what it finished).
            deadline = time.monotonic() + 60
            while not (
                _metric(stopped.url, "vllm:num_requests_running")
                or _metric(stopped.url, "vllm:num_requests_waiting")
                or cluster.served()[1] > before[1]
            ):
                assert time.monotonic() < deadline, "the stopped engine never got a request"
                time.sleep(0.02)
            stopped.stop()
            outcomes = [f.result() for f in results]
        print(f"decode-b stopped: {[o[0] for o in outcomes]}")
        for prompt, (kind, got) in zip(prompts, outcomes):
            if kind == "ok":
                assert got == refs[prompt], "a request answered after the stop gave a wrong output"
            else:
                status, body = got
                assert status == 502 and "decode" in body, got
        # Its record goes (deleted at exit, or its 3 s lease runs out) and the
        # router stops picking it: the next requests all reach decode-a.
        assert wait_for(directory, lambda es: "vllm-decode-b" not in [e.engine for e in es], 15)
        served = cluster.served()[0]
        for i in range(4):
            prompt = long_prompt(f"after the stop {i}", 9)
            assert ask(base, cluster, prompt) == ("ok", cluster.view.reference(prompt))
        assert cluster.served()[0] - served == 4
    finally:
        router.shutdown()
        router.server_close()
        directory.close()
