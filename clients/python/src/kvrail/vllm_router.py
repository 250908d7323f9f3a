"""A small router for disaggregated vLLM with kvrail: each completion goes to
a prefill server (``max_tokens=1``, ``kv_transfer_params={"do_remote_decode":
true}``), whose reply carries the ``kv_transfer_params`` naming the prompt's
KV blocks; the same request then goes to a decode server with those params,
where kvrail's connector pulls the blocks before the first decode step.

Standard library only (no vLLM or web framework needed)::

    python -m kvrail.vllm_router --listen 127.0.0.1:8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

``--mode push`` (engines started with the connector's ``"mode": "push"``)
sends the request to both servers at once with one ``push_ticket``: the decode
engine grants its blocks to the prefill engine (named by ``--prefill-kvrail
NODE/WORKER``: its kvrail node and the connector's ``worker_id``), which
writes each layer into them as it computes it::

    python -m kvrail.vllm_router --mode push --prefill-kvrail prefill/vllm-prefill \
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Many engines: repeat ``--prefill`` and ``--decode``, or let the engines
register themselves in etcd (their connectors do, given ``etcd`` and
``engine_url`` in ``kv_connector_extra_config``) and follow them with
``--etcd http://127.0.0.1:2379``; an engine that leaves is no longer picked.
``--policy`` picks each request's engines: ``round_robin`` or
``least_loaded`` (fewest tokens this router has queued on the engine)::

    python -m kvrail.vllm_router --etcd http://127.0.0.1:2379 --policy least_loaded

Serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or
not; request bodies with a Content-Length) and ``GET /health``; anything else is
404. In pull mode a prefill that fails or returns no ``kv_transfer_params`` is
answered with 502 and its reason, never silently recomputed on the decode side;
in push mode the two calls run at once, so a failed prefill is logged and the
decode request fails when its pushed layers do not arrive within the
connector's ``timeout_s``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import select
import socket
import sys
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvrail.routing import POLICIES, Engine, NoEngine, Pools, estimate_tokens, output_tokens

log = logging.getLogger("kvrail.vllm_router")

ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Largest request body accepted (a long prompt is well under this).
MAX_BODY_BYTES = 16 << 20


class RouterError(Exception):
    """A request the router cannot hand over, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UpstreamError(Exception):
    """An engine answered with an error status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


class ClientWatch:
    """Cuts the upstream calls of one client's request when that client goes
    away: a disconnect is how a user aborts a request, and an engine aborts
    its copy (freeing its KV blocks, cancelling its transfers) only when its
    own connection closes. Watches the client's socket from a thread while
    the handler waits on the engines."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._calls: list[http.client.HTTPConnection] = []
        self._done = threading.Event()
        self.gone = False
        self._thread = threading.Thread(target=self._watch, name="router-client-watch", daemon=True)
        self._thread.start()

    def add(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._calls.append(conn)
            gone = self.gone
        if gone:
            _cut(conn)

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.2)
                if not ready:
                    continue
                data = self._sock.recv(1, socket.MSG_PEEK)
            except (OSError, ValueError):
                data = b""
            if data:
                return  # the client sent more (not a disconnect): stop watching
            with self._lock:
                self.gone = True
                calls = list(self._calls)
            log.info("client went away: aborting its upstream requests")
            for conn in calls:
                _cut(conn)
            return

    def close(self) -> None:
        self._done.set()
        self._thread.join()


def _cut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _post(url: str, body: dict[str, Any], timeout: float, watch: ClientWatch | None = None) -> http.client.HTTPResponse:
    """POSTs ``body`` as JSON; the response (read it, then close it), or
    :class:`UpstreamError` for an error status. ``watch`` cuts the call when
    the client goes away."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    data = json.dumps(body).encode()
    try:
        conn.connect()
        if watch is not None:
            watch.add(conn)
        conn.request("POST", u.path or "/", data, {"Content-Type": "application/json"})
        r = conn.getresponse()
    except BaseException:
        conn.close()
        raise
    if r.status >= 400:
        detail = r.read().decode(errors="replace")[:2000]
        conn.close()
        raise UpstreamError(r.status, detail)
    return r


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's copy of a request: one token, not streamed, and
    asking the engine to keep the prompt's KV for a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def push_requests(body: dict[str, Any], prefill_node: str, prefill_worker: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Push mode: (the prefill server's copy, the decode server's copy), tied
    by a fresh ticket; the decode engine grants its blocks to the prefill's."""
    ticket = uuid.uuid4().hex
    pre = prefill_request(body)
    pre["kv_transfer_params"] = {"do_remote_decode": True, "push_ticket": ticket}
    dec = dict(body)
    dec["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "push_ticket": ticket,
        "push_grant_to": {"node": prefill_node, "worker": prefill_worker},
    }
    return pre, dec


def _prefill_in_background(
    url: str,
    body: dict[str, Any],
    timeout: float,
    watch: ClientWatch | None = None,
    done: Any = None,
) -> threading.Thread:
    """``done()`` is called when the call has ended, however it ended."""

    def run() -> None:
        try:
            with _post(url, body, timeout, watch) as r:
                r.read()
        except UpstreamError as e:
            log.error("push-mode prefill failed (%s): %s", e.status, e.detail[:500])
        except (OSError, http.client.HTTPException) as e:
            log.error("push-mode prefill failed: %s", e)
        finally:
            if done is not None:
                done()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def hand_off(
    prefill: str, path: str, body: dict[str, Any], timeout: float, watch: ClientWatch | None = None
) -> dict[str, Any]:
    """Runs the prefill and returns the decode server's copy of the request."""
    return hand_off_counted(prefill, path, body, timeout, watch)[0]


def hand_off_counted(
    prefill: str, path: str, body: dict[str, Any], timeout: float, watch: ClientWatch | None = None
) -> tuple[dict[str, Any], int | None]:
    """:func:`hand_off`, with the prompt's tokens as the prefill counted them
    (None if its reply did not say)."""
    try:
        with _post(prefill + path, prefill_request(body), timeout, watch) as r:
            reply = json.load(r)
    except UpstreamError as e:
        raise RouterError(e.status if 400 <= e.status < 500 else 502, f"prefill server: {e.detail}") from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        raise RouterError(502, f"prefill server unreachable or unreadable: {e}") from None
    params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
    if not params:
        raise RouterError(
            502,
            "prefill server returned no kv_transfer_params: is it started with "
            "kvrail's connector and kv_role kv_producer (or kv_both)?",
        )
    out = dict(body)
    out["kv_transfer_params"] = params
    usage = reply.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return out, prompt_tokens if isinstance(prompt_tokens, int) and prompt_tokens >= 0 else None


class _Handler(BaseHTTPRequestHandler):
    server: "Router"
    protocol_version = "HTTP/1.1"

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError as e:  # the client went away: nothing to answer
            log.info("%s: %s", self.address_string(), e)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.info("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        if status >= 400:
            # The request's body may be unread: never parse it as the next request.
            self.close_connection = True
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ROUTES:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or "0")
        except ValueError:
            self._reply(400, {"error": "bad Content-Length"})
            return
        if not 0 < length <= MAX_BODY_BYTES:
            self._reply(413 if length > MAX_BODY_BYTES else 400, {"error": f"body of {length} bytes"})
            return
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError as e:
            self._reply(400, {"error": f"body is not JSON: {e}"})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": "body must be a JSON object"})
            return
        watch = ClientWatch(self.connection)
        try:
            self._route(body, watch)
        except (OSError, http.client.HTTPException) as e:
            if not watch.gone:
                raise
            log.info("%s went away: %s", self.address_string(), e)
            self.close_connection = True
        finally:
            watch.close()

    def _route(self, body: dict[str, Any], watch: ClientWatch) -> None:
        pools = self.server.pools
        timeout = self.server.timeout_s
        tokens = estimate_tokens(body)
        try:
            prefill = pools.pick("prefill", tokens)
        except NoEngine as e:
            self._reply(503, {"error": str(e)})
            return
        released = threading.Event()

        def release_prefill() -> None:
            if not released.is_set():
                released.set()
                pools.release("prefill", prefill, tokens)

        try:
            if self.server.push:
                if prefill.push_to is None:
                    release_prefill()
                    self._reply(502, {"error": f"prefill engine {prefill.url} has no kvrail node/worker for push mode"})
                    return
                # Both at once: the prefill waits for the decode's grant, then
                # pushes each layer while the decode waits for them.
                prefill_body, decode_body = push_requests(body, *prefill.push_to)
                decode_tokens = tokens + output_tokens(body)
                try:
                    decode = pools.pick("decode", decode_tokens)
                except NoEngine as e:
                    release_prefill()
                    self._reply(503, {"error": str(e)})
                    return
                _prefill_in_background(prefill.url + self.path, prefill_body, timeout, watch, release_prefill)
            else:
                try:
                    decode_body, counted = hand_off_counted(prefill.url, self.path, body, timeout, watch)
                except RouterError as e:
                    if watch.gone:
                        return  # the prefill was cut because the client left
                    self._reply(e.status, {"error": str(e)})
                    return
                finally:
                    release_prefill()
                if watch.gone:
                    return  # nobody waits for the decode: do not start it
                decode_tokens = (counted if counted is not None else tokens) + output_tokens(body)
                try:
                    decode = pools.pick("decode", decode_tokens)
                except NoEngine as e:
                    self._reply(503, {"error": str(e)})
                    return
        except BaseException:
            release_prefill()
            raise
        failed: list[str] = []
        tried = {decode.url}
        while True:
            try:
                error = self._relay(decode.url, decode_body, watch)
            finally:
                pools.release("decode", decode, decode_tokens)
            if error is None or watch.gone:
                return
            # The decode engine failed before answering (gone, or a server
            # error): another one takes the request. In pull mode it reads
            # the blocks the prefill still holds (or, if the first had read
            # them, recomputes the prompt); nothing was relayed yet.
            failed.append(f"{decode.url}: {error}")
            log.warning("decode engine %s failed before answering (%s); trying another", decode.url, error)
            try:
                decode = pools.pick("decode", decode_tokens, frozenset(tried))
            except NoEngine:
                self._reply(502, {"error": "decode server failed: " + "; ".join(failed)})
                return
            tried.add(decode.url)
            if self.server.push:
                # A push ticket is the first decode's: the prefill pushed
                # into its blocks. The next one computes the prompt itself.
                decode_body = dict(decode_body)
                decode_body.pop("kv_transfer_params", None)

    def _relay(self, decode: str, decode_body: dict[str, Any], watch: ClientWatch) -> str | None:
        """Relays the decode engine's answer; the error, with nothing sent to
        the client, when the engine failed before answering (unreachable, cut,
        or a 5xx status) so that another may take the request."""
        try:
            upstream = _post(decode + self.path, decode_body, self.server.timeout_s, watch)
        except UpstreamError as e:
            if e.status >= 500:
                return f"{e.status} {e.detail[:300]}"
            self._reply(e.status, {"error": f"decode server: {e.detail}"})
            return None
        except (OSError, http.client.HTTPException) as e:
            if watch.gone:
                return None
            return f"unreachable or cut: {e}"
        if not decode_body.get("stream"):
            # A whole answer: one that the engine aborted (vLLM answers the
            # requests it holds when it shuts down with finish_reason
            # "abort" and no text) is not relayed; another engine takes it.
            with upstream:
                try:
                    data = upstream.read()
                except (OSError, http.client.HTTPException) as e:
                    return f"cut while answering: {e}"
            if _aborted(data):
                return "aborted the request (finish_reason abort: shutting down?)"
            self.send_response(upstream.status)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        with upstream:
            self.send_response(upstream.status)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
            # Streamed replies pass through as they come, chunk by chunk.
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:
                chunk = upstream.read1(64 << 10)
                if not chunk:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        return None


def _aborted(data: bytes) -> bool:
    """Whether a completion reply says the engine aborted every choice."""
    try:
        reply = json.loads(data)
    except ValueError:
        return False
    choices = reply.get("choices") if isinstance(reply, dict) else None
    return (
        isinstance(choices, list)
        and len(choices) > 0
        and all(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    )


class Router(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        listen: tuple[str, int],
        prefill: str | list[str],
        decode: str | list[str],
        timeout_s: float,
        push_to: tuple[str, str] | None = None,
        *,
        pools: Pools | None = None,
        push: bool | None = None,
        policy: str = "round_robin",
    ) -> None:
        """``prefill``/``decode``: engine URLs (ignored with ``pools``, which
        another party keeps current, e.g. from etcd). ``push_to``: push mode,
        with the one prefill engine's (kvrail node, connector worker id);
        ``push``: push mode with ``pools`` whose engines say it themselves."""
        super().__init__(listen, _Handler)
        if pools is None:
            pools = Pools(policy)
            urls = [prefill] if isinstance(prefill, str) else list(prefill)
            pools.set_engines("prefill", [Engine(u.rstrip("/"), push_to, f"prefill-{i}") for i, u in enumerate(urls)])
            urls = [decode] if isinstance(decode, str) else list(decode)
            pools.set_engines("decode", [Engine(u.rstrip("/"), None, f"decode-{i}") for i, u in enumerate(urls)])
        self.pools = pools
        self.timeout_s = timeout_s
        self.push = push if push is not None else push_to is not None


def follow_etcd(directory: Any, pools: Pools, mode: str) -> None:
    """Keeps ``pools`` equal to the engines of ``mode`` that ``directory``
    (a :class:`kvrail.engines.EngineDirectory`) knows."""

    def refresh(*_: Any) -> None:
        records = [r for r in directory.engines() if r.mode == mode]
        for role in ("prefill", "decode"):
            pools.set_engines(
                role,
                [Engine(r.url.rstrip("/"), (r.kvrail_node, r.worker), r.engine) for r in records if r.serves(role)],
            )

    directory.on_change = refresh
    refresh()


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrail.vllm_router", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_address, default=("127.0.0.1", 8000), help="HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--prefill", action="append", default=[], help="prefill server URL, e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", action="append", default=[], help="decode server URL, e.g. http://127.0.0.1:8200 (repeatable)")
    p.add_argument("--etcd", help="etcd endpoints (http://HOST:PORT, comma separated): follow the engines registered there")
    p.add_argument("--etcd-prefix", default="/kvrail/default", help="cluster prefix in etcd (default /kvrail/default)")
    p.add_argument("--etcd-ca", help="https:// etcd: the CA certificate (PEM) that signed etcd's")
    p.add_argument("--etcd-cert", help="client certificate (PEM) to show etcd (with --etcd-key)")
    p.add_argument("--etcd-key", help="key (PEM) of --etcd-cert")
    p.add_argument("--policy", choices=POLICIES, default="round_robin", help="how engines are picked (default round_robin)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream call (default 600)")
    p.add_argument("--mode", choices=("pull", "push"), default="pull", help="as the engines' connectors (default pull)")
    p.add_argument(
        "--prefill-kvrail",
        metavar="NODE/WORKER",
        help="push mode with --prefill: the prefill engine's kvrail node name and connector worker_id",
    )
    args = p.parse_args(argv)
    if args.etcd and (args.prefill or args.decode):
        p.error("give either --etcd or --prefill/--decode")
    if not args.etcd and not (args.prefill and args.decode):
        p.error("give --prefill and --decode, or --etcd")
    push_to = None
    if args.mode == "push" and not args.etcd:
        node, sep, worker = (args.prefill_kvrail or "").partition("/")
        if not (node and sep and worker):
            p.error("--mode push needs --prefill-kvrail NODE/WORKER")
        push_to = (node, worker)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    pools = None
    if args.etcd:
        from kvrail.engines import EngineDirectory
        from kvrail.etcd import Etcd, EtcdError

        try:
            etcd = Etcd(args.etcd, ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key)
        except EtcdError as e:
            p.error(str(e))
        pools = Pools(args.policy)
        follow_etcd(EngineDirectory(etcd, args.etcd_prefix), pools, args.mode)
    with Router(
        args.listen,
        args.prefill,
        args.decode,
        args.timeout,
        push_to,
        pools=pools,
        push=args.mode == "push",
        policy=args.policy,
    ) as router:
        host, port = router.server_address[:2]
        print(f"kvrail vLLM router on http://{host}:{port}", file=sys.stderr, flush=True)
        try:
            router.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
