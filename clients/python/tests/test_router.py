"""kvrail.vllm_router without vLLM: how it answers what it cannot hand over."""

from __future__ import annotations

import http.client
import json
import threading
from typing import Iterator

import pytest

from conftest import free_port
from kvrail.vllm_router import Router, main, push_requests


@pytest.fixture
def router() -> Iterator[Router]:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = Router(("127.0.0.1", 0), dead, dead, 5.0)
    t = threading.Thread(target=r.serve_forever, daemon=True)
    t.start()
    try:
        yield r
    finally:
        r.shutdown()
        r.server_close()


def call(r: Router, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None):
    c = http.client.HTTPConnection("127.0.0.1", r.server_address[1], timeout=10)
    c.request(method, path, body=body, headers=headers or {})
    resp = c.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_bad_requests_get_clear_statuses(router: Router) -> None:
    assert call(router, "GET", "/health") == (200, {"status": "ok"})
    assert call(router, "GET", "/v1/models")[0] == 404
    assert call(router, "POST", "/v1/other", b"{}")[0] == 404
    status, reply = call(router, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "not JSON" in reply["error"]
    assert call(router, "POST", "/v1/completions", b"[1, 2]")[0] == 400
    assert call(router, "POST", "/v1/completions", b"")[0] == 400
    status, _ = call(router, "POST", "/v1/completions", b"{}", {"Content-Length": str(1 << 30)})
    assert status == 413


def test_an_unreachable_prefill_is_a_502_not_a_silent_recompute(router: Router) -> None:
    status, reply = call(router, "POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode())
    assert status == 502 and "prefill server unreachable" in reply["error"]


def test_push_requests_tie_both_halves_with_one_fresh_ticket() -> None:
    body = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True}
    pre, dec = push_requests(body, "prefill", "vllm-prefill")
    ticket = pre["kv_transfer_params"]["push_ticket"]
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "push_ticket": ticket,
        "push_grant_to": {"node": "prefill", "worker": "vllm-prefill"},
    }
    assert (pre["max_tokens"], pre["stream"], dec["max_tokens"], dec["stream"]) == (1, False, 9, True)
    assert push_requests(body, "prefill", "vllm-prefill")[0]["kv_transfer_params"]["push_ticket"] != ticket
    assert body == {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True}  # untouched


def test_push_mode_needs_the_prefill_identity(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--mode", "push", "--prefill", "http://a", "--decode", "http://b"])
    assert "--prefill-kvrail" in capsys.readouterr().err


def test_a_client_that_goes_away_cuts_the_engine_call(tmp_path) -> None:
    # An engine that takes the request and never answers (a long prefill);
    # when the client leaves, the router must close the engine's connection:
    # that is how vLLM learns to abort the request and free its blocks.
    import socket

    engine = socket.socket()
    engine.bind(("127.0.0.1", 0))
    engine.listen(4)
    url = f"http://127.0.0.1:{engine.getsockname()[1]}"
    r = Router(("127.0.0.1", 0), url, url, 60.0)
    t = threading.Thread(target=r.serve_forever, daemon=True)
    t.start()
    try:
        client = socket.create_connection(("127.0.0.1", r.server_address[1]))
        body = json.dumps({"model": "m", "prompt": "x"}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        engine.settimeout(10)
        upstream, _ = engine.accept()
        upstream.settimeout(10)
        seen = b""
        while b"\r\n\r\n" not in seen:
            seen += upstream.recv(65536)
        head, _, got = seen.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        while len(got) < length:  # the body may follow the head in its own segment
            got += upstream.recv(65536)
        assert b"do_remote_decode" in got  # the prefill's copy
        client.close()  # the user gives up
        # The router closes the engine's side: recv returns EOF (or a reset).
        try:
            while upstream.recv(65536):
                pass
        except ConnectionResetError:
            pass
        upstream.close()
    finally:
        r.shutdown()
        r.server_close()
        engine.close()
