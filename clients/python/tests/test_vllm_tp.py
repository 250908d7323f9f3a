"""Real vLLM with tensor parallelism (the CPU build: one process and one
thread per TP rank): prefill engines at TP 1 and TP 2, decode engines at TP 1 and
TP 2, each TP rank a kvrail worker of its own, pairs in pull mode and in
push mode.
The decode ranks' KV blocks after the hand-off must equal the prefill ranks'
blocks reshaped by hand into each decode rank's heads (read back from the
engines' shared memory), and the decode engine's output must equal its own
output computed without a hand-off (its own TP).

Every engine serves a short and a long plain request before the tests: at
TP > 1 vLLM's vocabulary-parallel embedding masks its input through a
``torch.compile``d helper (``get_masked_input_and_mask``), which each rank
compiles at its first forward passes; on this machine's two busy cores that
took longer than the hand-off timeouts (seen with py-spy: the prefill's rank
1 in dynamo and sympy while rank 0 waited in all-reduce). Six ranks share
two cores, so the engines run below the sidecars and their ranks are not
pinned to cores (see ``ENGINE_NICE`` and ``PIN_CORES``).

vLLM's CPU backend keeps each head's K (packed per ISA) and V contiguous in a
block ("head-opaque" blocks): heads move between ranks, tokens are not re-cut,
so both engines run the same block size.

Skipped where vLLM is not installed, unless ``KVRAIL_VLLM_REQUIRED`` is set.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Pair

if os.environ.get("KVRAIL_VLLM_REQUIRED"):
    import vllm  # noqa: F401  (an ImportError fails the run)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (tests/vllm_disaggregated.rs installs it)")

import tiny_model
from test_vllm import START_TIMEOUT_S, Engine, _post, long_prompt, patient_sidecars

from kvrail.geometry import rank_heads

MAX_TOKENS = 12
#: Four engines, six ranks on 2 cores: the decode waits this long for pushed
#: layers.
TIMEOUT_S = 120


class Engines:
    def __init__(
        self, pair: Pair, prefill: dict[int, Engine], decode: dict[int, Engine], model: Path, mode: str
    ) -> None:
        self.pair, self.prefill, self.decode, self.model = pair, prefill, decode, str(model)
        self.mode = mode

    def log_paths(self) -> list[Path]:
        engines = [*self.prefill.values(), *self.decode.values()]
        return [self.pair.prefill.log_path, self.pair.decode.log_path, *(e.log_path for e in engines)]

    def complete(self, base: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
        return _post(f"{base}/v1/completions", body)

    def hand_off(self, prefill: Engine, decode: Engine, prompt: str) -> tuple[str, list[int]]:
        """The decode engine's output for ``prompt`` with its KV from the
        prefill engine, and the prefill's blocks of the request."""
        if self.mode == "pull":
            r = self.complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
            params = r["kv_transfer_params"]
            assert len(params["remote_ranks"]) == prefill.tp, params
            text = self.complete(decode.url, prompt, kv_transfer_params=params)["choices"][0]["text"]
            return text, list(params["remote_block_ids"])
        from kvrail.vllm_router import push_requests

        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        pre, dec = push_requests(body, self.pair.prefill.node, prefill.worker_id)
        # Both at once, as the router sends them: the prefill's scheduler
        # waits for the decode's grant.
        with ThreadPoolExecutor(1) as pool:
            prefilled = pool.submit(_post, f"{prefill.url}/v1/completions", pre)
            text = _post(f"{decode.url}/v1/completions", dec)["choices"][0]["text"]
            params = prefilled.result()["kv_transfer_params"]
        return text, list(params["pushed_block_ids"])


#: Engines waiting on a transfer step without pause (vLLM's busy loop): below
#: the sidecars, which must still answer within their acknowledgement
#: timeout (a push failed "no acknowledgement for 6979 ms" with both at 0).
ENGINE_NICE = 10
# Six ranks on two cores: pinned ranks could not move off a core another
# engine's waiting worker spun on (vLLM's workers spin for a second after
# each step; seen with py-spy: a TP 2 prefill's rank 0 spinning in the
# all-reduce for over a minute while rank 1, pinned, barely ran), so the
# kernel places them.
PIN_CORES = False

#: Both by default; ``KVRAIL_VLLM_TP_MODES=pull`` (or ``push``) runs one.
MODES = os.environ.get("KVRAIL_VLLM_TP_MODES", "pull,push").split(",")


@pytest.fixture(scope="module", params=MODES)
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    mode = request.param
    dir = tmp_path_factory.mktemp(f"vllm-tp-{mode}")
    model = tiny_model.build(Path(os.environ.get("KVRAIL_TINY_MODEL", dir / "model")))
    pair = Pair(dir, *patient_sidecars(dir, TIMEOUT_S), metrics=True)
    started: list[Engine] = []
    try:
        # The decode engines recompute nothing from a prefix cache: their
        # own output (the reference) is computed in full.
        no_cache = ("--no-enable-prefix-caching",)
        prefill = {
            tp: Engine(
                dir,
                model,
                "prefill",
                pair.prefill.socket,
                0,
                mode,
                tp=tp,
                name=f"prefill-tp{tp}",
                timeout_s=TIMEOUT_S,
                nice=ENGINE_NICE,
                pin_cores=PIN_CORES,
            )
            for tp in (1, 2)
        }
        decode = {
            tp: Engine(
                dir,
                model,
                "decode",
                pair.decode.socket,
                1,
                mode,
                tp=tp,
                extra_args=no_cache,
                name=f"decode-tp{tp}",
                timeout_s=TIMEOUT_S,
                nice=ENGINE_NICE,
                pin_cores=PIN_CORES,
            )
            for tp in (1, 2)
        }
        started = [*prefill.values(), *decode.values()]
        deadline = time.monotonic() + START_TIMEOUT_S
        for e in started:
            e.wait_ready(deadline)
        # Each rank's first forward passes compile (see the module's doc): one
        # engine at a time (all four at once outlasted 120 s in a CI run).
        for e in started:
            e.warm_up(model)
        yield Engines(pair, prefill, decode, model, mode)
    finally:
        for e in started:
            e.stop()
        pair.stop()


def _tables(engine: Engine) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in engine.region_tables]


class RankKv:
    """One rank's KV cache, read from the shared memory its worker published."""

    def __init__(self, table: dict[str, Any]) -> None:
        (memory,) = table["region_memory"]
        self.layout = memory["layout"]
        self.geometry = table["geometry"]
        self.file = open(memory["path"], "rb")
        self.map = mmap.mmap(self.file.fileno(), 0, prot=mmap.PROT_READ)
        assert self.layout["planes_per_layer"] == 1, self.layout

    def block(self, layer: int, block: int) -> bytes:
        lay = self.layout
        at = lay["base_offset"] + layer * lay["layer_stride"] + block * lay["block_stride"]
        return self.map[at : at + lay["block_bytes"]]

    def heads(self, layer: int, block: int) -> dict[int, bytes]:
        """The block's bytes per model head (each head contiguous)."""
        data = self.block(layer, block)
        n = self.geometry["heads"]
        size = len(data) // n
        return {self.geometry["head_start"] + h: data[h * size : (h + 1) * size] for h in range(n)}

    def close(self) -> None:
        self.map.close()
        self.file.close()


def _check_kv(prefill: Engine, decode: Engine, remote_blocks: list[int]) -> int:
    """Each decode rank holds, for every full block of the request, the
    prefill ranks' heads it owns, byte for byte (found among its blocks by
    content: the engine does not say which blocks it gave the request).
    Returns the blocks checked."""
    sources = [RankKv(t) for t in _tables(prefill)]
    dests = [RankKv(t) for t in _tables(decode)]
    try:
        layers = sources[0].layout["num_layers"]
        kv_heads = sources[0].geometry["model_kv_heads"]
        # The last block also holds the decode's generated tokens: full ones only.
        full = remote_blocks[:-1]
        assert full, "the prompt must span more than one block"
        for rank, dest in enumerate(dests):
            want = rank_heads(kv_heads, len(dests), rank)
            index: dict[bytes, list[int]] = {}
            for b in range(dest.layout["num_blocks"]):
                index.setdefault(hashlib.sha1(dest.block(0, b)).digest(), []).append(b)
            for i, pb in enumerate(full):
                expected = []
                for layer in range(layers):
                    by_head: dict[int, bytes] = {}
                    for s in sources:
                        by_head.update(s.heads(layer, pb))
                    expected.append(b"".join(by_head[h] for h in want))
                found = index.get(hashlib.sha1(expected[0]).digest(), [])
                assert any(
                    all(dest.block(layer, b) == expected[layer] for layer in range(layers)) for b in found
                ), f"decode rank {rank}: block {i} of the request (prefill block {pb}) is not the reshaped prefill KV"
        return len(full) * len(dests)
    finally:
        for r in sources + dests:
            r.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_tensor_parallel_engines_hand_kv_over(engines: Engines, prefill_tp: int, decode_tp: int) -> None:
    prefill, decode = engines.prefill[prefill_tp], engines.decode[decode_tp]
    # ~420 tokens: four full blocks of 128 (TP 1 and TP 2 outputs agree on
    # the tiny model below ~700 tokens).
    prompt = long_prompt(f"tp {prefill_tp} to {decode_tp} {engines.mode}", 30)
    before = engines.pair.decode.metric("kvrail_bytes_received_total")
    text, prefill_blocks = engines.hand_off(prefill, decode, prompt)
    moved = engines.pair.decode.metric("kvrail_bytes_received_total") - before
    checked = _check_kv(prefill, decode, prefill_blocks)
    print(
        f"{engines.mode} TP {prefill_tp} -> TP {decode_tp}: {moved:.0f} KV bytes moved, "
        f"{checked} rank-blocks equal the reshaping"
    )
    assert moved > 0, "no KV bytes reached the decode sidecar"
    # The decode engine's own output for the prompt (no hand-off, no cache).
    assert text == engines.complete(decode.url, prompt)["choices"][0]["text"]


def test_a_prefill_with_other_heads_is_refused_with_both_values(engines: Engines, tmp_path: Path) -> None:
    """A decode engine handed a prefill's blocks whose geometry differs
    (here: another model name in the published geometry, as a misconfigured
    deployment would give) fails the load, naming both values; vLLM
    recomputes it (policy "recompute"), so the output is still right.
    (Pull mode: the prefill's published geometry is what is tampered with;
    a push's refusal is tested between sidecars in tests/tensor_parallel.rs.)"""
    if engines.mode != "pull":
        pytest.skip("tampers with pull-mode kv_transfer_params")
    prefill, decode = engines.prefill[1], engines.decode[1]
    prompt = long_prompt("mismatch", 20)
    r = engines.complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = r["kv_transfer_params"]
    for rank in params["remote_ranks"]:
        rank["geometry"]["model"] = "another/model"
    before = engines.pair.decode.metric("kvrail_bytes_received_total")
    text = engines.complete(decode.url, prompt, kv_transfer_params=params)["choices"][0]["text"]
    assert engines.pair.decode.metric("kvrail_bytes_received_total") == before, "bytes moved despite the mismatch"
    log = decode.log_path.read_text(errors="replace")
    assert "model is" in log and "another/model" in log, decode.log_tail()
    assert text == engines.complete(decode.url, prompt)["choices"][0]["text"]
