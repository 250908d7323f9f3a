//! A real etcd server on loopback for the membership tests (Debian's
//! `etcd-server`; `./quickstart deps test` installs it), with a temporary
//! data directory, and `etcdctl` to read and write its keys.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, skip_or_fail};

/// One `etcd` process; killed when dropped.
pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    pub client_port: u16,
    peer_port: u16,
    /// With TLS: the folder of its CA and certificates (see [`Etcd::start_tls`]).
    pub tls: Option<std::path::PathBuf>,
}

/// The etcd binary, if installed (`$KVRAIL_ETCD`, else `etcd` on PATH).
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVRAIL_ETCD") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    })
}

impl Etcd {
    /// Starts etcd and waits until it answers; None (after saying why, or
    /// failing under CI) when it is not installed.
    pub fn start(test: &str) -> Option<Etcd> {
        let mut etcd = Self::unstarted(test)?;
        etcd.spawn();
        Some(etcd)
    }

    /// Starts etcd serving clients over TLS at `https://localhost:PORT` and
    /// asking each for a certificate of its CA (`--client-cert-auth`). The
    /// CA and certificates are made in `DIR/tls` (kvrail's generator:
    /// `localhost` for etcd, `etcdctl`, and one per name in `clients`).
    pub fn start_tls(test: &str, clients: &[&str]) -> Option<Etcd> {
        let mut etcd = Self::unstarted(test)?;
        let tls = etcd.dir.path().join("tls");
        let mut names = vec!["localhost", "etcdctl"];
        names.extend(clients);
        kvrail_auth::generate::cluster(&tls, &names, kvrail_auth::generate::Validity::days(1))
            .expect("make etcd's certificates");
        etcd.tls = Some(tls);
        etcd.spawn();
        Some(etcd)
    }

    /// Its folder and ports, not running yet; None (after saying why, or
    /// failing under CI) when etcd is not installed.
    fn unstarted(test: &str) -> Option<Etcd> {
        if etcd_binary().is_none() {
            skip_or_fail(
                test,
                "no etcd binary (apt-get install etcd-server, or ./quickstart deps test)",
            );
            return None;
        }
        Some(Etcd {
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            client_port: free_port(),
            peer_port: free_port(),
            tls: None,
        })
    }

    /// The client URL sidecars are given.
    pub fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("https://localhost:{}", self.client_port),
            None => format!("http://127.0.0.1:{}", self.client_port),
        }
    }

    fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).expect("etcd log");
        let mut cmd = Command::new(etcd_binary().expect("etcd binary"));
        let listen = match &self.tls {
            Some(tls) => {
                cmd.arg("--cert-file")
                    .arg(tls.join("localhost.pem"))
                    .arg("--key-file")
                    .arg(tls.join("localhost.key"))
                    .arg("--trusted-ca-file")
                    .arg(tls.join("ca.pem"))
                    .arg("--client-cert-auth");
                format!("https://127.0.0.1:{}", self.client_port)
            }
            None => self.url(),
        };
        let child = cmd
            .args(["--name", "kvrail-test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &listen])
            .args(["--advertise-client-urls", &self.url()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kvrail-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        self.wait_healthy();
    }

    /// Polls etcd's `/health` until it says true (20 s at most).
    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.healthy() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy; its log:\n{}",
                std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) -> bool {
        if self.tls.is_some() {
            return Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(self.etcdctl_flags())
                .args(["endpoint", "health"])
                .output()
                .is_ok_and(|o| o.status.success());
        }
        loadgen::etcd_nodes::healthy(self.client_port)
    }

    /// A counter or gauge from etcd's Prometheus `/metrics` (0 if absent).
    pub fn metric(&self, name: &str) -> f64 {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return 0.0;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// Kills etcd (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd again on the same ports and data (after [`Etcd::kill`]).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a killed etcd only");
        self.spawn();
    }

    /// Runs `etcdctl args` against this etcd and returns its stdout; a
    /// failure fails the test with etcdctl's stderr.
    fn etcdctl(&self, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(self.etcdctl_flags())
            .args(args)
            .output()
            .expect("run etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn etcdctl_flags(&self) -> Vec<String> {
        let mut flags = vec![
            "--endpoints".to_string(),
            self.url(),
            "--command-timeout".into(),
            "5s".into(),
        ];
        if let Some(tls) = &self.tls {
            for (flag, file) in [
                ("--cacert", "ca.pem"),
                ("--cert", "etcdctl.pem"),
                ("--key", "etcdctl.key"),
            ] {
                flags.push(flag.into());
                flags.push(tls.join(file).display().to_string());
            }
        }
        flags
    }

    /// Keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.etcdctl(&["get", "--prefix", "--keys-only", prefix])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// The value of `key`, if any.
    pub fn get(&self, key: &str) -> Option<String> {
        let v = self.etcdctl(&["get", "--print-value-only", key]);
        let v = v.trim_end();
        (!v.is_empty()).then(|| v.to_string())
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &str) {
        self.etcdctl(&["del", key]);
    }

    /// Writes `value` under `key` (no lease: it stays).
    pub fn put(&self, key: &str, value: &str) {
        self.etcdctl(&["put", key, value]);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}
