//! Helpers for end-to-end tests: build and start real `kvrail` processes on
//! loopback, wait until they answer, and clean them up.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvrail_client::Client;

pub mod etcd;

/// Says that a test (or a part of one) was skipped, and why, where whoever runs
/// the tests sees it: the harness hides a passing test's `println!`, and a
/// skipped test passes.
pub fn say_skipped(test: &str, why: &str) {
    use std::io::Write;
    // Straight to the process's stdout, past the harness's capture.
    let _ = writeln!(std::io::stdout().lock(), "SKIPPED {test}: {why}");
}

/// A test (or part of one) that cannot run here says why and passes, except
/// under CI, which has what every test needs (root, the RDMA VM, Python) and
/// where a skip would hide a failure.
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{test} cannot run under CI: {why}");
    }
    say_skipped(test, why);
}

/// The checkout these tests belong to, found at run time (cargo's
/// `CARGO_MANIFEST_DIR`, else the current directory, then up to the workspace
/// manifest): nothing of the build machine's paths is compiled into the tests.
pub fn workspace_root() -> PathBuf {
    let start = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::current_dir().ok())
        .unwrap_or_default();
    start
        .ancestors()
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml")).is_ok_and(|t| t.contains("[workspace]"))
        })
        .map(Path::to_path_buf)
        .unwrap_or(start)
}

/// A command that runs one of the workspace's binaries, through
/// `$KVRAIL_EXEC_WRAPPER` when set (e.g. `qemu-aarch64 -L /usr/aarch64-linux-gnu`
/// to run cross-built binaries under emulation).
pub fn command(name: &str) -> Command {
    let bin = binary(name);
    let wrapper = std::env::var("KVRAIL_EXEC_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    match words.next() {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.args(words).arg(bin);
            cmd
        }
        None => Command::new(bin),
    }
}

/// Builds the daemon and example binaries once per test process (a no-op when fresh).
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        // Already built (the RDMA VM runs tests with binaries built on the host).
        if let Some(dir) = std::env::var_os("KVRAIL_BIN_DIR") {
            return PathBuf::from(dir);
        }
        let root = workspace_root();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(&root).args([
            "build",
            "--quiet",
            "--bins",
            "-p",
            "kvrail-sidecar",
            "-p",
            "kvrail-examples",
            "-p",
            "loadgen",
        ]);
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building the kvrail binaries failed");
        // target/<profile>/deps/<test> -> target/<profile>
        let exe = std::env::current_exe().expect("current exe");
        exe.parent()
            .and_then(Path::parent)
            .expect("target dir")
            .to_path_buf()
    });
    dir.join(name)
}

/// A port free for both TCP and UDP right now (sidecars listen on both: TCP and
/// QUIC share the rail's port number).
pub fn free_port() -> u16 {
    // Ports below the kernel's ephemeral range: one handed out there could be
    // taken, before its sidecar binds it, as the local port of some other
    // test's outgoing connection (the listener then fails to bind). Distinct
    // per call within this process; checked free for TCP and UDP.
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    if ephemeral_low >= 4096 {
        let low = ephemeral_low.saturating_sub(12_000).max(2048);
        let span = ephemeral_low - low;
        let start = std::process::id().wrapping_mul(7919) % span;
        for _ in 0..span {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let port = (low + (start + n) % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok()
                && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
            {
                return port;
            }
        }
    }
    for _ in 0..100 {
        let tcp = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = tcp.local_addr().expect("local address").port();
        if std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no port free for both TCP and UDP");
}

/// One `kvrail serve` process.
pub struct Sidecar {
    pub node: String,
    pub socket: PathBuf,
    pub listen: SocketAddr,
    pub metrics: Option<SocketAddr>,
    child: Option<Child>,
    args: Vec<String>,
}

impl Sidecar {
    /// Starts `kvrail serve --node NODE --socket DIR/NODE.sock`, listening on
    /// every address of `listen` (one per rail; the first is [`Sidecar::listen`]),
    /// with `args` (peers, certificates...) and its log in `dir`.
    pub fn start(
        dir: &Path,
        node: &str,
        listen: &[SocketAddr],
        metrics: Option<SocketAddr>,
        args: &[String],
    ) -> Sidecar {
        let socket = dir.join(format!("{node}.sock"));
        let mut all = vec![
            "--node".to_string(),
            node.to_string(),
            "--socket".into(),
            socket.display().to_string(),
        ];
        for l in listen {
            all.push("--listen".into());
            all.push(l.to_string());
        }
        if let Some(m) = metrics {
            all.push("--metrics-addr".into());
            all.push(m.to_string());
        }
        all.extend(args.iter().cloned());
        let mut s = Sidecar {
            node: node.into(),
            socket,
            listen: listen[0],
            metrics,
            child: None,
            args: all,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let log = std::fs::File::create(self.socket.with_extension("log")).expect("log file");
        let child = command("kvrail")
            .arg("serve")
            .args(&self.args)
            // Gone with this test process, however it ends.
            .args(["--parent-pid", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kvrail");
        self.child = Some(child);
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).expect("running")
    }

    /// Sends a signal (`STOP`, `CONT`, `KILL`) to the process. `STOP` returns
    /// once every thread of the process is stopped (kill(2) only queues it:
    /// without the wait, a request sent right after could still be served).
    pub fn signal(&self, sig: &str) {
        let pid = self.pid();
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status()
            .expect("kill");
        assert!(ok.success());
        if sig == "STOP" {
            wait_until("the process is stopped", || all_threads_stopped(pid));
        }
    }

    /// Starts the process again with the same flags (after [`Sidecar::kill`]).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a killed sidecar only");
        self.spawn();
    }

    /// Kills the process and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the process as an operator would (SIGTERM) and waits for it.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let _ = c.wait();
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Connects a client, retrying until the daemon answers (or 30 s pass).
    pub async fn client(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = Client::connect(&self.socket).await {
                if c.list_peers().await.is_ok() {
                    return c;
                }
            }
            assert!(
                Instant::now() < deadline,
                "sidecar {} did not come up; its log ({}) ends:\n{}",
                self.node,
                self.socket.with_extension("log").display(),
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read(self.socket.with_extension("log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("(no log: {e})"))
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(self.pid().to_string())
                .status();
        }
        self.kill();
    }
}

/// Two sidecars, `prefill` and `decode`, each configured with the other as its peer.
pub struct Pair {
    pub prefill: Sidecar,
    pub decode: Sidecar,
    pub dir: tempfile::TempDir,
}

impl Pair {
    pub fn start(extra: &[&str]) -> Pair {
        let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
        Pair::start_on(&lo, &lo, extra)
    }

    /// Sidecars listening on one rail per address (prefill's and decode's rail i
    /// face each other), with both metrics listeners.
    pub fn start_on(
        prefill_ips: &[std::net::IpAddr],
        decode_ips: &[std::net::IpAddr],
        extra: &[&str],
    ) -> Pair {
        Pair::start_each(prefill_ips, decode_ips, extra, extra)
    }

    /// As [`Pair::start_on`], with flags of each node's own. A node given no
    /// `--tls-dir` runs with `--insecure` (unauthenticated TCP).
    pub fn start_each(
        prefill_ips: &[std::net::IpAddr],
        decode_ips: &[std::net::IpAddr],
        prefill_extra: &[&str],
        decode_extra: &[&str],
    ) -> Pair {
        let dir = tempfile::tempdir().expect("tempdir");
        let (pp, dp, mp) = (free_port(), free_port(), free_port());
        let dm = free_port();
        let mk = |node: &str,
                  port: u16,
                  ips: &[std::net::IpAddr],
                  peer: &str,
                  peer_port: u16,
                  peer_ips: &[std::net::IpAddr],
                  metrics: u16,
                  extra: &[&str]| {
            let rails: Vec<String> = peer_ips
                .iter()
                .map(|ip| SocketAddr::new(*ip, peer_port).to_string())
                .collect();
            let mut args = vec!["--peer".to_string(), format!("{peer}={}", rails.join(","))];
            args.extend(extra.iter().map(|s| s.to_string()));
            if !extra.contains(&"--tls-dir") && !extra.contains(&"--insecure") {
                args.push("--insecure".into());
            }
            let listen: Vec<SocketAddr> = ips.iter().map(|ip| SocketAddr::new(*ip, port)).collect();
            let metrics = SocketAddr::new(std::net::IpAddr::from([127, 0, 0, 1]), metrics);
            Sidecar::start(dir.path(), node, &listen, Some(metrics), &args)
        };
        let prefill = mk(
            "prefill",
            pp,
            prefill_ips,
            "decode",
            dp,
            decode_ips,
            mp,
            prefill_extra,
        );
        let decode = mk(
            "decode",
            dp,
            decode_ips,
            "prefill",
            pp,
            prefill_ips,
            dm,
            decode_extra,
        );
        Pair {
            prefill,
            decode,
            dir,
        }
    }

    pub fn shm_path(&self, name: &str) -> PathBuf {
        shm_path(self.prefill.listen.port(), name)
    }
}

impl Drop for Pair {
    /// Removes the shared-memory files made under either sidecar's port,
    /// also when the test failed before unlinking them (they hold memory
    /// until removed).
    fn drop(&mut self) {
        for port in [self.prefill.listen.port(), self.decode.listen.port()] {
            loadgen::cluster::remove_shm_files(&format!(
                "kvrail-test-{}-{port}-",
                std::process::id()
            ));
        }
    }
}

/// A shared-memory path unique to this test process and to `port` (a port one of
/// its sidecars holds, so that tests running at once never share a file).
pub fn shm_path(port: u16, name: &str) -> PathBuf {
    kvrail_client::shm_dir().join(format!("kvrail-test-{}-{port}-{name}", std::process::id()))
}

/// Fetches the Prometheus text from a metrics listener.
pub fn scrape(addr: SocketAddr) -> String {
    loadgen::prometheus::fetch(addr).expect("scrape metrics")
}

pub use loadgen::prometheus::sum as metric_sum;

/// How many threads of `pid` are named `name` (as `/proc` shows it, at
/// most 15 bytes); 0 when the process is gone.
pub fn threads_named(pid: u32, name: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .count()
}

/// Whether every thread of `pid` is in the stopped state (`T`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true; // gone
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|s| {
                // The state follows the parenthesised command name.
                s.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.chars().next())
            })
            .is_none_or(|state| state == 'T' || state == 't')
    })
}

/// Polls `done` until it holds (20 s at most, then panics naming `what`).
/// Whether this test runs as root (the owner of `/proc/self`: the
/// effective user).
pub fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Python environments for the tests that run clients/python's pytest suites.
pub mod python {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// Runs a set-up command; its failure as text.
    pub fn run(cmd: &mut Command) -> Result<(), String> {
        match cmd.status() {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => Err(format!("{cmd:?} exited with {s}")),
            Err(e) => Err(format!("{cmd:?}: {e}")),
        }
    }

    /// The interpreter of virtualenv `target/<name>`, created with
    /// `$KVRAIL_PYTHON` (default `python3`) when it does not exist yet.
    pub fn venv(target: &Path, name: &str) -> Result<PathBuf, String> {
        let python = std::env::var("KVRAIL_PYTHON").unwrap_or_else(|_| "python3".into());
        let dir = target.join(name);
        let py = dir.join("bin/python");
        if !py.exists() {
            run(Command::new(&python).args(["-m", "venv"]).arg(&dir))?;
        }
        Ok(py)
    }

    /// The kvrail daemon these tests run and the target directory holding it.
    pub fn daemon_and_target() -> (PathBuf, PathBuf) {
        let kvrail = crate::binary("kvrail");
        let target = kvrail
            .parent()
            .and_then(Path::parent)
            .expect("target dir")
            .to_path_buf();
        (kvrail, target)
    }
}

/// A hand-written peer on a raw socket (for tests of what a hostile or broken
/// peer can do): the handshake as the daemons' `--insecure` TCP speaks it, and
/// control frames read back.
pub mod raw_peer {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use kvrail_core::wire::{self, pb, Body};

    /// Connects to the decode sidecar's rail `addr` as `node` with session
    /// `session_id` and sends its hello; the socket and the first answer.
    pub fn hello(addr: SocketAddr, node: &str, session_id: u64) -> (TcpStream, Option<Body>) {
        hello_as(connect(addr), hello_message(node, session_id))
    }

    /// A connection to rail `addr` whose reads give up after 10 s.
    pub fn connect(addr: SocketAddr) -> TcpStream {
        let sock = TcpStream::connect(addr).expect("connect to the rail");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        sock
    }

    /// The hello of `node` dialing the decode sidecar over one TCP rail,
    /// without credentials.
    pub fn hello_message(node: &str, session_id: u64) -> pb::Hello {
        pb::Hello {
            protocol_version: 1,
            node_name: node.into(),
            session_id,
            transports: vec!["tcp".into()],
            rail_count: 1,
            expected_peer: "decode".into(),
            ..Default::default()
        }
    }

    /// Sends `hello` on `sock` (connected, with a read timeout); the socket
    /// and the first answer.
    pub fn hello_as(mut sock: TcpStream, hello: pb::Hello) -> (TcpStream, Option<Body>) {
        sock.write_all(&wire::encode_control(&wire::message(Body::Hello(hello))))
            .expect("send the hello");
        let reply = read_control(&mut sock);
        (sock, reply)
    }

    /// As [`hello`], as the configured peer `prefill`, which must be accepted.
    pub fn session(addr: SocketAddr, session_id: u64) -> TcpStream {
        match hello(addr, "prefill", session_id) {
            (sock, Some(Body::HelloAck(_))) => sock,
            (_, other) => panic!("session {session_id}: the handshake got {other:?}"),
        }
    }

    /// The next control frame, or None (a data frame, a close, a timeout).
    pub fn read_control(sock: &mut TcpStream) -> Option<Body> {
        let mut hdr = [0u8; 8];
        sock.read_exact(&mut hdr).ok()?;
        let wire::FrameHeader::Control { len } = wire::decode_frame_header(&hdr).ok()? else {
            return None;
        };
        let mut body = vec![0u8; len as usize];
        sock.read_exact(&mut body).ok()?;
        wire::decode_control(&body).ok()
    }
}
