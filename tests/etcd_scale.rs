//! A hundred sidecar processes on this machine find each other through a
//! real etcd and move verified blocks between 50 random pairs; each one's
//! memory, threads and connections are reported, and each holds
//! connections only to the peers it exchanged blocks with.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::etcd::Etcd;
use kvrail_e2e::{free_port, shm_path, Sidecar};
use kvrail_examples::{fill, verify};

const SIDECARS: usize = 100;
const PAIRS: usize = 50;

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A field of /proc/PID/status (`VmRSS`, `Threads`), as its first number.
fn proc_status(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Open sockets of a process (its listeners, etcd, the API and peers).
fn sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A deterministic pseudo-random sequence (xorshift), seeded per run.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn report(line: &str) {
    // Past the harness's capture: the figures are the point of this test.
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_sidecars_discover_each_other_and_move_verified_blocks() {
    let Some(etcd) = Etcd::start("a_hundred_sidecars_discover_each_other") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = format!("/kvrail-test/{}/scale", std::process::id());
    let names: Vec<String> = (0..SIDECARS).map(|i| format!("s{i:03}")).collect();
    // Built (or found) before the clock starts.
    kvrail_e2e::binary("kvrail");
    let started = Instant::now();
    let sidecars: Vec<Sidecar> = names
        .iter()
        .map(|name| {
            let args: Vec<String> = [
                "--etcd",
                &etcd.url(),
                "--etcd-prefix",
                &prefix,
                "--insecure",
                "--no-rdma",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            Sidecar::start(dir.path(), name, &[loopback(free_port())], None, &args)
        })
        .collect();
    let spawned = started.elapsed();
    let mut clients: Vec<Client> = Vec::new();
    for s in &sidecars {
        clients.push(s.client().await);
    }
    // Every sidecar knows the 99 others.
    let mut waiting: BTreeSet<usize> = (0..SIDECARS).collect();
    while !waiting.is_empty() {
        let mut still = BTreeSet::new();
        for &i in &waiting {
            let peers = clients[i].list_peers().await.unwrap().peers;
            if peers.len() != SIDECARS - 1 {
                still.insert(i);
            }
        }
        waiting = still;
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{} sidecars still miss peers after 60 s (e.g. {:?}); its log ends:\n{}",
            waiting.len(),
            waiting.first().map(|i| &names[*i]),
            waiting
                .first()
                .map(|i| sidecars[*i].log_tail(10))
                .unwrap_or_default()
        );
        if !waiting.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let discovered = started.elapsed();
    report(&format!(
        "{SIDECARS} sidecars: processes started in {spawned:?}, every one knew the other {} after {discovered:?}",
        SIDECARS - 1
    ));
    assert!(
        discovered < Duration::from_secs(5) + spawned,
        "discovery took {discovered:?} ({spawned:?} of it starting processes)"
    );
    // No connection between sidecars yet: peers are dialed on first use.
    for (i, c) in clients.iter_mut().enumerate() {
        let connected = c
            .list_peers()
            .await
            .unwrap()
            .peers
            .iter()
            .filter(|p| p.connected)
            .count();
        assert_eq!(connected, 0, "{} connected before any transfer", names[i]);
    }

    // 50 random pairs, each a verified 1 MiB push.
    let seed = std::process::id() as u64 | 1;
    let mut rng = Rng(seed);
    let mut used: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    let layout = dense_layout(2, 2, 16, 16384);
    let moving = Instant::now();
    for n in 0..PAIRS {
        let from = rng.below(SIDECARS);
        let to = (from + 1 + rng.below(SIDECARS - 1)) % SIDECARS;
        let tag = format!("pair{n}");
        let src = KvRegion::create(shm_path(sidecars[from].listen.port(), &tag), layout).unwrap();
        let dst = KvRegion::create(shm_path(sidecars[to].listen.port(), &tag), layout).unwrap();
        let ids: Vec<u32> = (0..16).collect();
        fill(&src, n as u64, 0..2, &ids).unwrap();
        let rs = clients[from]
            .register_region(&tag, &src, true)
            .await
            .unwrap();
        let rd = clients[to].register_region(&tag, &dst, true).await.unwrap();
        let t = clients[from]
            .push(
                &tag,
                &tag,
                &names[to],
                blocks(rs, 0..2, ids.clone()),
                blocks(rd, 0..2, ids.clone()),
            )
            .await
            .unwrap();
        let s = clients[from]
            .wait(t.transfer_id, Some(Duration::from_secs(60)))
            .await
            .unwrap();
        assert_eq!(
            s.state,
            TransferState::Done as i32,
            "{} -> {}: {s:?}",
            names[from],
            names[to]
        );
        assert_eq!(verify(&dst, n as u64, 0..2, &ids).unwrap(), 1 << 20);
        clients[from].unregister_region(rs).await.unwrap();
        clients[to].unregister_region(rd).await.unwrap();
        src.unlink();
        dst.unlink();
        used.entry(from).or_default().insert(names[to].clone());
        used.entry(to).or_default().insert(names[from].clone());
    }
    report(&format!(
        "{PAIRS} random pairs (seed {seed}): every push verified, {:?} in all",
        moving.elapsed()
    ));

    // Per sidecar: memory, threads, sockets, and connected peers (only the
    // ones it exchanged blocks with).
    let mut rss = Vec::new();
    let mut threads = Vec::new();
    let mut socks = Vec::new();
    for (i, s) in sidecars.iter().enumerate() {
        let pid = s.pid();
        let peers = clients[i].list_peers().await.unwrap().peers;
        let connected: BTreeSet<String> = peers
            .iter()
            .filter(|p| p.connected)
            .map(|p| p.name.clone())
            .collect();
        let connections: u32 = peers
            .iter()
            .flat_map(|p| p.rail_status.iter())
            .map(|r| r.connections)
            .sum();
        let expected = used.get(&i).cloned().unwrap_or_default();
        assert!(
            connected.is_subset(&expected),
            "{} holds connections to {connected:?} but exchanged blocks only with {expected:?}",
            names[i]
        );
        let (r, t, k) = (
            proc_status(pid, "VmRSS"),
            proc_status(pid, "Threads"),
            sockets(pid),
        );
        report(&format!(
            "{}: rss {r} KiB, {t} threads, {k} sockets, {connections} peer connections to {} of {} peers {:?}",
            names[i],
            connected.len(),
            peers.len(),
            connected
        ));
        rss.push(r);
        threads.push(t);
        socks.push(k as u64);
    }
    let summary = |v: &mut Vec<u64>| {
        v.sort_unstable();
        (v[0], v[v.len() / 2], v[v.len() - 1])
    };
    report(&format!(
        "rss KiB min/median/max {:?}; threads {:?}; sockets {:?}",
        summary(&mut rss),
        summary(&mut threads),
        summary(&mut socks)
    ));
    // What the membership costs etcd: keys, watchers, the events it sent,
    // and lease renewals a second, measured over whole renewal periods: the
    // sidecars started within a second of each other, so their renewals come
    // in bursts, and a window of 1.5 periods counts one burst or two.
    let renewed = etcd.metric("etcd_debugging_lease_renewed_total");
    let sent = etcd.metric("etcd_network_client_grpc_sent_bytes_total");
    let received = etcd.metric("etcd_network_client_grpc_received_bytes_total");
    let window = Instant::now();
    // The lease is 10 s, renewed every 10/3 s: three periods.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let secs = window.elapsed().as_secs_f64();
    let renewals = (etcd.metric("etcd_debugging_lease_renewed_total") - renewed) / secs;
    let sent = (etcd.metric("etcd_network_client_grpc_sent_bytes_total") - sent) / secs;
    let received = (etcd.metric("etcd_network_client_grpc_received_bytes_total") - received) / secs;
    report(&format!(
        "etcd: {} keys, {} watchers, {} watch events sent since start; at rest {renewals:.1} lease renewals/s, {:.0} B/s received, {:.0} B/s sent",
        etcd.metric("etcd_debugging_mvcc_keys_total"),
        etcd.metric("etcd_debugging_mvcc_watcher_total"),
        etcd.metric("etcd_debugging_mvcc_events_total"),
        received,
        sent
    ));
    // Each sidecar renews three times a lease (10 s): 30 a second for 100.
    assert!(
        (24.0..=36.0).contains(&renewals),
        "{renewals:.1} lease renewals a second from {SIDECARS} sidecars"
    );
    drop(clients);
    drop(sidecars);
}
