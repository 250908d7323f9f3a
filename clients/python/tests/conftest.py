"""Real `kvrail serve` processes on loopback for the Python tests.

The daemon binary comes from ``$KVRAIL_BIN`` (the Rust test that runs these sets
it), else the workspace's target/release or target/debug build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

import kvrail

REPO = Path(__file__).resolve().parents[3]


def kvrail_bin() -> Path:
    env = os.environ.get("KVRAIL_BIN")
    if env:
        return Path(env)
    built = [REPO / "target" / p / "kvrail" for p in ("release", "debug")]
    built = [b for b in built if b.exists()]
    if built:
        return max(built, key=lambda b: b.stat().st_mtime)
    found = shutil.which("kvrail")
    if found:
        return Path(found)
    pytest.fail("no kvrail binary: build it (cargo build -p kvrail-sidecar) or set KVRAIL_BIN")


_next_port = 0


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as t, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            t.bind(("127.0.0.1", port))
            u.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def free_port() -> int:
    """A port free for TCP and UDP right now (the sidecar's QUIC shares the
    rail's port), distinct per call within this process, and below the
    kernel's ephemeral range (as tests/support/mod.rs does): a port closed a
    moment ago can be handed out again, or taken as some connection's local
    port, before its taker binds it (two vLLM engines got one port once, and
    the test's requests for one went to the other)."""
    global _next_port
    try:
        low_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low_ephemeral = 32768
    if low_ephemeral >= 4096:
        low = max(low_ephemeral - 12_000, 2048)
        span = low_ephemeral - low
        start = (os.getpid() * 7919 + 4999) % span  # not the Rust tests' offsets
        for _ in range(span):
            port = low + (start + _next_port) % span
            _next_port += 1
            if _bindable(port):
                return port
    for _ in range(100):
        with socket.socket() as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
        if _bindable(port):
            return port
    raise RuntimeError("no free port")


def wait_stopped(pid: int, timeout: float = 20.0) -> None:
    """Waits until every thread of ``pid`` is in the stopped state (or gone)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return
        states = []
        for t in tasks:
            try:
                stat = Path(f"/proc/{pid}/task/{t}/stat").read_text()
            except FileNotFoundError:
                continue
            # The state follows the parenthesised command name.
            states.append(stat.rsplit(") ", 1)[1][:1])
        if all(st in ("T", "t") for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.005)


class Sidecar:
    """One `kvrail serve` process; its log is ``<dir>/<node>.log``."""

    def __init__(
        self, dir: Path, node: str, port: int, peer: str, peer_port: int, *extra: str, metrics: bool = False
    ) -> None:
        self.node = node
        self.port = port
        self.metrics_port = free_port() if metrics else None
        if self.metrics_port is not None:
            extra = (*extra, "--metrics-addr", f"127.0.0.1:{self.metrics_port}")
        self.socket = dir / f"{node}.sock"
        self.log_path = dir / f"{node}.log"
        self.args = [
            str(kvrail_bin()),
            "serve",
            "--node", node,
            "--socket", str(self.socket),
            "--listen", f"127.0.0.1:{port}",
            "--peer", f"{peer}=127.0.0.1:{peer_port}",
            "--insecure",
            # Gone with this test process, however it ends.
            "--parent-pid", str(os.getpid()),
            *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        if self.socket.exists():
            self.socket.unlink()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log)
        self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.node} exited: {self.log()}")
            if self.socket.exists():
                try:
                    with kvrail.Client(self.socket, "probe", connect_timeout=1.0) as c:
                        c.peers()
                    return
                except kvrail.KvrailError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sidecar {self.node} did not come up: {self.log()}")
            time.sleep(0.02)

    def metric(self, name: str) -> float:
        """The sum of a metric's samples (all label sets) from /metrics."""
        assert self.metrics_port is not None, "started without metrics=True"
        import urllib.request

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.split()[-1])
        return total

    def unread_bytes(self) -> int:
        """Bytes waiting unread in this sidecar's accepted loopback TCP
        connections (from /proc/net/tcp: what its peers wrote that it has
        not read yet)."""
        total = 0
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, queues = fields[1], fields[3], fields[4]
                if int(local.rsplit(":", 1)[1], 16) == self.port and state == "01":
                    total += int(queues.split(":")[1], 16)
        return total

    def pause(self) -> None:
        """SIGSTOP, returning once every thread of the process is stopped:
        kill(2) only queues the signal, and a request sent right after could
        still be served (seen: a pull completed after the signal was sent)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Pair:
    def __init__(self, dir: Path, *extra: str, metrics: bool = False) -> None:
        pp, dp = free_port(), free_port()
        self.dir = dir
        self.prefill = Sidecar(dir, "prefill", pp, "decode", dp, *extra, metrics=metrics)
        self.decode = Sidecar(dir, "decode", dp, "prefill", pp, *extra, metrics=metrics)

    def shm(self, name: str) -> Path:
        """A shared-memory path unique to this pair."""
        return kvrail.shm_dir() / f"kvrail-pytest-{os.getpid()}-{self.dir.name}-{name}"

    def stop(self) -> None:
        self.prefill.kill()
        self.decode.kill()
        # Every fixture that makes a pair stops it: its shared-memory files go too.
        for f in kvrail.shm_dir().glob(f"kvrail-pytest-{os.getpid()}-{self.dir.name}-*"):
            f.unlink(missing_ok=True)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.stop()
        for f in kvrail.shm_dir().glob(f"kvrail-pytest-{os.getpid()}-{tmp_path.name}-*"):
            f.unlink()


def evidence(logs: list[Path], lines: int = 12) -> str:
    """What kvrail said in ``logs`` (sidecars' warnings and errors, the
    connector's lines in engine logs), the last ``lines`` of each: the
    evidence a failed vLLM test carries into CI's output."""
    out = []
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        said = [
            line[:400]
            for line in text.splitlines()
            if (" WARN " in line or " ERROR " in line or "kvrail:" in line or "kvrail[" in line)
            and "non-default args" not in line
        ]
        out.append(f"--- {path.name}: {len(said)} lines, the last {min(lines, len(said))}")
        out.extend(said[-lines:])
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test whose fixtures name logs (``log_paths()``) reports what
    kvrail said in them."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            log_paths = getattr(value, "log_paths", None)
            if callable(log_paths):
                report.sections.append(("kvrail evidence", evidence(log_paths())))


class EtcdServer:
    """A real etcd on loopback with its data in ``dir`` (fails under CI=true
    where etcd is missing, else skips). ``tls``: serving https at
    ``https://localhost:PORT`` and asking clients for a certificate of the CA
    made in ``dir/tls`` by ``kvrail certs`` (``localhost`` for etcd, and
    ``client`` for its clients)."""

    def __init__(self, dir: Path, tls: bool = False) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            if os.environ.get("CI") == "true":
                pytest.fail("etcd is not installed (quickstart installs etcd-server)")
            pytest.skip("etcd is not installed (apt install etcd-server)")
        client, peer = free_port(), free_port()
        listen = f"http://127.0.0.1:{client}"
        self.url = listen
        self.tls_dir: Path | None = None
        extra: list[str] = []
        if tls:
            self.tls_dir = dir / "tls"
            subprocess.run([str(kvrail_bin()), "certs", "init", "--dir", str(self.tls_dir)], check=True)
            subprocess.run(
                [str(kvrail_bin()), "certs", "node", "--dir", str(self.tls_dir), "localhost", "client"], check=True
            )
            listen = f"https://127.0.0.1:{client}"
            self.url = f"https://localhost:{client}"
            extra = [
                "--cert-file", str(self.tls_dir / "localhost.pem"),
                "--key-file", str(self.tls_dir / "localhost.key"),
                "--trusted-ca-file", str(self.tls_dir / "ca.pem"),
                "--client-cert-auth",
            ]
        self.log = open(dir / "etcd.log", "w")
        self.proc = subprocess.Popen(
            [
                binary,
                "--name", "t",
                "--data-dir", str(dir / "etcd-data"),
                "--listen-client-urls", listen,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"t=http://127.0.0.1:{peer}",
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        context = None
        if self.tls_dir is not None:
            import ssl

            context = ssl.create_default_context(cafile=str(self.tls_dir / "ca.pem"))
            context.load_cert_chain(str(self.tls_dir / "client.pem"), str(self.tls_dir / "client.key"))
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as r:
                    if json.load(r).get("health") == "true":
                        break
            except OSError:
                pass
            assert self.proc.poll() is None, (dir / "etcd.log").read_text()
            assert time.monotonic() < deadline, "etcd did not start"
            time.sleep(0.05)

    def client_files(self) -> dict[str, str]:
        """The TLS files a client of this etcd is given (none without TLS)."""
        if self.tls_dir is None:
            return {}
        return {
            "ca": str(self.tls_dir / "ca.pem"),
            "cert": str(self.tls_dir / "client.pem"),
            "key": str(self.tls_dir / "client.key"),
        }

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
