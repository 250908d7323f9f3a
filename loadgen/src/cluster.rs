//! Starts two real sidecar processes, on loopback or one per namespace of a
//! [`NetLab`] (this binary re-run as `loadgen sidecar ...`, the same code as
//! `kvrail serve`, or a given `kvrail` binary), and connects to them.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::Client;

use crate::netlab::{NetLab, Node};

/// One sidecar process.
pub struct SidecarProcess {
    pub node: String,
    pub socket: PathBuf,
    /// Where its Prometheus metrics are served, when asked for.
    pub metrics: Option<SocketAddr>,
    child: Child,
    /// How it was started, to start it again (`restart`).
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    log: PathBuf,
}

/// Runs a sidecar's command line, its stderr into `log`, `RUST_LOG` warn
/// unless set, and its runtime workers as [`sidecar_workers`] says.
fn launch(mut cmd: Command, log: std::fs::File) -> std::io::Result<Child> {
    cmd.env(
        "RUST_LOG",
        std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
    );
    if let Some(n) = sidecar_workers(
        std::env::var_os("TOKIO_WORKER_THREADS").is_some(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    ) {
        cmd.env("TOKIO_WORKER_THREADS", n.to_string());
    }
    cmd.stdout(Stdio::null()).stderr(log).spawn()
}

/// Runtime workers for each of a cluster's sidecars, where loadgen picks
/// them. Both sidecars share this machine where two nodes would each have
/// their own: from 8 cores up each gets a worker per two cores, as each side
/// of the raw floors (`quic-floor`) has a thread per two cores. With a
/// worker per core each, the two sidecars' 2x oversubscribed workers moved
/// 10-20% less over QUIC at 8 and 16 connections on the 16-core machine, TCP
/// and the ring's latency the same (docs/benchmarks.md#sidecar-workers-16core).
/// Below 8 cores, and where `TOKIO_WORKER_THREADS` is set, the runtime's own
/// default (one per core, or that variable).
fn sidecar_workers(set_by_caller: bool, cores: usize) -> Option<usize> {
    (!set_by_caller && cores >= 8).then_some(cores / 2)
}

impl SidecarProcess {
    /// Runs `cmd` (a sidecar's full command line, `--socket socket` among
    /// it), its stderr into `log` (at `log_path`), `RUST_LOG` warn unless set.
    pub fn spawn(
        node: &str,
        socket: PathBuf,
        metrics: Option<SocketAddr>,
        cmd: Command,
        log: std::fs::File,
        log_path: PathBuf,
    ) -> anyhow::Result<SidecarProcess> {
        let program = cmd.get_program().to_os_string();
        let args: Vec<std::ffi::OsString> = cmd.get_args().map(|a| a.to_os_string()).collect();
        let child = launch(cmd, log).context("start a sidecar process")?;
        Ok(SidecarProcess {
            node: node.into(),
            socket,
            metrics,
            child,
            program,
            args,
            log: log_path,
        })
    }

    /// Whether it answers on its socket now; an error with its log if it exited.
    pub async fn answers(&mut self) -> anyhow::Result<bool> {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            bail!("sidecar {} exited ({status}):\n{log}", self.node);
        }
        Ok(match Client::connect(&self.socket).await {
            Ok(mut c) => c.list_peers().await.is_ok(),
            Err(_) => false,
        })
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The process id, for reading its CPU time.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it (SIGKILL) and starts it again with the same flags, at once.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        self.child = launch(cmd, log).context("restart a sidecar process")?;
        Ok(())
    }

    /// The rail addresses it listens on (its `--listen` flags).
    pub fn listen_addrs(&self) -> Vec<String> {
        self.args
            .windows(2)
            .filter(|w| w[0] == "--listen")
            .map(|w| w[1].to_string_lossy().into_owned())
            .collect()
    }

    /// Sends `signal` (e.g. "STOP", "CONT") to the process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()?
            .success();
        if !ok {
            bail!("kill -{signal} {} failed", self.pid());
        }
        Ok(())
    }

    /// Whether the process still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        if !self.is_running() {
            return;
        }
        let _ = self.signal("CONT");
        let profiling = ["KVRAIL_PROFILE", "KVRAIL_TRACE"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        if profiling && self.signal("TERM").is_ok() {
            // A profiling sidecar writes its profile or trace as it shuts down.
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The two nodes of a local cluster: `prefill` and `decode`.
pub struct LocalCluster {
    pub prefill: SidecarProcess,
    pub decode: SidecarProcess,
    pub dir: tempfile::TempDir,
    /// Names of this run's files start with it (see [`SHM_FAMILY`]).
    prefix: String,
    /// Held while the run lives (see [`remove_stale_files`]).
    _run_lock: Option<std::fs::File>,
}

/// Options every sidecar of the cluster gets.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub connections_per_rail: usize,
    pub slice_bytes: u64,
    pub window_bytes: u64,
    /// Extra `kvrail serve` flags for both sidecars.
    pub extra_args: Vec<String>,
    /// A `kvrail` binary to run (`serve`); by default this binary (`sidecar`).
    pub kvrail_binary: Option<PathBuf>,
    /// Serve metrics on a loopback port (see [`LocalCluster::scrape`]).
    pub metrics: bool,
    /// Give both nodes certificates of a fresh cluster CA (`--tls-dir`): QUIC needs
    /// them and TCP handshakes are authenticated with them. Without: `--insecure`.
    pub tls: bool,
    /// `--transports` of both nodes, in order of preference (default `tcp`).
    pub transports: Vec<String>,
}

impl ClusterOptions {
    pub fn new(connections_per_rail: usize, slice_bytes: u64, window_bytes: u64) -> Self {
        Self {
            connections_per_rail,
            slice_bytes,
            window_bytes,
            extra_args: Vec::new(),
            kvrail_binary: None,
            metrics: false,
            tls: true,
            transports: vec!["tcp".into()],
        }
    }
}

/// Where the sidecars run: loopback ports, the first `rails` rails of a lab, or
/// given rail addresses of this host (e.g. the RDMA VM's two nodes).
enum Placement<'a> {
    Loopback,
    Lab { lab: &'a NetLab, rails: usize },
    Addresses { a: &'a [IpAddr], b: &'a [IpAddr] },
}

/// A port free on `ip` for both TCP and UDP (TCP and QUIC share a rail's port).
fn free_port_on(ip: IpAddr) -> anyhow::Result<u16> {
    for _ in 0..100 {
        let tcp = TcpListener::bind((ip, 0))?;
        let port = tcp.local_addr()?.port();
        if std::net::UdpSocket::bind((ip, port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no port on {ip} free for both TCP and UDP")
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    free_port_on(IpAddr::from([127, 0, 0, 1]))
}

impl LocalCluster {
    /// Two sidecars on loopback.
    pub async fn start(opts: &ClusterOptions) -> anyhow::Result<LocalCluster> {
        Self::start_at(opts, Placement::Loopback).await
    }

    /// Prefill in the lab's node A, decode in node B, joined by its first `rails` rails.
    pub async fn start_in_lab(
        opts: &ClusterOptions,
        lab: &NetLab,
        rails: usize,
    ) -> anyhow::Result<LocalCluster> {
        if rails == 0 || rails > lab.rails().len() {
            bail!("the lab has {} rails, not {rails}", lab.rails().len());
        }
        Self::start_at(opts, Placement::Lab { lab, rails }).await
    }

    /// Prefill listening on rail addresses `a`, decode on `b` (one per rail), in
    /// this host's namespace.
    pub async fn start_on(
        opts: &ClusterOptions,
        a: &[IpAddr],
        b: &[IpAddr],
    ) -> anyhow::Result<LocalCluster> {
        if a.is_empty() || a.len() != b.len() {
            bail!("both nodes need the same number (>= 1) of rail addresses");
        }
        Self::start_at(opts, Placement::Addresses { a, b }).await
    }

    async fn start_at(opts: &ClusterOptions, at: Placement<'_>) -> anyhow::Result<LocalCluster> {
        // What a loadgen killed outright (SIGKILL, the OOM killer) left: its
        // sidecars are gone with it (`--parent-pid`), its files are not.
        let prefix = new_run_prefix();
        let run_lock = lock_run(&prefix);
        if run_lock.is_none() {
            eprintln!("loadgen: cannot lock {prefix}lock in the shared-memory directory: a loadgen sweeping from another pid namespace may take this run's files");
        }
        remove_stale_files(
            &[&kvrail_client::shm_dir(), &std::env::temp_dir()],
            &kvrail_client::shm_dir(),
            SHM_FAMILY,
        );
        let dir = tempfile::Builder::new().prefix(&prefix).tempdir()?;
        let (exe, sub) = match &opts.kvrail_binary {
            Some(p) => (p.clone(), "serve"),
            None => (std::env::current_exe()?, "sidecar"),
        };
        // Per node: its rail addresses, and the command that runs it.
        const LAB_PORT: u16 = 7400;
        let addrs = |node: Node| -> anyhow::Result<Vec<String>> {
            Ok(match &at {
                Placement::Loopback => vec![format!("127.0.0.1:{}", free_port()?)],
                Placement::Lab { lab, rails } => (0..*rails)
                    .map(|r| format!("{}:{LAB_PORT}", lab.addr(node, r)))
                    .collect(),
                Placement::Addresses { a, b } => {
                    let ips = if node == Node::A { a } else { b };
                    ips.iter()
                        .map(|&ip| Ok(SocketAddr::new(ip, free_port_on(ip)?).to_string()))
                        .collect::<anyhow::Result<_>>()?
                }
            })
        };
        let (pa, da) = (addrs(Node::A)?, addrs(Node::B)?);
        let tls_dir = dir.path().join("tls");
        if opts.tls {
            let one_day = kvrail_auth::generate::Validity::days(1);
            kvrail_auth::generate::cluster(&tls_dir, &["prefill", "decode"], one_day)?;
        }
        let command = |node: Node| match &at {
            Placement::Loopback | Placement::Addresses { .. } => Command::new(&exe),
            Placement::Lab { lab, .. } => lab.command(node, &exe),
        };
        let spawn = |node: &str,
                     at: Node,
                     listen: &[String],
                     peer: &str,
                     peer_addrs: &[String]|
         -> anyhow::Result<SidecarProcess> {
            let socket = dir.path().join(format!("{node}.sock"));
            let log = std::fs::File::create(dir.path().join(format!("{node}.log")))?;
            let mut cmd = command(at);
            cmd.arg(sub).args(["--node", node]);
            // Gone with loadgen, however it ends.
            cmd.args(["--parent-pid", &std::process::id().to_string()]);
            let metrics = if opts.metrics {
                let addr = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), free_port()?);
                cmd.args(["--metrics-addr", &addr.to_string()]);
                Some(addr)
            } else {
                None
            };
            for l in listen {
                cmd.args(["--listen", l]);
            }
            if opts.tls {
                cmd.arg("--tls-dir").arg(&tls_dir);
            } else {
                cmd.arg("--insecure");
            }
            cmd.args(["--transports", &opts.transports.join(",")]);
            cmd.args(["--peer", &format!("{peer}={}", peer_addrs.join(","))])
                .args(&opts.extra_args)
                .arg("--socket")
                .arg(&socket)
                .args([
                    "--connections-per-rail",
                    &opts.connections_per_rail.to_string(),
                ])
                .args(["--slice-bytes", &opts.slice_bytes.to_string()])
                .args(["--window-bytes", &opts.window_bytes.to_string()]);
            SidecarProcess::spawn(
                node,
                socket,
                metrics,
                cmd,
                log,
                dir.path().join(format!("{node}.log")),
            )
        };
        let prefill = spawn("prefill", Node::A, &pa, "decode", &da)?;
        let decode = spawn("decode", Node::B, &da, "prefill", &pa)?;
        let cluster = LocalCluster {
            prefill,
            decode,
            dir,
            prefix,
            _run_lock: run_lock,
        };
        let mut cluster = cluster;
        cluster.wait_until_up().await?;
        Ok(cluster)
    }

    /// Waits until both sidecars answer; a sidecar that exits meanwhile (a
    /// flag it refused) is reported at once with its log.
    async fn wait_until_up(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut up = [false, false];
        loop {
            for (i, s) in [&mut self.prefill, &mut self.decode]
                .into_iter()
                .enumerate()
            {
                if up[i] {
                    continue;
                }
                if let Ok(Some(status)) = s.child.try_wait() {
                    let log = std::fs::read_to_string(&s.log).unwrap_or_default();
                    bail!("sidecar {} exited ({status}):\n{log}", s.node);
                }
                if let Ok(mut c) = Client::connect(&s.socket).await {
                    up[i] = c.list_peers().await.is_ok();
                }
            }
            if up == [true, true] {
                return Ok(());
            }
            if Instant::now() > deadline {
                let slow = if up[0] { &self.decode } else { &self.prefill };
                let log = std::fs::read_to_string(&slow.log).unwrap_or_default();
                bail!("sidecar {} did not come up within 30 s:\n{log}", slow.node);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A client of one sidecar, once it answers (30 s at most).
    pub async fn client(&self, s: &SidecarProcess) -> anyhow::Result<Client> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut c) = Client::connect(&s.socket).await {
                if c.list_peers().await.is_ok() {
                    return Ok(c);
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.path().join(format!("{}.log", s.node)))
                    .unwrap_or_default();
                bail!("sidecar {} did not come up:\n{log}", s.node);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The Prometheus text of a sidecar started with `metrics`.
    pub fn scrape(&self, s: &SidecarProcess) -> anyhow::Result<String> {
        let addr = s
            .metrics
            .with_context(|| format!("sidecar {} serves no metrics", s.node))?;
        crate::prometheus::fetch(addr)
    }

    /// A path for a shared-memory file (under /dev/shm when it exists).
    pub fn shm_path(&self, name: &str) -> PathBuf {
        let dir = kvrail_client::shm_dir();
        dir.join(format!("{}{name}", self.prefix))
    }
}

/// Names of a run's files: the family, the run's id (loadgen's process id,
/// a dot and a random token: pids repeat across pid namespaces that share a
/// directory, and within one as they are reused), a dash.
const SHM_FAMILY: &str = "kvrail-loadgen-";

pub(crate) fn new_run_prefix() -> String {
    format!(
        "{SHM_FAMILY}{}.{:08x}-",
        std::process::id(),
        rand::random::<u32>()
    )
}

/// Flags to open a lock file with: never through a link, never blocking (a
/// FIFO planted under the name), not inherited by the sidecars.
fn lock_open_flags() -> i32 {
    use rustix::fs::OFlags;
    (OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC).bits() as i32
}

/// Whether `file` is still what `path` names (a sweeper may have removed
/// the lock file between our open and our lock).
fn still_named(file: &std::fs::File, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Takes this run's lock, `{prefix}lock` in the shared-memory directory,
/// held for the run's life: another loadgen's sweep, in any pid namespace
/// that shares the directory, then leaves this run's files alone. `None`
/// if the directory cannot hold it (a sweep then goes by `/proc`).
fn lock_run(prefix: &str) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = kvrail_client::shm_dir().join(format!("{prefix}lock"));
    // A sweeper that took the file for a dead run's removes it: open anew.
    for _ in 0..3 {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(lock_open_flags())
            .open(&path)
            .ok()?;
        let locked =
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok();
        if locked && still_named(&file, &path) {
            return Some(file);
        }
    }
    None
}

/// Whether run `run` (process `pid`) is gone: by its lock `{family}{run}-lock`
/// in `lock_dir`, a regular file of this user's (free: gone; returned, to
/// hold while the run's files go), else by `/proc` (this pid namespace only).
fn run_gone(
    lock_dir: &std::path::Path,
    family: &str,
    run: &str,
    pid: u32,
    me: u32,
) -> (bool, Option<std::fs::File>) {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let lock = lock_dir.join(format!("{family}{run}-lock"));
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(lock_open_flags())
        .open(&lock);
    match opened {
        Ok(file) if file.metadata().is_ok_and(|m| m.is_file() && m.uid() == me) => {
            let free =
                rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                    .is_ok()
                    && still_named(&file, &lock);
            (free, free.then_some(file))
        }
        _ => (
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            None,
        ),
    }
}

/// Removes the entries of `dirs` named `{family}{run}-...` (`run`: a
/// process id, optionally `.` and a hex token) that belong to this user and
/// whose run is gone (see [`run_gone`]; best effort). A live run's, this
/// process's, another user's, and any other name are left alone; symbolic
/// links are removed, never followed.
pub fn remove_stale_files(dirs: &[&std::path::Path], lock_dir: &std::path::Path, family: &str) {
    use std::os::unix::fs::MetadataExt;
    let Ok(me) = std::fs::metadata("/proc/self").map(|m| m.uid()) else {
        return;
    };
    let mut runs: std::collections::HashMap<String, (bool, Option<std::fs::File>)> =
        Default::default();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(family)) else {
                continue;
            };
            let Some((run, _)) = rest.split_once('-') else {
                continue;
            };
            let (pid, token) = run.split_once('.').unwrap_or((run, ""));
            let Ok(pid) = pid.parse::<u32>() else {
                continue;
            };
            if !token.chars().all(|c| c.is_ascii_hexdigit()) {
                continue;
            }
            let Ok(meta) = e.path().symlink_metadata() else {
                continue;
            };
            if meta.uid() != me || pid == std::process::id() {
                continue;
            }
            let (gone, _) = runs
                .entry(run.to_string())
                .or_insert_with(|| run_gone(lock_dir, family, run, pid, me));
            if !*gone {
                continue;
            }
            let _ = if meta.is_dir() {
                std::fs::remove_dir_all(e.path())
            } else {
                std::fs::remove_file(e.path())
            };
        }
    }
}

impl Drop for LocalCluster {
    /// Removes the shared-memory files made for this run, also when it ends
    /// early (an error, Ctrl-C): each holds memory until removed.
    fn drop(&mut self) {
        remove_shm_files(&self.prefix);
    }
}

/// Removes the files of the shared-memory directory whose names start with
/// `prefix` (best effort: a file already gone is no error).
pub fn remove_shm_files(prefix: &str) {
    let Ok(entries) = std::fs::read_dir(kvrail_client::shm_dir()) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sidecars_sharing_a_large_machine_get_half_its_cores_each() {
        assert_eq!(sidecar_workers(false, 16), Some(8));
        assert_eq!(sidecar_workers(false, 9), Some(4));
        assert_eq!(sidecar_workers(false, 4), None);
        assert_eq!(sidecar_workers(true, 16), None);
    }

    /// Files and folders of a run that is gone go (its lock free, or no
    /// lock and no process); a run holding its lock keeps its files even
    /// when its pid is not seen here (another pid namespace); a FIFO planted
    /// as a lock does not hang the sweep; names outside the family, without
    /// a process id, or of this process stay.
    #[test]
    fn stale_files_of_a_dead_run_are_removed_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let dead_pid = || {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        let (dead, unlocked, held, fifo) = (dead_pid(), dead_pid(), dead_pid(), dead_pid());
        let me = std::process::id();
        let path = |name: String| dir.path().join(name);
        let dead_file = path(format!("{SHM_FAMILY}{dead}-p0"));
        let dead_dir = path(format!("{SHM_FAMILY}{dead}.0badf00d-tmp"));
        let unlocked_file = path(format!("{SHM_FAMILY}{unlocked}.00000001-p0"));
        let unlocked_lock = path(format!("{SHM_FAMILY}{unlocked}.00000001-lock"));
        let held_file = path(format!("{SHM_FAMILY}{held}.00000002-p0"));
        let held_lock = path(format!("{SHM_FAMILY}{held}.00000002-lock"));
        let fifo_file = path(format!("{SHM_FAMILY}{fifo}.00000003-p0"));
        let fifo_lock = path(format!("{SHM_FAMILY}{fifo}.00000003-lock"));
        let mine = path(format!("{SHM_FAMILY}{me}.00000004-p0"));
        let no_pid = path(format!("{SHM_FAMILY}x{dead}-p0"));
        let bad_token = path(format!("{SHM_FAMILY}{dead}.zz-p0"));
        let other = path(format!("kvrail-test-{dead}-p0"));
        for f in [
            &dead_file,
            &unlocked_file,
            &unlocked_lock,
            &held_file,
            &held_lock,
            &fifo_file,
            &mine,
            &no_pid,
            &bad_token,
            &other,
        ] {
            std::fs::write(f, b"kv").unwrap();
        }
        std::fs::create_dir(&dead_dir).unwrap();
        std::fs::write(dead_dir.join("prefill.log"), b"log").unwrap();
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo_lock)
            .status()
            .unwrap()
            .success());
        // A live run elsewhere holds its lock (its pid means nothing here).
        let holder = std::fs::OpenOptions::new()
            .write(true)
            .open(&held_lock)
            .unwrap();
        rustix::fs::flock(
            &holder,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )
        .unwrap();
        remove_stale_files(&[dir.path()], dir.path(), SHM_FAMILY);
        for gone in [
            &dead_file,
            &dead_dir,
            &unlocked_file,
            &unlocked_lock,
            &fifo_file,
        ] {
            assert!(!gone.exists(), "{} stayed", gone.display());
        }
        for kept in [&held_file, &held_lock, &mine, &no_pid, &bad_token, &other] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        drop(holder);
    }

    /// A run's prefix carries a token, and its lock is taken and held.
    #[test]
    fn each_run_locks_a_name_of_its_own() {
        let (a, b) = (new_run_prefix(), new_run_prefix());
        assert_ne!(a, b);
        let lock = lock_run(&a).expect("lock");
        let path = kvrail_client::shm_dir().join(format!("{a}lock"));
        let again = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert!(
            rustix::fs::flock(&again, rustix::fs::FlockOperation::NonBlockingLockExclusive)
                .is_err(),
            "the run's lock is not held"
        );
        remove_shm_files(&a);
        drop(lock);
    }
}
