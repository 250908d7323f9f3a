"""Real vLLM: a prefill and a decode engine (OpenAI API servers in their own
processes, the CPU backend), each beside its own `kvrail serve`, kvrail's
connector loaded by vLLM through ``kv_connector_module_path``. Every
disaggregated output must equal the prefill engine's own greedy output.

Skipped where vLLM is not installed, unless ``KVRAIL_VLLM_REQUIRED`` is set
(tests/vllm_disaggregated.rs sets it after installing vLLM into a venv).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Pair, free_port

if os.environ.get("KVRAIL_VLLM_REQUIRED"):
    import vllm  # noqa: F401  (an ImportError fails the run)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (tests/vllm_disaggregated.rs installs it)")

import tiny_model

MAX_TOKENS = 12
#: Seconds an engine may take to start (about 60-80 s for both on 2 cores).
START_TIMEOUT_S = float(os.environ.get("KVRAIL_VLLM_START_TIMEOUT", "600"))


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name} at {base}")


class Engine:
    """One vLLM OpenAI API server with kvrail's connector."""

    def __init__(self, dir: Path, model: Path, role: str, socket: Path, core: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = dir / f"vllm-{role}.log"
        kv_config = {
            "kv_connector": "KvrailConnector",
            "kv_connector_module_path": "kvrail.connector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"socket": str(socket), "timeout_s": 60},
        }
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(core % (os.cpu_count() or 1)),
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
        )
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--enforce-eager",
            "--max-model-len", "2048",
            "--max-num-seqs", "8",
            "--kv-transfer-config", json.dumps(kv_config),
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start in {START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Disaggregated:
    def __init__(self, pair: Pair, prefill: Engine, decode: Engine, model: Path) -> None:
        self.pair, self.prefill, self.decode, self.model = pair, prefill, decode, str(model)

    def complete(self, base: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return _post(f"{base}/v1/completions", body)

    def reference(self, prompt: str) -> str:
        """The prefill engine's own output: no transfer involved."""
        return self.complete(self.prefill.url, prompt)["choices"][0]["text"]

    def prefill_params(self, prompt: str) -> dict[str, Any]:
        r = self.complete(self.prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
        params = r.get("kv_transfer_params")
        assert params and params["remote_block_ids"], f"prefill returned no kv_transfer_params: {r}"
        return params

    def disaggregated(self, prompt: str) -> str:
        params = self.prefill_params(prompt)
        return self.complete(self.decode.url, prompt, kv_transfer_params=params)["choices"][0]["text"]

    def decode_received_bytes(self) -> float:
        return self.pair.decode.metric("kvrail_bytes_received_total")


@pytest.fixture(scope="module")
def vllm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disaggregated]:
    dir = tmp_path_factory.mktemp("vllm")
    model = tiny_model.build(Path(os.environ.get("KVRAIL_TINY_MODEL", dir / "model")))
    pair = Pair(dir, metrics=True)
    engines: list[Engine] = []
    try:
        engines = [
            Engine(dir, model, "prefill", pair.prefill.socket, 0),
            Engine(dir, model, "decode", pair.decode.socket, 1),
        ]
        deadline = time.monotonic() + START_TIMEOUT_S
        for e in engines:
            e.wait_ready(deadline)
        yield Disaggregated(pair, engines[0], engines[1], model)
    finally:
        for e in engines:
            e.stop()
        pair.stop()
        # The adopted KV-cache files are unlinked once both sides mapped them.
        left = list(Path("/dev/shm").glob(f"kvrail-adopted-{os.getpid()}-*"))
        assert not left, left


SENTENCE = "Every block of every layer crosses the network before the first token."


def long_prompt(tag: str, sentences: int = 40) -> str:
    """About 14 tokens a sentence: 40 make ~560 tokens, five 128-token blocks."""
    return " ".join(f"{SENTENCE} {tag} {i}." for i in range(sentences))


def test_short_and_long_prompts_match_the_single_engine(vllm_pair: Disaggregated) -> None:
    before = vllm_pair.decode_received_bytes()
    for prompt in ["The quick brown fox", long_prompt("long")]:
        assert vllm_pair.disaggregated(prompt) == vllm_pair.reference(prompt), prompt[:60]
    assert vllm_pair.decode_received_bytes() > before, "no KV bytes reached the decode sidecar"


def test_the_decode_uses_the_transferred_blocks(vllm_pair: Disaggregated) -> None:
    # Decoding prompt A from prompt B's blocks must not give A's continuation:
    # the output comes from the bytes kvrail moved, not from a local recompute.
    a, b = long_prompt("alpha", 20), long_prompt("omega", 20)
    ref_a, ref_b = vllm_pair.reference(a), vllm_pair.reference(b)
    assert ref_a != ref_b, "the two prompts' outputs must differ for this check"
    pa, pb = vllm_pair.prefill_params(a), vllm_pair.prefill_params(b)
    assert len(pa["remote_block_ids"]) == len(pb["remote_block_ids"])
    swapped = dict(pa, remote_block_ids=pb["remote_block_ids"])
    got = vllm_pair.complete(vllm_pair.decode.url, a, kv_transfer_params=swapped)["choices"][0]["text"]
    assert got != ref_a
    # (The decode engine now caches B's bytes under A's prefix hashes: no later
    # test uses these prompts.) B's own hand-off reads B's blocks, so the
    # prefill engine frees them.
    assert vllm_pair.complete(vllm_pair.decode.url, b, kv_transfer_params=pb)["choices"][0]["text"] == ref_b


def test_a_prompt_sharing_a_prefix_pulls_only_what_the_decode_lacks(vllm_pair: Disaggregated) -> None:
    first = long_prompt("shared", 30)
    before = vllm_pair.decode_received_bytes()
    params = vllm_pair.prefill_params(first)
    out = vllm_pair.complete(vllm_pair.decode.url, first, kv_transfer_params=params)["choices"][0]["text"]
    assert out == vllm_pair.reference(first)
    per_block = (vllm_pair.decode_received_bytes() - before) / len(params["remote_block_ids"])
    longer = first + " And then a tail that only the second prompt has, 1 2 3."
    before = vllm_pair.decode_received_bytes()
    params = vllm_pair.prefill_params(longer)
    out = vllm_pair.complete(vllm_pair.decode.url, longer, kv_transfer_params=params)["choices"][0]["text"]
    assert out == vllm_pair.reference(longer)
    moved = vllm_pair.decode_received_bytes() - before
    # The decode engine's prefix cache holds the shared full blocks: only the
    # blocks it lacks cross again.
    assert 0 < moved < per_block * len(params["remote_block_ids"]), (moved, per_block, params["remote_block_ids"])
    # The prefill engine frees the blocks once the decode's pulls were served,
    # long before its 60 s send timeout, although fewer blocks were read.
    deadline = time.monotonic() + 20
    while _metric(vllm_pair.prefill.url, "vllm:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the prefill engine kept the served blocks"
        time.sleep(0.2)


def test_a_concurrent_batch_matches(vllm_pair: Disaggregated) -> None:
    prompts = [long_prompt(f"batch {i} {'x' * i}", 8 + 3 * i) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(vllm_pair.disaggregated, prompts))
    for prompt, text in zip(prompts, got):
        assert text == vllm_pair.reference(prompt), prompt[:60]


def test_an_aborted_transfer_is_cancelled_and_frees_its_blocks(vllm_pair: Disaggregated) -> None:
    prompt = long_prompt("abort", 20)
    params = vllm_pair.prefill_params(prompt)
    sidecar = vllm_pair.pair.prefill.proc
    assert sidecar is not None
    # The prefill sidecar stops answering: the decode's pull hangs mid-transfer
    # until the client gives up, which aborts the request inside vLLM.
    sidecar.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
            body = {"model": vllm_pair.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            _post(f"{vllm_pair.decode.url}/v1/completions", dict(body, kv_transfer_params=params), timeout=3)
        # The connector cancels the pull (its notification says so) and vLLM
        # frees the request's blocks: nothing stays running or allocated.
        deadline = time.monotonic() + 60
        while "cancelled by the worker" not in vllm_pair.decode.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the decode connector never reported the cancelled pull"
            time.sleep(0.2)
    finally:
        sidecar.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _metric(vllm_pair.decode.url, "vllm:num_requests_running") or _metric(
        vllm_pair.decode.url, "vllm:kv_cache_usage_perc"
    ):
        assert time.monotonic() < deadline, "the aborted request's blocks were never freed"
        time.sleep(0.2)
    # The decode engine goes on serving, and the next hand-off works.
    again = long_prompt("after the abort", 10)
    assert vllm_pair.disaggregated(again) == vllm_pair.reference(again)


def test_the_router_hands_a_request_from_prefill_to_decode(vllm_pair: Disaggregated) -> None:
    from kvrail.vllm_router import Router

    router = Router(("127.0.0.1", 0), vllm_pair.prefill.url, vllm_pair.decode.url, 120.0)
    thread = threading.Thread(target=router.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{router.server_address[1]}"
        prompt = long_prompt("routed", 12)
        before = vllm_pair.decode_received_bytes()
        got = vllm_pair.complete(base, prompt)["choices"][0]["text"]
        assert got == vllm_pair.reference(prompt)
        assert vllm_pair.decode_received_bytes() > before
        with pytest.raises(urllib.error.HTTPError) as bad:
            _post(f"{base}/v1/completions", {"model": "no-such-model", "prompt": "x"})
        assert bad.value.code in (400, 404)
    finally:
        router.shutdown()
        router.server_close()
