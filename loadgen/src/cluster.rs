//! Starts two real sidecar processes on loopback (this binary re-run as
//! `loadgen sidecar ...`, the same code as `kvrail serve`) and connects to them.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::Client;

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
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl LocalCluster {
    pub async fn start(opts: &ClusterOptions) -> anyhow::Result<LocalCluster> {
        let dir = tempfile::tempdir()?;
        let exe = std::env::current_exe()?;
        let (pp, dp) = (free_port()?, free_port()?);
        let spawn =
            |node: &str, port: u16, peer: &str, peer_port: u16| -> anyhow::Result<SidecarProcess> {
                let socket = dir.path().join(format!("{node}.sock"));
                let log = std::fs::File::create(dir.path().join(format!("{node}.log")))?;
                let child = Command::new(&exe)
                    .arg("sidecar")
                    .args(["--node", node, "--listen", &format!("127.0.0.1:{port}")])
                    .args(["--peer", &format!("{peer}=127.0.0.1:{peer_port}")])
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
        let prefill = spawn("prefill", pp, "decode", dp)?;
        let decode = spawn("decode", dp, "prefill", pp)?;
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
