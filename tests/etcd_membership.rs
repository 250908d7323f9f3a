//! Sidecars that find each other through a real etcd (on loopback, a
//! temporary data directory): join, leave, lease expiry after `kill -9`,
//! etcd killed and restarted, a sidecar cut off from etcd, a node restarted
//! under its name, and a record naming another certificate. Each transfer
//! ends done and verified, or failed with a reason; none hangs.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::etcd::Etcd;
use kvrail_e2e::{free_port, shm_path, Sidecar};
use kvrail_examples::{fill, verify};

/// Lease of the test sidecars' records: a killed one is gone this long after.
const TTL_S: u64 = 2;

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A sidecar registered in `etcd` under `prefix`, no static peers.
fn member(dir: &Path, etcd_url: &str, prefix: &str, node: &str, extra: &[&str]) -> Sidecar {
    let mut args: Vec<String> = ["--etcd", etcd_url, "--etcd-prefix", prefix]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !extra.contains(&"--etcd-lease-ttl-s") {
        args.extend(["--etcd-lease-ttl-s".to_string(), TTL_S.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    if !extra.contains(&"--tls-dir") {
        args.push("--insecure".into());
    }
    Sidecar::start(
        dir,
        node,
        &[loopback(free_port())],
        Some(loopback(free_port())),
        &args,
    )
}

/// The peers `s` knows, sorted, each with whether it holds a connection.
async fn peers(s: &Sidecar) -> Vec<(String, bool)> {
    let mut c = s.client().await;
    let mut v: Vec<(String, bool)> = c
        .list_peers()
        .await
        .unwrap()
        .peers
        .into_iter()
        .map(|p| (p.name, p.connected))
        .collect();
    v.sort();
    v
}

async fn peer_names(s: &Sidecar) -> Vec<String> {
    peers(s).await.into_iter().map(|(n, _)| n).collect()
}

/// Waits until `s` knows exactly `want`; how long that took.
async fn wait_peers(s: &Sidecar, want: &[&str], limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let names = peer_names(s).await;
        if names == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{} knows {names:?} after {limit:?}, expected {want:?}; its log ends:\n{}",
            s.node,
            s.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Two regions of 2 layers x K,V x 16 blocks x 16 KiB (1 MiB), one on each
/// side, registered; a push of all their blocks from `from` to `to`. The
/// bytes verified, or the failure as text.
async fn push_verified(from: &Sidecar, to: &Sidecar, tag: &str, seed: u8) -> Result<u64, String> {
    let mut a = from.client().await;
    let mut b = to.client().await;
    push_with(&mut a, &mut b, from, to, tag, seed, 16).await
}

#[allow(clippy::too_many_arguments)]
async fn push_with(
    a: &mut Client,
    b: &mut Client,
    from: &Sidecar,
    to: &Sidecar,
    tag: &str,
    seed: u8,
    num_blocks: u32,
) -> Result<u64, String> {
    let layout = dense_layout(2, 2, num_blocks, 16384);
    let src = KvRegion::create(shm_path(from.listen.port(), &format!("{tag}-src")), layout)
        .map_err(|e| e.to_string())?;
    let dst = KvRegion::create(shm_path(to.listen.port(), &format!("{tag}-dst")), layout)
        .map_err(|e| e.to_string())?;
    let result = async {
        let ra = a
            .register_region(&format!("{tag}-w"), &src, true)
            .await
            .map_err(|e| e.to_string())?;
        let rb = b
            .register_region(&format!("{tag}-w"), &dst, true)
            .await
            .map_err(|e| e.to_string())?;
        let ids: Vec<u32> = (0..num_blocks).collect();
        fill(&src, seed.into(), 0..2, &ids).map_err(|e| e.to_string())?;
        let t = a
            .push(
                &format!("{tag}-w"),
                tag,
                &to.node,
                blocks(ra, 0..2, ids.clone()),
                blocks(rb, 0..2, ids.clone()),
            )
            .await
            .map_err(|e| e.to_string())?;
        let s = a
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await
            .map_err(|e| e.to_string())?;
        if s.state != TransferState::Done as i32 {
            return Err(format!(
                "transfer ended {:?}: {:?}",
                TransferState::try_from(s.state),
                s.failure
            ));
        }
        verify(&dst, seed.into(), 0..2, &ids).map_err(|e| e.to_string())
    }
    .await;
    src.unlink();
    dst.unlink();
    result
}

fn prefix(test: &str) -> String {
    format!("/kvrail-test/{}/{test}", std::process::id())
}

#[tokio::test(flavor = "multi_thread")]
async fn sidecars_find_each_other_in_etcd_and_connect_only_to_peers_they_use() {
    let Some(etcd) = Etcd::start("sidecars_find_each_other_in_etcd") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("join");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &[]);
    let b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    let c = member(dir.path(), &etcd.url(), &prefix, "c", &[]);
    for (s, others) in [(&a, ["b", "c"]), (&b, ["a", "c"]), (&c, ["a", "b"])] {
        let took = wait_peers(s, &others, Duration::from_secs(5)).await;
        println!("{} found {others:?} in {took:?}", s.node);
    }
    // Each record says where the node is and which process it is.
    let record: serde_json::Value =
        serde_json::from_str(&etcd.get(&format!("{prefix}/nodes/b")).unwrap()).unwrap();
    assert_eq!(record["node"], "b");
    assert_eq!(record["rails"][0], b.listen.to_string());
    assert_ne!(record["incarnation"], 0);
    // Nobody connected at start: peers are dialed on first use.
    assert!(peers(&a).await.iter().all(|(_, connected)| !connected));
    assert_eq!(push_verified(&a, &b, "a-to-b", 3).await, Ok(1 << 20));
    assert_eq!(push_verified(&c, &a, "c-to-a", 4).await, Ok(1 << 20));
    // a holds connections to b (dialed) and c (accepted); b only to a; c only to a.
    assert_eq!(
        peers(&b).await,
        [("a".to_string(), true), ("c".to_string(), false)]
    );
    assert_eq!(
        peers(&c).await,
        [("a".to_string(), true), ("b".to_string(), false)]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_sidecar_leaves_at_once_and_a_killed_one_when_its_lease_expires() {
    let Some(etcd) = Etcd::start("a_stopped_sidecar_leaves") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("leave");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &[]);
    let mut b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    let mut c = member(dir.path(), &etcd.url(), &prefix, "c", &[]);
    wait_peers(&a, &["b", "c"], Duration::from_secs(5)).await;
    assert_eq!(push_verified(&a, &b, "before", 1).await, Ok(1 << 20));

    // A graceful stop deletes the record: gone well before the lease's TTL.
    let stopped = Instant::now();
    b.terminate();
    let took = wait_peers(&a, &["c"], Duration::from_secs(TTL_S)).await;
    println!(
        "a saw b leave {took:?} after SIGTERM ({:?} since)",
        stopped.elapsed()
    );
    assert!(!etcd.keys(&prefix).iter().any(|k| k.ends_with("/nodes/b")));
    let err = a
        .client()
        .await
        .push(
            "w",
            "to-b",
            "b",
            blocks(1, 0..1, vec![0]),
            blocks(1, 0..1, vec![0]),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not registered in etcd"), "{err}");

    // kill -9 mid-transfer: the transfer fails with a reason; the record
    // goes with the lease.
    let mut ca = a.client().await;
    let mut cc = c.client().await;
    let layout = dense_layout(2, 2, 2048, 65536); // 512 MiB
    let src = KvRegion::create(shm_path(a.listen.port(), "big-src"), layout).unwrap();
    let dst = KvRegion::create(shm_path(c.listen.port(), "big-dst"), layout).unwrap();
    let ra = ca.register_region("big", &src, true).await.unwrap();
    let rc = cc.register_region("big", &dst, true).await.unwrap();
    let ids: Vec<u32> = (0..2048).collect();
    // Connected first, then frozen: the transfer starts on the session and
    // cannot finish before the kill.
    assert_eq!(push_verified(&a, &c, "connect", 2).await, Ok(1 << 20));
    c.signal("STOP");
    let t = ca
        .push(
            "big",
            "doomed",
            "c",
            blocks(ra, 0..2, ids.clone()),
            blocks(rc, 0..2, ids),
        )
        .await
        .unwrap();
    let killed = Instant::now();
    c.kill();
    let s = ca
        .wait(t.transfer_id, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Failed as i32, "{s:?}");
    let failure = s.failure.unwrap();
    assert!(!failure.message.is_empty(), "{failure:?}");
    println!(
        "the transfer to the killed c failed after {:?}: {failure:?}",
        killed.elapsed()
    );
    let took = wait_peers(&a, &[], Duration::from_secs(3 * TTL_S + 5)).await;
    println!(
        "a dropped the killed c {:?} after the kill (lease {TTL_S} s)",
        killed.elapsed().max(took)
    );
    assert!(etcd.keys(&prefix).iter().all(|k| k.ends_with("/nodes/a")));
    src.unlink();
    dst.unlink();
}

#[tokio::test(flavor = "multi_thread")]
async fn sidecars_keep_serving_known_peers_while_etcd_is_down_and_register_again() {
    let Some(mut etcd) = Etcd::start("sidecars_keep_serving_known_peers") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("etcd-restart");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &[]);
    let b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    etcd.kill();
    // Known peers stay known and served, connected before or not.
    assert_eq!(push_verified(&a, &b, "down-1", 5).await, Ok(1 << 20));
    assert_eq!(push_verified(&b, &a, "down-2", 6).await, Ok(1 << 20));
    assert_eq!(peer_names(&a).await, ["b"]);
    etcd.restart();
    // Both register again (their leases may have expired meanwhile).
    eventually(
        Duration::from_secs(20),
        || etcd.keys(&prefix).len() == 2,
        || format!("after etcd's restart: {:?}", etcd.keys(&prefix)),
    )
    .await;
    // A newcomer after the restart is found by both.
    let c = member(dir.path(), &etcd.url(), &prefix, "c", &[]);
    wait_peers(&a, &["b", "c"], Duration::from_secs(10)).await;
    wait_peers(&b, &["a", "c"], Duration::from_secs(10)).await;
    assert_eq!(push_verified(&c, &b, "after", 7).await, Ok(1 << 20));
}

/// A TCP relay to etcd that can be cut: a sidecar behind it loses etcd
/// while everything else keeps it.
struct Relay {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(to: u16) -> Relay {
        let listener = tokio::net::TcpListener::bind(loopback(0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                conns.spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(loopback(to)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
            }
        });
        Relay { port, task }
    }

    /// Drops every relayed connection and stops accepting.
    fn cut(&self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_cut_off_from_etcd_keeps_its_sessions_and_comes_back() {
    let Some(etcd) = Etcd::start("a_sidecar_cut_off_from_etcd") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("cut-off");
    let relay = Relay::start(etcd.client_port).await;
    let relayed = format!("http://127.0.0.1:{}", relay.port);
    let a = member(dir.path(), &relayed, &prefix, "a", &[]);
    let b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    wait_peers(&b, &["a"], Duration::from_secs(5)).await;
    let mut ca = a.client().await;
    let mut cb = b.client().await;
    assert_eq!(
        push_with(&mut ca, &mut cb, &a, &b, "warm", 1, 16).await,
        Ok(1 << 20)
    );
    relay.cut();
    // a keeps pushing over its session to b all along: before b notices, as
    // its record expires, and after b has dropped it from its peers.
    let cut = Instant::now();
    let mut pushes = 0;
    let mut seen_gone_at = None;
    while seen_gone_at.is_none_or(|t: Instant| t.elapsed() < Duration::from_secs(1)) {
        let tag = format!("cut-{pushes}");
        assert_eq!(
            push_with(&mut ca, &mut cb, &a, &b, &tag, pushes as u8, 64).await,
            Ok(4 << 20),
            "push {pushes}, {:?} after the cut",
            cut.elapsed()
        );
        pushes += 1;
        if seen_gone_at.is_none() && peer_names(&b).await.is_empty() {
            seen_gone_at = Some(Instant::now());
            println!("b dropped a {:?} after a lost etcd", cut.elapsed());
        }
        assert!(cut.elapsed() < Duration::from_secs(30), "b never dropped a");
    }
    println!("{pushes} verified pushes from a while it was cut off from etcd");
    // New work towards a is refused by name while it is not registered.
    let err = cb
        .push(
            "w",
            "to-a",
            "a",
            blocks(1, 0..1, vec![0]),
            blocks(1, 0..1, vec![0]),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not registered in etcd"), "{err}");
    // a still knows b (it kept its view) and never stopped serving.
    assert_eq!(peer_names(&a).await, ["b"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_restarted_under_its_name_is_a_new_process_and_the_old_one_is_refused() {
    let Some(etcd) = Etcd::start("a_node_restarted_under_its_name") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("restart");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &[]);
    let old_b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    assert_eq!(push_verified(&old_b, &a, "old", 1).await, Ok(1 << 20));
    let key = format!("{prefix}/nodes/b");
    let old_record = etcd.get(&key).unwrap();
    // The old process hangs (its lease runs out); a new one takes the name
    // on other rails once the old record is gone.
    old_b.signal("STOP");
    // Its own folder: the old one still holds b.sock.
    let new_dir = dir.path().join("new");
    std::fs::create_dir(&new_dir).unwrap();
    let new_b = member(&new_dir, &etcd.url(), &prefix, "b", &[]);
    eventually(
        Duration::from_secs(20),
        || etcd.get(&key).is_some_and(|r| r != old_record),
        || format!("the new b never registered:\n{}", new_b.log_tail(20)),
    )
    .await;
    wait_until_logged(&a, "peer restarted").await;
    assert_eq!(push_verified(&new_b, &a, "new", 2).await, Ok(1 << 20));
    assert_eq!(push_verified(&a, &new_b, "to-new", 3).await, Ok(1 << 20));
    // The old process wakes up: its sessions are refused, it cannot take
    // the name back, and transfers through it fail with the reason.
    old_b.signal("CONT");
    let err = push_verified(&old_b, &a, "zombie", 4).await.unwrap_err();
    assert!(
        err.contains("restarted") || err.contains("refused") || err.contains("closed"),
        "{err}"
    );
    wait_until_logged(&old_b, "holds this node's name").await;
    assert_ne!(etcd.get(&key).unwrap(), old_record);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sidecar_restarted_on_its_rails_takes_its_record_over_at_once() {
    let Some(etcd) = Etcd::start("a_sidecar_restarted_on_its_rails") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("same-rails");
    // A long lease: the old record would stay 60 s; the restart must not wait for it.
    let long = ["--etcd-lease-ttl-s", "60"];
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &long);
    let mut b = member(dir.path(), &etcd.url(), &prefix, "b", &long);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    assert_eq!(push_verified(&a, &b, "first", 1).await, Ok(1 << 20));
    let key = format!("{prefix}/nodes/b");
    let old_record = etcd.get(&key).unwrap();
    b.kill();
    let restarted = Instant::now();
    b.restart();
    eventually(
        Duration::from_secs(10),
        || etcd.get(&key).is_some_and(|r| r != old_record),
        || {
            format!(
                "the restarted b did not replace its record:\n{}",
                b.log_tail(20)
            )
        },
    )
    .await;
    println!(
        "the restarted b replaced its record {:?} after starting",
        restarted.elapsed()
    );
    wait_until_logged(&a, "peer restarted").await;
    wait_until_logged(&b, "replacing the record of this node's previous process").await;
    assert_eq!(push_verified(&a, &b, "second", 2).await, Ok(1 << 20));
    assert_eq!(push_verified(&b, &a, "back", 3).await, Ok(1 << 20));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_deleted_by_hand_is_written_again() {
    let Some(etcd) = Etcd::start("a_record_deleted_by_hand") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = prefix("deleted");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &[]);
    let b = member(dir.path(), &etcd.url(), &prefix, "b", &[]);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    let key = format!("{prefix}/nodes/b");
    let record = etcd.get(&key).unwrap();
    etcd.delete(&key);
    let took = eventually(
        Duration::from_secs(10),
        || etcd.get(&key).as_ref() == Some(&record),
        || format!("b did not register again:\n{}", b.log_tail(10)),
    )
    .await;
    println!("b wrote its deleted record again after {took:?}");
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    assert_eq!(push_verified(&a, &b, "after", 1).await, Ok(1 << 20));
}

async fn wait_until_logged(s: &Sidecar, text: &str) {
    eventually(
        Duration::from_secs(20),
        || s.log().contains(text),
        || {
            format!(
                "{} never logged {text:?}; its log ends:\n{}",
                s.node,
                s.log_tail(20)
            )
        },
    )
    .await;
}

/// Polls `done` every 20 ms until it holds and returns how long that took;
/// fails with `why()` once `limit` has passed.
async fn eventually(
    limit: Duration,
    mut done: impl FnMut() -> bool,
    why: impl Fn() -> String,
) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{}", why());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_naming_another_certificate_is_refused_both_ways() {
    let Some(etcd) = Etcd::start("a_record_naming_another_certificate") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    kvrail_auth::generate::cluster(
        &certs,
        &["a", "b"],
        kvrail_auth::generate::Validity::days(1),
    )
    .unwrap();
    let tls = certs.display().to_string();
    let prefix = prefix("fingerprint");
    let a = member(dir.path(), &etcd.url(), &prefix, "a", &["--tls-dir", &tls]);
    let b = member(dir.path(), &etcd.url(), &prefix, "b", &["--tls-dir", &tls]);
    wait_peers(&a, &["b"], Duration::from_secs(5)).await;
    assert_eq!(push_verified(&a, &b, "honest", 1).await, Ok(1 << 20));
    // The record names b's certificate.
    let key = format!("{prefix}/nodes/b");
    let mut record: serde_json::Value = serde_json::from_str(&etcd.get(&key).unwrap()).unwrap();
    let der = |node: &str| {
        let files = kvrail_auth::IdentityFiles::in_dir(&certs, node);
        kvrail_auth::Identity::load(node, &files)
            .unwrap()
            .certificate()
            .to_vec()
    };
    assert_eq!(
        record["cert_sha256"],
        kvrail_auth::certificate_sha256(&der("b"))
    );
    // Someone who can write to etcd points b's record at another certificate
    // (a's, valid for the CA but not b's).
    record["cert_sha256"] = kvrail_auth::certificate_sha256(&der("a")).into();
    etcd.put(&key, &record.to_string());
    wait_until_logged(&a, "membership: peer moved").await;
    // a's new sessions to b are refused: b presents its own certificate.
    let err = push_verified(&a, &b, "forged-out", 2).await.unwrap_err();
    assert!(err.contains("is not the one its record names"), "{err}");
    // And b's new sessions to a are refused by a, which expects the other one.
    let err = push_verified(&b, &a, "forged-in", 3).await.unwrap_err();
    assert!(
        err.contains("refused") || err.contains("record"),
        "{err}\na:\n{}\nb:\n{}",
        a.log_tail(15),
        b.log_tail(15)
    );
    assert!(
        a.log().contains("is not the one its record names"),
        "{}",
        a.log_tail(20)
    );
}

/// etcd serving over TLS and asking every client for a certificate of its CA
/// (`--client-cert-auth`): sidecars given etcd's CA and their client
/// certificates register and find each other; one that shows no
/// certificate, and one that trusts another CA, do not get in, say why, and
/// keep trying.
#[tokio::test(flavor = "multi_thread")]
async fn membership_over_tls_with_client_certificates() {
    let Some(etcd) = Etcd::start_tls("membership over TLS", &["a", "b"]) else {
        return;
    };
    let tls = etcd.tls.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = "/kvrail/tls";
    let path = |f: &str| tls.join(f).display().to_string();
    let client = |n: &str| {
        vec![
            "--etcd-ca".to_string(),
            path("ca.pem"),
            "--etcd-cert".into(),
            path(&format!("{n}.pem")),
            "--etcd-key".into(),
            path(&format!("{n}.key")),
        ]
    };
    fn strs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let (fa, fb) = (client("a"), client("b"));
    let a = member(dir.path(), &etcd.url(), prefix, "a", &strs(&fa));
    let b = member(dir.path(), &etcd.url(), prefix, "b", &strs(&fb));
    wait_peers(&a, &["b"], Duration::from_secs(10)).await;
    wait_peers(&b, &["a"], Duration::from_secs(10)).await;
    assert_eq!(push_verified(&a, &b, "over-tls", 3).await, Ok(1 << 20));

    // No client certificate: etcd ends the handshake.
    let ca = path("ca.pem");
    let bare = member(dir.path(), &etcd.url(), prefix, "bare", &["--etcd-ca", &ca]);
    // Another cluster's CA: etcd's certificate is not trusted.
    let other = tempfile::tempdir().unwrap();
    kvrail_auth::generate::cluster(
        other.path(),
        &["x"],
        kvrail_auth::generate::Validity::days(1),
    )
    .unwrap();
    let other_ca = other.path().join("ca.pem").display().to_string();
    let stranger = member(
        dir.path(),
        &etcd.url(),
        prefix,
        "stranger",
        &["--etcd-ca", &other_ca],
    );
    wait_until_logged(&bare, "membership:").await;
    wait_until_logged(&stranger, "membership:").await;
    assert_eq!(
        etcd.keys(prefix),
        [format!("{prefix}/nodes/a"), format!("{prefix}/nodes/b")]
    );
    assert_eq!(peer_names(&a).await, ["b"]);
    println!(
        "without a client certificate: {}\nwith another CA: {}",
        bare.log_tail(1),
        stranger.log_tail(1)
    );
}
