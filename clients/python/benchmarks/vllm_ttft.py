"""Time to first token of real vLLM engines, disaggregated through kvrail
(pull and push) against the same engine serving the request alone, and the
time the connector's per-step calls take inside the engine's loop.

Starts two `kvrail serve` sidecars and two vLLM OpenAI servers (CPU backend,
the tiny model of tests/tiny_model.py) per mode; prints one JSON document::

    python clients/python/benchmarks/vllm_ttft.py --kvrail target/release/kvrail \\
        --model target/vllm-tiny-model --modes pull,push --repeats 7

Every request uses a fresh prompt (no prefix-cache hits). ``single`` is the
prefill engine answering with one token (prefill + first token, no transfer);
``disaggregated`` is what a router sees: pull: prefill call, then the decode
call with its ``kv_transfer_params``; push: both at once (the TTFT is the
later of the two).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import tiny_model  # noqa: E402

from kvrail.vllm_router import prefill_request, push_requests  # noqa: E402

SENTENCE = "Every block of every layer crosses the network before the first token."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: {e.code} {e.read().decode(errors='replace')[:500]}") from None


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up in {timeout} s")
        time.sleep(0.3)


class Stack:
    """Two sidecars and two engines in one mode."""

    def __init__(self, dir: Path, kvrail: Path, model: Path, mode: str) -> None:
        self.dir, self.mode, self.model = dir, mode, str(model)
        self.procs: list[subprocess.Popen[bytes]] = []
        pp, dp = free_port(), free_port()
        for node, port, peer, peer_port in (("prefill", pp, "decode", dp), ("decode", dp, "prefill", pp)):
            sock = dir / f"{node}.sock"
            log = open(dir / f"{node}-sidecar.log", "wb")
            self.procs.append(
                subprocess.Popen(
                    [str(kvrail), "serve", "--node", node, "--socket", str(sock), "--listen", f"127.0.0.1:{port}",
                     "--peer", f"{peer}=127.0.0.1:{peer_port}", "--insecure"],
                    stdout=subprocess.DEVNULL, stderr=log,
                )
            )  # fmt: skip
        self.urls: dict[str, str] = {}
        for core, role in enumerate(("prefill", "decode")):
            port = free_port()
            cfg = {
                "kv_connector": "KvrailConnector",
                "kv_connector_module_path": "kvrail.connector",
                "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": {
                    "socket": str(dir / f"{role}.sock"),
                    "mode": mode,
                    "worker_id": f"vllm-{role}",
                    "stats_path": str(dir / f"{role}-stats.json"),
                },
            }
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(core % (os.cpu_count() or 1)))
            log_path = dir / f"{role}-vllm.log"
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                     "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "2048",
                     "--kv-transfer-config", json.dumps(cfg)],
                    stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )
            )  # fmt: skip
            self.urls[role] = f"http://127.0.0.1:{port}"
        for role, proc in zip(("prefill", "decode"), self.procs[2:]):
            wait_http(self.urls[role] + "/health", proc, dir / f"{role}-vllm.log", 600)

    def body(self, prompt: str) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}

    def single(self, prompt: str) -> float:
        t = time.perf_counter()
        post(self.urls["prefill"] + "/v1/completions", self.body(prompt))
        return time.perf_counter() - t

    def disaggregated(self, prompt: str) -> float:
        t = time.perf_counter()
        if self.mode == "pull":
            params = post(self.urls["prefill"] + "/v1/completions", prefill_request(self.body(prompt)))[
                "kv_transfer_params"
            ]
            post(self.urls["decode"] + "/v1/completions", dict(self.body(prompt), kv_transfer_params=params))
        else:
            pre, dec = push_requests(self.body(prompt), "prefill", "vllm-prefill")
            with ThreadPoolExecutor(1) as pool:
                done = pool.submit(post, self.urls["prefill"] + "/v1/completions", pre)
                post(self.urls["decode"] + "/v1/completions", dec)
                done.result()
        return time.perf_counter() - t

    def connector_stats(self) -> dict[str, Any]:
        time.sleep(1.5)  # the workers write their figures at most once a second
        for role in ("prefill", "decode"):  # one more step each, to flush
            post(self.urls[role] + "/v1/completions", self.body(f"flush {time.time()}"))
        out = {}
        for role in ("prefill", "decode"):
            path = self.dir / f"{role}-stats.json.worker"
            out[role] = json.loads(path.read_text())["calls"] if path.exists() else None
        return out

    def stop(self) -> None:
        for p in self.procs[2:]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs[:2]:
            p.kill()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(xs) * 1e3, 2),
        "min_ms": round(min(xs) * 1e3, 2),
        "max_ms": round(max(xs) * 1e3, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvrail", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True, help="built here if missing")
    p.add_argument("--modes", default="pull,push")
    p.add_argument("--sentences", default="6,24,72", help="prompt lengths in sentences (~20 tokens each)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    model = tiny_model.build(args.model)
    result: dict[str, Any] = {"model": "tiny llama (2 layers, 2 KV heads, head 32, bf16, block 128)", "modes": {}}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"kvrail-ttft-{mode}-") as d:
            stack = Stack(Path(d), args.kvrail, model, mode)
            try:
                points = []
                for n in (int(x) for x in args.sentences.split(",")):
                    # Warm-up of this length on both paths, then fresh prompts.
                    # Each prompt starts with its own tag: no prefix-cache hits
                    # between runs, or between the two paths.
                    def prompt(tag: str) -> str:
                        return f"{tag}: " + " ".join(f"{SENTENCE} {i}" for i in range(n))

                    stack.single(prompt(f"warm single {n}"))
                    stack.disaggregated(prompt(f"warm disaggregated {n}"))
                    single, disagg = [], []
                    for r in range(args.repeats):
                        single.append(stack.single(prompt(f"single {mode} {n} {r}")))
                        disagg.append(stack.disaggregated(prompt(f"disaggregated {mode} {n} {r}")))
                    tokens = post(
                        stack.urls["prefill"] + "/tokenize", {"model": stack.model, "prompt": prompt(f"single {mode} {n} 0")}
                    )["count"]
                    points.append(
                        {
                            "prompt_tokens": tokens,
                            "single": summary(single),
                            "disaggregated": summary(disagg),
                            "added_p50_ms": round((statistics.median(disagg) - statistics.median(single)) * 1e3, 2),
                        }
                    )
                result["modes"][mode] = {"ttft": points, "connector_calls_us": stack.connector_stats()}
            finally:
                stack.stop()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
