//! Many sidecar processes on loopback that find each other through etcd (no
//! static peers): a real `etcd` started here (Debian's etcd-server) or one
//! given by URL, and N + M sidecars registered under a fresh cluster prefix.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::cluster::{free_port, new_run_prefix, SidecarProcess};

/// An `etcd` process on loopback, its data in a temporary directory; killed
/// when dropped.
pub struct EtcdProcess {
    pub url: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl EtcdProcess {
    /// Starts `etcd` from `PATH` and waits until it reports itself healthy.
    pub fn start() -> anyhow::Result<EtcdProcess> {
        let dir = tempfile::Builder::new().prefix("kvrail-etcd-").tempdir()?;
        let (client, peer) = (free_port()?, free_port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(["--name", "loadgen", "--data-dir"])
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("loadgen={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("start etcd (install etcd-server, or give --etcd URL)")?;
        let mut etcd = EtcdProcess {
            url,
            child,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !healthy(client) {
            if let Ok(Some(status)) = etcd.child.try_wait() {
                let log =
                    std::fs::read_to_string(etcd._dir.path().join("etcd.log")).unwrap_or_default();
                bail!("etcd exited ({status}):\n{log}");
            }
            if Instant::now() > deadline {
                bail!("etcd did not become healthy within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(etcd)
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether etcd on loopback `port` answers `GET /health` (plain http) with
/// health true.
pub fn healthy(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply.contains("\"health\":\"true\"")
}

/// `prefill` sidecars `p0..` and `decode` sidecars `d0..`, found through etcd.
pub struct EtcdNodes {
    pub prefill: Vec<SidecarProcess>,
    pub decode: Vec<SidecarProcess>,
    pub prefix: String,
    pub dir: tempfile::TempDir,
}

/// What every sidecar of an [`EtcdNodes`] gets.
pub struct NodeOptions {
    /// `kvrail serve`, or this binary's `sidecar`.
    pub program: (PathBuf, &'static str),
    pub etcd_url: String,
    pub connections_per_rail: usize,
    pub slice_bytes: u64,
    pub extra_args: Vec<String>,
}

impl EtcdNodes {
    /// Starts them all and waits until each answers and etcd lists them all.
    pub async fn start(
        prefill: usize,
        decode: usize,
        opts: &NodeOptions,
    ) -> anyhow::Result<EtcdNodes> {
        let run = new_run_prefix();
        let dir = tempfile::Builder::new().prefix(&run).tempdir()?;
        let cluster_prefix = format!("/kvrail/{}", run.trim_end_matches('-'));
        let names: Vec<String> = (0..prefill)
            .map(|i| format!("p{i}"))
            .chain((0..decode).map(|i| format!("d{i}")))
            .collect();
        let tls_dir = dir.path().join("tls");
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        kvrail_auth::generate::cluster(&tls_dir, &refs, kvrail_auth::generate::Validity::days(1))?;
        let mut started = Vec::new();
        for name in &names {
            let socket = dir.path().join(format!("{name}.sock"));
            let log_path = dir.path().join(format!("{name}.log"));
            let log = std::fs::File::create(&log_path)?;
            let mut cmd = Command::new(&opts.program.0);
            cmd.arg(opts.program.1)
                .args(["--node", name])
                .args(["--parent-pid", &std::process::id().to_string()])
                .args(["--listen", &format!("127.0.0.1:{}", free_port()?)])
                .arg("--tls-dir")
                .arg(&tls_dir)
                .args(["--etcd", &opts.etcd_url, "--etcd-prefix", &cluster_prefix])
                .args([
                    "--connections-per-rail",
                    &opts.connections_per_rail.to_string(),
                ])
                .args(["--slice-bytes", &opts.slice_bytes.to_string()])
                .args(&opts.extra_args)
                .arg("--socket")
                .arg(&socket);
            started.push(SidecarProcess::spawn(
                name, socket, None, cmd, log, log_path,
            )?);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for s in &mut started {
            while !s.answers().await? {
                if Instant::now() > deadline {
                    bail!(
                        "sidecar {} did not come up within 60 s:\n{}",
                        s.node,
                        s.log_tail(30)
                    );
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let decode_nodes = started.split_off(prefill);
        Ok(EtcdNodes {
            prefill: started,
            decode: decode_nodes,
            prefix: run,
            dir,
        })
    }

    /// A path for a shared-memory file of this run.
    pub fn shm_path(&self, name: &str) -> PathBuf {
        kvrail_client::shm_dir().join(format!("{}{name}", self.prefix))
    }
}
