//! Starts two real sidecar processes, on loopback or one per namespace of a
//! [`NetLab`] (this binary re-run as `loadgen sidecar ...`, the same code as
//! `kvrail serve`, or a given `kvrail` binary), and connects to them.

use std::net::TcpListener;
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
    child: Child,
}

impl Drop for SidecarProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The two nodes of a local cluster: `prefill` and `decode`.
pub struct LocalCluster {
    pub prefill: SidecarProcess,
    pub decode: SidecarProcess,
    pub dir: tempfile::TempDir,
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
}

impl ClusterOptions {
    pub fn new(connections_per_rail: usize, slice_bytes: u64, window_bytes: u64) -> Self {
        Self {
            connections_per_rail,
            slice_bytes,
            window_bytes,
            extra_args: Vec::new(),
            kvrail_binary: None,
        }
    }
}

/// Where the sidecars run: loopback ports, or the first `rails` rails of a lab.
enum Placement<'a> {
    Loopback,
    Lab { lab: &'a NetLab, rails: usize },
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
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

    async fn start_at(opts: &ClusterOptions, at: Placement<'_>) -> anyhow::Result<LocalCluster> {
        let dir = tempfile::tempdir()?;
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
            })
        };
        let (pa, da) = (addrs(Node::A)?, addrs(Node::B)?);
        let command = |node: Node| match &at {
            Placement::Loopback => Command::new(&exe),
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
            for l in listen {
                cmd.args(["--listen", l]);
            }
            let child = cmd
                .args(["--peer", &format!("{peer}={}", peer_addrs.join(","))])
                .args(&opts.extra_args)
                .arg("--socket")
                .arg(&socket)
                .args([
                    "--connections-per-rail",
                    &opts.connections_per_rail.to_string(),
                ])
                .args(["--slice-bytes", &opts.slice_bytes.to_string()])
                .args(["--window-bytes", &opts.window_bytes.to_string()])
                .env(
                    "RUST_LOG",
                    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
                )
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("start a sidecar process")?;
            Ok(SidecarProcess {
                node: node.into(),
                socket,
                child,
            })
        };
        let prefill = spawn("prefill", Node::A, &pa, "decode", &da)?;
        let decode = spawn("decode", Node::B, &da, "prefill", &pa)?;
        let cluster = LocalCluster {
            prefill,
            decode,
            dir,
        };
        cluster.client(&cluster.prefill).await?;
        cluster.client(&cluster.decode).await?;
        Ok(cluster)
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

    /// A path for a shared-memory file (under /dev/shm when it exists).
    pub fn shm_path(&self, name: &str) -> PathBuf {
        let dir = kvrail_client::shm_dir();
        dir.join(format!("kvrail-loadgen-{}-{name}", std::process::id()))
    }
}
