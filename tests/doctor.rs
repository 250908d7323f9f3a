//! `kvrail doctor` on real network namespaces: two nodes, two rails (veth pairs
//! at MTU 9000), a real `kvrail serve` on node B. Healthy, doctor exits 0; then
//! faults are planted one at a time (an MTU mismatch, a second interface in a
//! rail's subnet, a link down, a peer speaking another protocol version) and
//! doctor must name each, with a fix, and exit 1. Needs root (CI has it); the
//! bond and RDMA checks run in the Soft-RoCE VM (tests/rdma.rs).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use kvrail_core::handshake::HandshakeError;
use kvrail_core::wire::{self, pb, Body, ErrorCode, PROTOCOL_VERSION};
use kvrail_e2e::binary;
use kvrail_transport::tcp::TcpTransport;
use kvrail_transport::{read_frame, Frame, Transport};
use loadgen::netlab::{self, NetLab, Node, RailShape};
use serde_json::Value;

const PORT: u16 = 7470;

fn lab() -> Option<NetLab> {
    if let Some(why) = netlab::unavailable() {
        kvrail_e2e::skip_or_fail("the doctor tests", &why);
        return None;
    }
    let shape = RailShape {
        rate: "10gbit".into(),
        delay: None,
    };
    let lab = NetLab::create(&[shape.clone(), shape]).unwrap();
    for node in [Node::A, Node::B] {
        for rail in 0..2 {
            lab.ip(
                node,
                &["link", "set", &NetLab::rail_dev(rail), "mtu", "9000"],
            )
            .unwrap();
        }
    }
    Some(lab)
}

fn rails(lab: &NetLab, node: Node) -> Vec<String> {
    (0..2)
        .map(|r| SocketAddr::new(lab.addr(node, r), PORT).to_string())
        .collect()
}

/// A sidecar process, killed and reaped when dropped.
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `kvrail serve` as node B, peer of A; returns once its API answers.
fn serve_b(lab: &NetLab, dir: &std::path::Path) -> Serving {
    let socket = dir.join("b.sock");
    let mut cmd = lab.command(Node::B, &binary("kvrail"));
    cmd.args(["serve", "--node", "b", "--insecure", "--socket"])
        .arg(&socket);
    for r in rails(lab, Node::B) {
        cmd.args(["--listen", &r]);
    }
    cmd.args(["--peer", &format!("a={}", rails(lab, Node::A).join(","))]);
    let log = std::fs::File::create(dir.join("b.log")).unwrap();
    let child = Serving(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    let rt = tokio::runtime::Runtime::new().unwrap();
    loop {
        let up = rt.block_on(async {
            match kvrail_client::Client::connect(&socket).await {
                Ok(mut c) => c.list_peers().await.is_ok(),
                Err(_) => false,
            }
        });
        if up {
            return child;
        }
        assert!(
            Instant::now() < deadline,
            "node B did not come up: {}",
            std::fs::read_to_string(dir.join("b.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs doctor as node A (peer B on both rails): exit code, JSON, table.
fn doctor_a(lab: &NetLab, peer_rails: &[String]) -> (i32, Value) {
    let mut cmd = lab.command(Node::A, &binary("kvrail"));
    cmd.args(["doctor", "--json", "--node", "a", "--insecure"]);
    for r in rails(lab, Node::A) {
        cmd.args(["--listen", &r]);
    }
    cmd.args(["--peer", &format!("b={}", peer_rails.join(","))]);
    cmd.args(["--probe-timeout-ms", "2000"]);
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "doctor printed no JSON ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), json)
}

/// Waits for the kernel to report a link's carrier after `ip link set up`
/// (veth carrier comes up asynchronously).
fn wait_until_up(lab: &NetLab, node: Node, dev: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = std::process::Command::new("ip")
            .args(["-n", lab.namespace(node), "-o", "link", "show", dev])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&out.stdout).contains("state UP") {
            return;
        }
        assert!(Instant::now() < deadline, "{dev} did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn findings<'a>(json: &'a Value, status: &str) -> Vec<&'a Value> {
    json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["status"] == status)
        .collect()
}

/// The failures of `check` on `rail`.
fn failed<'a>(json: &'a Value, check: &str, rail: u64) -> Vec<&'a Value> {
    findings(json, "fail")
        .into_iter()
        .filter(|f| f["check"] == check && f["rail"] == rail)
        .collect()
}

#[test]
fn doctor_passes_a_healthy_pair_and_names_each_planted_fault() {
    let Some(lab) = lab() else { return };
    let dir = tempfile::tempdir().unwrap();
    let _b = serve_b(&lab, dir.path());
    let b_rails = rails(&lab, Node::B);

    // Healthy: exit 0, both rails' peers reached with MTU 9000 at both ends.
    let (code, json) = doctor_a(&lab, &b_rails);
    assert!(findings(&json, "fail").is_empty(), "{json:#}");
    assert_eq!(code, 0, "{json:#}");
    let peers: Vec<&Value> = findings(&json, "ok")
        .into_iter()
        .filter(|f| f["check"] == "peer")
        .collect();
    assert_eq!(peers.len(), 2, "{json:#}");
    for p in peers {
        let d = p["detail"].as_str().unwrap();
        assert!(
            d.contains("handshake ok") && d.contains("MTU 9000 both ends"),
            "{d}"
        );
    }

    // 1. MTU mismatch: B's end of rail 0 at 1500.
    lab.ip(Node::B, &["link", "set", "rail0", "mtu", "1500"])
        .unwrap();
    let (code, json) = doctor_a(&lab, &b_rails);
    assert_eq!(code, 1, "{json:#}");
    let f = failed(&json, "peer", 0);
    assert_eq!(f.len(), 1, "{json:#}");
    assert!(
        f[0]["detail"]
            .as_str()
            .unwrap()
            .contains("MTU 9000 here and 1500"),
        "{json:#}"
    );
    assert!(f[0]["fix"].as_str().unwrap().contains("mtu 9000"));
    lab.ip(Node::B, &["link", "set", "rail0", "mtu", "9000"])
        .unwrap();

    // 2. A second interface of A with an address in rail 0's subnet (the DGX
    // Spark "two ports in one /24" mistake).
    let stray = format!("st{}", std::process::id() % 100_000);
    lab.ip(
        Node::A,
        &[
            "link", "add", &stray, "type", "veth", "peer", "name", "stray1",
        ],
    )
    .unwrap();
    lab.ip(Node::A, &["addr", "add", "10.77.0.50/24", "dev", &stray])
        .unwrap();
    lab.ip(Node::A, &["link", "set", &stray, "up"]).unwrap();
    lab.ip(Node::A, &["link", "set", "stray1", "up"]).unwrap();
    let (code, json) = doctor_a(&lab, &b_rails);
    assert_eq!(code, 1, "{json:#}");
    let f = failed(&json, "subnet", 0);
    assert_eq!(f.len(), 1, "{json:#}");
    let d = f[0]["detail"].as_str().unwrap();
    assert!(d.contains(&stray) && d.contains("10.77.0.50"), "{d}");
    assert!(f[0]["fix"].as_str().unwrap().contains("own subnet"));
    lab.ip(Node::A, &["link", "del", &stray]).unwrap();

    // 3. Rail 1 down at A's end: the link check and rail 1's probe fail, rail 0
    // stays healthy.
    lab.ip(Node::A, &["link", "set", "rail1", "down"]).unwrap();
    let (code, json) = doctor_a(&lab, &b_rails);
    assert_eq!(code, 1, "{json:#}");
    let f = failed(&json, "link", 1);
    assert_eq!(f.len(), 1, "{json:#}");
    assert_eq!(f[0]["fix"], "ip link set rail1 up");
    assert_eq!(failed(&json, "peer", 1).len(), 1, "{json:#}");
    assert!(failed(&json, "peer", 0).is_empty(), "{json:#}");
    lab.ip(Node::A, &["link", "set", "rail1", "up"]).unwrap();
    wait_until_up(&lab, Node::A, "rail1");

    // Repaired: healthy again.
    let (code, json) = doctor_a(&lab, &b_rails);
    assert_eq!(code, 0, "{json:#}");
}

/// A peer that speaks the next protocol version refuses our hello the way the
/// handshake does (its `HandshakeError::Version`); doctor shows the skew.
#[tokio::test(flavor = "multi_thread")]
async fn doctor_shows_a_peer_on_another_protocol_version() {
    let mut listener = TcpTransport
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let newer = u32::from(PROTOCOL_VERSION) + 1;
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let Ok(Frame::Control(Body::Hello(hello))) = read_frame(conn.reader.as_mut()).await
            else {
                continue;
            };
            let refusal = HandshakeError::Version {
                theirs: hello.protocol_version,
                ours: newer,
            };
            let abort = wire::message(Body::Abort(pb::Abort {
                transfer_id: 0,
                code: ErrorCode::Protocol as i32,
                message: refusal.to_string(),
            }));
            let _ = conn
                .writer
                .write_control(&wire::encode_control(&abort))
                .await;
        }
    });
    let out = tokio::process::Command::new(binary("kvrail"))
        .args(["doctor", "--node", "a", "--insecure", "--no-rdma"])
        .args(["--listen", "127.0.0.1:7470", "--peer"])
        .arg(format!("b={addr}"))
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{table}");
    let line = table
        .lines()
        .find(|l| l.starts_with("FAIL") && l.contains("peer"))
        .unwrap_or_else(|| panic!("no failed peer line:\n{table}"));
    assert!(
        line.contains(&format!("this sidecar speaks {newer}")) && line.contains("version skew"),
        "{line}"
    );
    assert!(
        table.contains("run the same kvrail release on every node"),
        "{table}"
    );
}
