"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client
URL, served by etcd 3.4 and later), standard library only: leases, puts,
deletes, prefix reads and prefix watches, over ``http://`` or ``https://``
(etcd's CA, and a client certificate when etcd asks for one). Enough for
engines to register themselves and for the router to follow them; no
transactions, no user/password auth.

Keys and values are ``str`` here and base64 on the wire, as the gateway
wants; revisions and lease ids are ints here and decimal strings there.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterator


class EtcdError(Exception):
    """No endpoint answered, or one answered with an error."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str | None) -> str:
    return base64.b64decode(text or "").decode(errors="replace")


def prefix_end(prefix: str) -> str:
    """The end of the key range holding every key that starts with ``prefix``
    (etcd's ``range_end``: the prefix with its last byte incremented)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return raw.decode(errors="surrogateescape")
        raw.pop()
    return "\0"


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix: ``value`` None for a delete."""

    key: str
    value: str | None
    revision: int


class Etcd:
    """Talks to the first of ``endpoints`` (``http://host:port``) that answers."""

    def __init__(
        self,
        endpoints: list[str] | str,
        timeout: float = 5.0,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> None:
        """``ca``: etcd's CA certificate (PEM), needed for ``https://``
        endpoints; ``cert`` and ``key``: the client certificate shown to an
        etcd that asks for one."""
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise EtcdError("no etcd endpoint given")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        schemes = {urllib.parse.urlsplit(e).scheme for e in self.endpoints}
        if not schemes <= {"http", "https"} or len(schemes) != 1:
            raise EtcdError(f"etcd endpoints {self.endpoints}: all http:// or all https://")
        if (cert is None) != (key is None):
            raise EtcdError("an etcd client certificate needs its key (and the key its certificate)")
        self.tls: ssl.SSLContext | None = None
        if schemes == {"https"}:
            if ca is None:
                raise EtcdError("https:// etcd endpoints need etcd's CA certificate (etcd_ca)")
            try:
                self.tls = ssl.create_default_context(cafile=ca)
                if cert is not None:
                    self.tls.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as e:
                raise EtcdError(f"etcd TLS files: {e}") from None
        elif ca is not None or cert is not None:
            raise EtcdError("etcd_ca and etcd_cert are for https:// endpoints; these are http://")
        self.timeout = timeout

    def _connection(self, endpoint: str, timeout: float | None) -> http.client.HTTPConnection:
        u = urllib.parse.urlsplit(endpoint)
        if self.tls is not None:
            return http.client.HTTPSConnection(u.hostname or "localhost", u.port or 2379, timeout=timeout, context=self.tls)
        return http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 2379, timeout=timeout)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs ``body`` to ``/v3/<path>`` of the first endpoint that answers."""
        errors = []
        data = json.dumps(body).encode()
        for endpoint in self.endpoints:
            conn = self._connection(endpoint, self.timeout)
            try:
                conn.request("POST", f"/v3/{path}", data, {"Content-Type": "application/json"})
                r = conn.getresponse()
                reply = r.read()
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"{endpoint}: {e}")
                continue
            finally:
                conn.close()
            try:
                out = json.loads(reply or b"{}")
            except ValueError:
                raise EtcdError(f"{endpoint}/v3/{path}: not JSON: {reply[:200]!r}") from None
            if r.status != 200 or "error" in out:
                raise EtcdError(f"{endpoint}/v3/{path}: {r.status} {out.get('error') or out.get('message') or out}")
            return out
        raise EtcdError("no etcd endpoint answered: " + "; ".join(errors))

    def grant(self, ttl_s: int) -> int:
        return int(self.call("lease/grant", {"TTL": ttl_s})["ID"])

    def keep_alive(self, lease: int) -> bool:
        """Renews ``lease`` once; False if it is gone (expired or revoked)."""
        out = self.call("lease/keepalive", {"ID": lease})
        return int(out.get("result", {}).get("TTL", 0) or 0) > 0

    def revoke(self, lease: int) -> None:
        self.call("lease/revoke", {"ID": lease})

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def delete(self, key: str) -> None:
        self.call("kv/deleterange", {"key": _b64(key)})

    def get_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """(the store's revision, every key under ``prefix`` with its value)."""
        out = self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        revision = int(out.get("header", {}).get("revision", 0))
        return revision, {_unb64(kv["key"]): _unb64(kv.get("value")) for kv in out.get("kvs", [])}

    def watch_prefix(self, prefix: str, after_revision: int, timeout: float | None = None) -> Iterator[WatchEvent]:
        """Changes under ``prefix`` after ``after_revision``, as they happen,
        until the stream breaks (raises :class:`EtcdError`; read the prefix
        again and watch from its revision). ``timeout``: longest quiet spell
        on the stream (None: none)."""
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": after_revision + 1,
            }
        }
        conn = self._connection(self.endpoints[0], timeout)
        try:
            try:
                conn.request("POST", "/v3/watch", json.dumps(body).encode(), {"Content-Type": "application/json"})
                r = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise EtcdError(f"watch {prefix!r}: {e}") from None
            if r.status != 200:
                raise EtcdError(f"watch {prefix!r}: {r.status}")
            while True:
                try:
                    line = r.readline()
                except (OSError, http.client.HTTPException) as e:
                    raise EtcdError(f"watch {prefix!r}: {e}") from None
                if not line:
                    raise EtcdError(f"watch {prefix!r}: the stream ended")
                if not line.strip():
                    continue
                try:
                    result = json.loads(line).get("result", {})
                except ValueError:
                    raise EtcdError(f"watch {prefix!r}: not JSON: {line[:200]!r}") from None
                if result.get("canceled") or result.get("compact_revision"):
                    raise EtcdError(f"watch {prefix!r}: cancelled by etcd ({result.get('cancel_reason', 'compacted')})")
                for ev in result.get("events", []):
                    kv = ev.get("kv", {})
                    deleted = ev.get("type") == "DELETE"
                    yield WatchEvent(
                        key=_unb64(kv.get("key")),
                        value=None if deleted else _unb64(kv.get("value")),
                        revision=int(kv.get("mod_revision", 0)),
                    )
        finally:
            conn.close()
