//! RDMA end to end, on real verbs: two `kvrail` processes in the Soft-RoCE VM
//! (`../shared/rdma-vm`), node A (prefill) on `rxe_a0`/`rxe_a1` and node B (decode)
//! on `rxe_b0`/`rxe_b1`, found by their rail addresses. Every byte is verified.
//!
//! The `#[ignore]`d tests need RDMA devices and run inside the VM; the plain test
//! `rdma_suite_in_the_vm` boots the VM and runs them there (or says why it
//! cannot). `without_rdma_the_daemon_says_why_and_uses_tcp` runs on the host.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

use std::time::{Duration, Instant};

use kvrail_auth::generate::{self, Validity};
use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::{binary, free_port, metric_sum, scrape, shm_path, workspace_root, Pair, Sidecar};
use kvrail_examples::{fill, scattered_blocks, verify};

/// Tests share the devices, and some cut rails: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The VM harness: `$RDMA_VM_RUN`, or `shared/rdma-vm/run` beside the checkout.
fn vm_runner() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RDMA_VM_RUN") {
        return Some(PathBuf::from(p));
    }
    let root = workspace_root();
    [
        root.join("../shared/rdma-vm/run"),
        root.join("../../shared/rdma-vm/run"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn ips(var: &str, default: &str) -> Vec<IpAddr> {
    std::env::var(var)
        .unwrap_or_else(|_| default.into())
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect()
}

fn rails() -> (Vec<IpAddr>, Vec<IpAddr>) {
    (
        ips("RDMA_VM_A_IPS", "169.254.100.1 169.254.101.1"),
        ips("RDMA_VM_B_IPS", "169.254.100.2 169.254.101.2"),
    )
}

fn in_vm(test: &str) -> bool {
    if std::env::var_os("RDMA_VM").is_none() {
        kvrail_e2e::say_skipped(test, "needs the RDMA VM (run through rdma_suite_in_the_vm)");
        return false;
    }
    true
}

/// Runs every ignored test of this file inside the VM, with binaries built here.
#[test]
fn rdma_suite_in_the_vm() {
    if std::env::var_os("RDMA_VM").is_some() {
        return;
    }
    let Some(run) = vm_runner() else {
        return kvrail_e2e::skip_or_fail(
            "rdma_suite_in_the_vm",
            "no RDMA VM harness (shared/rdma-vm/run or $RDMA_VM_RUN) here",
        );
    };
    let bin_dir = binary("kvrail").parent().unwrap().to_path_buf();
    // The VM's kernel loads only the modules its harness packed; the doctor's
    // bond check needs `bonding` (and `tls`), taken from the same kernel package.
    let modules = vm_bond_modules(&run);
    if let Err(e) = &modules {
        println!("bond modules for the VM: {e}");
    }
    let exe = std::env::current_exe().unwrap();
    let out = run_suite_in_vm(&run, &exe, &bin_dir, modules.as_deref().ok());
    let stdout = &out.stdout;
    println!("{stdout}");
    eprintln!("{}", out.stderr);
    assert!(
        out.status.success(),
        "RDMA tests in the VM failed ({})",
        out.status
    );
    assert!(
        stdout.contains("test result: ok") && !stdout.contains("SKIPPED rdma_"),
        "the VM skipped its RDMA tests"
    );
}

struct VmRun {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

/// Boots the VM and runs this binary's ignored tests there. Under full CPU
/// emulation the guest's boot now and then hangs before it runs anything (CI,
/// 2026-11-26: no output for 900 s, a console that ends in early boot). The
/// command's first step inside the VM writes a marker into the shared working
/// directory; a VM that has not written it within `BOOT_DEADLINE` is stopped and
/// booted once more. A hang after the marker is the tests' own and fails.
fn run_suite_in_vm(run: &Path, exe: &Path, bin_dir: &Path, modules: Option<&Path>) -> VmRun {
    use std::os::unix::process::CommandExt;
    const BOOT_DEADLINE: Duration = Duration::from_secs(300);
    const BOOTS: usize = 2;
    let scratch = workspace_root().join("target/rdma-vm-suite");
    std::fs::create_dir_all(&scratch).unwrap();
    let marker = scratch.join("booted");
    let (out_path, err_path) = (scratch.join("stdout"), scratch.join("stderr"));
    for boot in 1..=BOOTS {
        let _ = std::fs::remove_file(&marker);
        let mut child = Command::new(run)
            .args(["sh", "-c", r#"echo up >"$0" && exec "$@""#])
            .arg(&marker)
            .arg(exe)
            .args(["--ignored", "--test-threads=1", "--nocapture"])
            .env("KVRAIL_BIN_DIR", bin_dir)
            .env("KVRAIL_VM_MODULES", modules.unwrap_or(Path::new("")))
            .env("RUST_BACKTRACE", "0")
            .env("RDMA_VM_TIMEOUT", "900")
            .env("RDMA_VM_MEM", "3072")
            // Soft-RoCE in Linux 6.1 runs the sending NIC inside ibv_post_send and
            // loops there, without yielding, while timers keep re-arming it (fixed in
            // 6.4, which caps the loop). Under full CPU emulation a cut rail made two
            // such posts hold both vCPUs for good (soft lockup). A preemptible kernel
            // lets everything else run beside them. See docs/rdma.md.
            .env("RDMA_VM_KERNEL_ARGS", "preempt=full")
            .current_dir(workspace_root())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            // Its own process group, so a hung boot is stopped with qemu and all.
            .process_group(0)
            .spawn()
            .unwrap();
        let started = Instant::now();
        let mut hung = false;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if !hung && !marker.exists() && started.elapsed() > BOOT_DEADLINE && boot < BOOTS {
                hung = true;
                // SIGTERM: the harness's trap stops qemu and removes its files.
                let _ = Command::new("kill")
                    .args(["-TERM", "--", &format!("-{}", child.id())])
                    .status();
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
        let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
        if hung {
            println!(
                "boot {boot}: the VM ran nothing in {}s; booting it again. Its stderr:\n{stderr}",
                BOOT_DEADLINE.as_secs()
            );
            continue;
        }
        return VmRun {
            status,
            stdout,
            stderr,
        };
    }
    unreachable!("the last boot is never stopped early")
}

/// `bonding.ko` and `tls.ko` of the VM's kernel, from its Debian package,
/// cached under target/.
fn vm_bond_modules(run: &Path) -> Result<PathBuf, String> {
    // A short boot of its own; a boot that hangs (see run_suite_in_vm) is
    // given up after RDMA_VM_TIMEOUT and tried once more.
    let uname = || {
        Command::new(run)
            .args(["uname", "-r"])
            .env("RDMA_VM_TIMEOUT", "240")
            .output()
            .map_err(|e| format!("run uname in the VM: {e}"))
    };
    let mut out = uname()?;
    if out.status.code() == Some(124) {
        println!("the VM did not boot within 240 s for `uname -r`; booting it again");
        out = uname()?;
    }
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || version.is_empty() {
        return Err(format!(
            "the VM did not say its kernel version ({})",
            out.status
        ));
    }
    let dir = workspace_root().join("target/vm-modules").join(&version);
    if dir.join("bonding.ko").is_file() && dir.join("tls.ko").is_file() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(dir.join("lib"));
    let package = format!("linux-image-{version}");
    let got = Command::new("apt-get")
        .args(["download", &package])
        .current_dir(&dir)
        .output()
        .map_err(|e| format!("apt-get: {e}"))?;
    if !got.status.success() {
        return Err(format!(
            "apt-get download {package}: {}",
            String::from_utf8_lossy(&got.stderr)
        ));
    }
    let deb = std::fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or("apt-get downloaded no .deb")?;
    let script = format!(
        "cd '{}' && dpkg-deb --fsys-tarfile '{}' | tar -x --wildcards '*/drivers/net/bonding/bonding.ko' '*/net/tls/tls.ko' && find . -name '*.ko' -exec mv {{}} . \\;",
        dir.display(),
        deb.display()
    );
    let ok = Command::new("sh").arg("-c").arg(&script).status();
    let _ = std::fs::remove_file(&deb);
    let _ = std::fs::remove_dir_all(dir.join("lib"));
    if !ok.is_ok_and(|s| s.success()) || !dir.join("bonding.ko").is_file() {
        return Err(format!("could not extract bonding.ko from {package}"));
    }
    Ok(dir)
}

/// Waits for `client`'s transfer `id` and requires it done (both sidecars'
/// log tails otherwise).
async fn wait_done(client: &mut Client, pair: &Pair, id: u64) {
    let s = client
        .wait(id, Some(Duration::from_secs(120)))
        .await
        .unwrap();
    assert_eq!(
        s.state,
        TransferState::Done as i32,
        "{s:?}\n--- prefill log (tail) ---\n{}\n--- decode log (tail) ---\n{}\n{}",
        tail(&pair.prefill.log(), 60),
        tail(&pair.decode.log(), 60),
        rxe_counters()
    );
}

struct Setup {
    pair: Pair,
    p: Client,
    d: Client,
    p_kv: KvRegion,
    d_kv: KvRegion,
    p_region: u64,
    d_region: u64,
    num_blocks: u32,
    /// The cluster CA and both node certificates: the peer connections that carry
    /// the queue-pair and memory-key exchange are authenticated with them.
    _certs: tempfile::TempDir,
}

const NUM_BLOCKS: u32 = 128;
const BLOCK_BYTES: u64 = 64 << 10;

async fn setup(name: &str, rail_count: usize, extra: &[&str]) -> Setup {
    setup_with(name, rail_count, extra, NUM_BLOCKS).await
}

async fn setup_with(name: &str, rail_count: usize, extra: &[&str], num_blocks: u32) -> Setup {
    let (a, b) = rails();
    setup_on(name, &a[..rail_count], &b[..rail_count], extra, num_blocks).await
}

/// Two sidecars on these rail addresses, each with one exposed 4-layer region.
async fn setup_on(
    name: &str,
    prefill_ips: &[IpAddr],
    decode_ips: &[IpAddr],
    extra: &[&str],
    num_blocks: u32,
) -> Setup {
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    let dir = certs.path().display().to_string();
    let mut args = vec!["--tls-dir", &dir, "--transports", "rdma,tcp"];
    args.extend_from_slice(extra);
    let pair = Pair::start_on(prefill_ips, decode_ips, &args);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(4, 2, num_blocks, BLOCK_BYTES);
    let p_kv = KvRegion::create(pair.shm_path(&format!("{name}-p")), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path(&format!("{name}-d")), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, true).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, true).await.unwrap();
    Setup {
        pair,
        p,
        d,
        p_kv,
        d_kv,
        p_region,
        d_region,
        num_blocks,
        _certs: certs,
    }
}

impl Setup {
    /// Dials the peer (sidecars connect on first use) with a one-block push, then
    /// checks that queue pairs came up on each of `rails`.
    async fn connect(&mut self, rails: u32) {
        let (id, dst) = self.push(99, 0..1, 1).await;
        self.done(id).await;
        verify(&self.d_kv, 99, 0..1, &dst).unwrap();
        for r in 0..rails {
            self.wait_for_queue_pairs(r).await;
        }
    }

    /// Waits until the prefill log says queue pairs connected on `rail`.
    async fn wait_for_queue_pairs(&self, rail: u32) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self
                .pair
                .prefill
                .log()
                .contains(&format!("rail={rail} qps="))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no queue pairs on rail {rail}:\n{}",
                self.pair.prefill.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn push(&mut self, seed: u64, layers: std::ops::Range<u32>, n: usize) -> (u64, Vec<u32>) {
        let src = scattered_blocks(n, self.num_blocks, seed);
        let dst = scattered_blocks(n, self.num_blocks, seed + 100);
        fill(&self.p_kv, seed, layers.clone(), &src).unwrap();
        let t = self
            .p
            .push(
                "p0",
                &format!("push-{seed}"),
                "decode",
                blocks(self.p_region, layers.clone(), src),
                blocks(self.d_region, layers, dst.clone()),
            )
            .await
            .unwrap();
        (t.transfer_id, dst)
    }

    /// Decode pulls prefill's `src` blocks (filled with `seed`) into `dst`,
    /// waits until it is done, and returns the transfer's size.
    async fn pull(
        &mut self,
        seed: u64,
        layers: std::ops::Range<u32>,
        src: Vec<u32>,
        dst: &[u32],
    ) -> u64 {
        fill(&self.p_kv, seed, layers.clone(), &src).unwrap();
        let t = self
            .d
            .pull(
                "d0",
                &format!("pull-{seed}"),
                "prefill",
                blocks(self.p_region, layers.clone(), src),
                blocks(self.d_region, layers, dst.to_vec()),
            )
            .await
            .unwrap();
        wait_done(&mut self.d, &self.pair, t.transfer_id).await;
        t.total_bytes
    }

    /// Waits until prefill's transfer `id` is done.
    async fn done(&mut self, id: u64) {
        wait_done(&mut self.p, &self.pair, id).await;
    }

    fn rdma_bytes(&self, rail: &str) -> f64 {
        let text = scrape(self.pair.prefill.metrics.unwrap());
        metric_sum(
            &text,
            "kvrail_bytes_sent_total",
            &["transport=\"rdma\"", &format!("rail=\"{rail}\"")],
        )
    }
}

async fn push_and_pull(rail_count: usize, name: &str) {
    let mut s = setup(name, rail_count, &["--slice-bytes", "262144"]).await;
    s.connect(rail_count as u32).await;
    // Push: 4 layers x K/V x 96 scattered blocks of 64 KiB = 48 MiB.
    let (id, dst) = s.push(1, 0..4, 96).await;
    s.done(id).await;
    assert_eq!(
        verify(&s.d_kv, 1, 0..4, &dst).unwrap(),
        4 * 2 * 96 * BLOCK_BYTES
    );
    for r in 0..rail_count {
        let bytes = s.rdma_bytes(&r.to_string());
        assert!(bytes > 0.0, "nothing written over RDMA on rail {r}");
    }
    let text = scrape(s.pair.prefill.metrics.unwrap());
    assert_eq!(
        metric_sum(&text, "kvrail_bytes_sent_total", &["transport=\"tcp\""]),
        0.0,
        "payload went over TCP"
    );
    // Pull: decode reads prefill's blocks with RDMA READ.
    let src = scattered_blocks(64, NUM_BLOCKS, 7);
    let dst: Vec<u32> = (0..NUM_BLOCKS).rev().take(64).collect();
    let total = s.pull(7, 1..3, src, &dst).await;
    assert_eq!(verify(&s.d_kv, 7, 1..3, &dst).unwrap(), total);
    let text = scrape(s.pair.decode.metrics.unwrap());
    let read = metric_sum(
        &text,
        "kvrail_bytes_received_total",
        &["transport=\"rdma\"", "peer=\"prefill\""],
    );
    assert!(read >= total as f64, "READ bytes {read} < {total}");
    let text = scrape(s.pair.prefill.metrics.unwrap());
    assert!(
        text.contains("kvrail_rdma_work_requests_total")
            && text.contains("kvrail_rdma_post_nanoseconds_total"),
        "{text}"
    );
    s.p_kv.unlink();
    s.d_kv.unlink();
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_push_and_pull_on_one_rail() {
    if !in_vm("rdma_push_and_pull_on_one_rail") {
        return;
    }
    let _g = SERIAL.lock().await;
    push_and_pull(1, "one").await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_push_and_pull_on_both_rails() {
    if !in_vm("rdma_push_and_pull_on_both_rails") {
        return;
    }
    let _g = SERIAL.lock().await;
    push_and_pull(2, "both").await;
}

/// Transfers up to `--rdma-eager-max-bytes` skip the grant round trip and
/// travel behind their open on the rail's stream connection; larger ones
/// are still written one-sided.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_small_transfers_go_behind_their_open_large_ones_one_sided() {
    if !in_vm("rdma_small_transfers_go_behind_their_open_large_ones_one_sided") {
        return;
    }
    let _g = SERIAL.lock().await;
    // One layer of one block is 2 x 64 KiB: under this limit.
    let mut s = setup("eager", 1, &["--rdma-eager-max-bytes", "131072"]).await;
    s.connect(1).await;
    let sent = |s: &Setup, transport: &str| {
        let text = scrape(s.pair.prefill.metrics.unwrap());
        let t = format!("transport=\"{transport}\"");
        metric_sum(&text, "kvrail_bytes_sent_total", &[&t])
    };
    let (rdma0, stream0) = (sent(&s, "rdma"), sent(&s, "tcp"));
    let (id, dst) = s.push(31, 2..3, 1).await;
    s.done(id).await;
    assert_eq!(verify(&s.d_kv, 31, 2..3, &dst).unwrap(), 2 * BLOCK_BYTES);
    assert_eq!(
        sent(&s, "rdma"),
        rdma0,
        "a small push was written one-sided"
    );
    assert_eq!(sent(&s, "tcp") - stream0, (2 * BLOCK_BYTES) as f64);
    // A small pull is served the same way (one-sided, decode would READ it).
    let read = |s: &Setup| {
        let text = scrape(s.pair.decode.metrics.unwrap());
        metric_sum(
            &text,
            "kvrail_bytes_received_total",
            &["transport=\"rdma\""],
        )
    };
    let read0 = read(&s);
    let src = scattered_blocks(1, NUM_BLOCKS, 32);
    let pulled = vec![NUM_BLOCKS - 1];
    s.pull(32, 1..2, src, &pulled).await;
    assert_eq!(verify(&s.d_kv, 32, 1..2, &pulled).unwrap(), 2 * BLOCK_BYTES);
    assert_eq!(read(&s), read0, "a small pull was read one-sided");
    // Above the limit: one-sided.
    let (id, dst) = s.push(33, 0..4, 4).await;
    s.done(id).await;
    assert_eq!(
        verify(&s.d_kv, 33, 0..4, &dst).unwrap(),
        4 * 2 * 4 * BLOCK_BYTES
    );
    assert!(
        sent(&s, "rdma") > rdma0,
        "a large push did not go one-sided"
    );
    s.p_kv.unlink();
    s.d_kv.unlink();
}

fn link(netdev: &str, state: &str) {
    let ok = Command::new("ip")
        .args(["link", "set", netdev, state])
        .status()
        .unwrap();
    assert!(ok.success(), "ip link set {netdev} {state}");
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_rail_cut_fails_over_then_tcp_then_back() {
    if !in_vm("rdma_rail_cut_fails_over_then_tcp_then_back") {
        return;
    }
    let _g = SERIAL.lock().await;
    let netdevs: Vec<String> = std::env::var("RDMA_VM_B_NETDEVS")
        .unwrap_or_else(|_| "eth_b0 eth_b1".into())
        .split_whitespace()
        .map(String::from)
        .collect();
    // 4 layers x K/V x 512 blocks of 64 KiB: 256 MiB regions, pushes of 128 MiB.
    let mut s = setup_with("cut", 2, &["--slice-bytes", "262144"], 512).await;
    s.connect(2).await;
    let layer_bytes = 2 * 256 * BLOCK_BYTES;

    // 1. Rail 1 goes down mid-push: rail 0 finishes it over RDMA.
    let mut cut = Cutter::new(&format!("ip link set {} down", netdevs[1]));
    let (id, dst) = s.push(11, 0..4, 256).await;
    cut.fire();
    let at_fire = s.p.get_transfer(id).await.unwrap().bytes_done;
    cut.finish();
    let rail1_before = s.rdma_bytes("1");
    s.done(id).await;
    println!(
        "rail 1 cut fired with {at_fire} bytes acknowledged; rail 0 {} bytes, rail 1 {rail1_before} -> {} bytes",
        s.rdma_bytes("0"),
        s.rdma_bytes("1")
    );
    assert_eq!(verify(&s.d_kv, 11, 0..4, &dst).unwrap(), 4 * layer_bytes);
    // Either the queue pairs failed (retry exceeded) or the stall detector took
    // the rail down first: both move its slices to rail 0.
    let log = s.pair.prefill.log();
    assert!(
        log.contains("queue_pair=true") || log.contains("rail down"),
        "rail 1 was never given up:\n{log}"
    );
    assert!(s.rdma_bytes("0") > 0.0);

    // 2. Both rails down mid-push: the rest goes over TCP (through lo in the VM).
    let mut cut = Cutter::new(&format!("ip link set {} down", netdevs[0]));
    let (id, dst) = s.push(12, 0..4, 256).await;
    cut.fire();
    cut.finish();
    s.done(id).await;
    assert_eq!(verify(&s.d_kv, 12, 0..4, &dst).unwrap(), 4 * layer_bytes);
    let text = scrape(s.pair.prefill.metrics.unwrap());
    let tcp = metric_sum(&text, "kvrail_bytes_sent_total", &["transport=\"tcp\""]);
    assert!(tcp > 0.0, "nothing went over TCP after both rails were cut");

    // 3. Rails back: queue pairs are rebuilt on both, each rail is up again with
    // its 4 streams plus 2 queue pairs, and they carry the next push.
    let mark = s.pair.prefill.log().len();
    link(&netdevs[0], "up");
    link(&netdevs[1], "up");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = s.pair.prefill.log();
        let since = log.get(mark..).unwrap_or_default();
        let back = |rail: u32| {
            ["rebuilt", "connected"].iter().any(|how| {
                since.contains(&format!("RDMA queue pairs {how} peer=decode rail={rail} "))
            })
        };
        let peers = s.p.list_peers().await.unwrap();
        let rails: Vec<(String, u32)> = peers
            .peers
            .iter()
            .flat_map(|p| p.rail_status.iter())
            .filter(|r| r.direction == "out")
            .map(|r| (r.state.clone(), r.connections))
            .collect();
        let whole = |r: &(String, u32)| r.0 == "up" && r.1 >= 6;
        if back(0) && back(1) && rails.len() == 2 && rails.iter().all(whole) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "queue pairs not rebuilt on both rails, or rails not up with all connections ({rails:?}):\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each push is verified, and one push must move bytes over both rails'
    // rebuilt queue pairs. A rebuilt queue pair that then stalls is taken
    // down by the rail's stall detector and built again (phase 1's
    // failover), so a later push may be the first to find both working:
    // seen twice in CI runs on 2026-11-27 (rail 0 unacknowledged for about
    // 1 s right after its rebuild), before queue-pair setups of one rail
    // were made one at a time. Extra pushes are printed (shown with
    // `--nocapture` or when the suite fails); three pushes without one that
    // moved both rails fail.
    let (mut r0, mut r1) = (s.rdma_bytes("0"), s.rdma_bytes("1"));
    let mut pushes = 0;
    loop {
        let seed = 13 + pushes;
        let (id, dst) = s.push(seed, 0..4, 96).await;
        s.done(id).await;
        assert_eq!(
            verify(&s.d_kv, seed, 0..4, &dst).unwrap(),
            4 * 2 * 96 * BLOCK_BYTES
        );
        pushes += 1;
        let (n0, n1) = (s.rdma_bytes("0"), s.rdma_bytes("1"));
        if (n0 > r0 && n1 > r1) || pushes == 3 {
            break;
        }
        println!(
            "push {pushes} since the rails came back: rail 0 {r0} -> {n0}, rail 1 {r1} -> {n1} RDMA bytes; pushing again\n{}",
            rxe_counters()
        );
        (r0, r1) = (n0, n1);
    }
    assert!(
        s.rdma_bytes("0") > r0 && s.rdma_bytes("1") > r1,
        "no push of {pushes} moved bytes over both rails' rebuilt queue pairs (last: rail 0 {r0} -> {}, rail 1 {r1} -> {}; {:?}):\n{}\nprefill:\n{}\ndecode:\n{}",
        s.rdma_bytes("0"),
        s.rdma_bytes("1"),
        s.p.list_peers().await.unwrap().peers,
        rxe_counters(),
        s.pair.prefill.log(),
        s.pair.decode.log()
    );
    s.p_kv.unlink();
    s.d_kv.unlink();
}

/// One node of the mixed cluster: its sidecar, client and one exposed region.
struct Node {
    sidecar: Sidecar,
    client: Client,
    kv: KvRegion,
    region: u64,
}

/// A cluster of three: `prefill` and `decode` with RDMA (rail 0 of the VM's
/// nodes A and B), `cpu` without (`--no-rdma`; it listens on node A's address
/// with a port of its own: nodes are a naming convention in the VM). All have
/// certificates and the default order rdma, quic, tcp: prefill and decode must
/// pick RDMA, every pair with `cpu` QUIC. Each pair moves verified bytes.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_mixed_cluster_each_pair_on_its_best_transport() {
    if !in_vm("rdma_mixed_cluster_each_pair_on_its_best_transport") {
        return;
    }
    let _g = SERIAL.lock().await;
    let (a, b) = rails();
    let dir = tempfile::tempdir().unwrap();
    let names = ["prefill", "decode", "cpu"];
    generate::cluster(dir.path(), &names, Validity::days(1)).unwrap();
    let listen: Vec<SocketAddr> = [a[0], b[0], a[0]]
        .iter()
        .map(|&ip| SocketAddr::new(ip, free_port()))
        .collect();
    let layout = dense_layout(4, 2, 32, BLOCK_BYTES);
    let mut nodes = Vec::new();
    for (i, node) in names.iter().enumerate() {
        let mut args = vec!["--tls-dir".to_string(), dir.path().display().to_string()];
        for (j, peer) in names.iter().enumerate() {
            if i != j {
                args.push("--peer".into());
                args.push(format!("{peer}={}", listen[j]));
            }
        }
        if *node == "cpu" {
            args.push("--no-rdma".into());
        }
        let metrics = SocketAddr::new(IpAddr::from([127, 0, 0, 1]), free_port());
        let sidecar = Sidecar::start(dir.path(), node, &listen[i..=i], Some(metrics), &args);
        let mut client = sidecar.client().await;
        let path = shm_path(listen[0].port(), &format!("mixed-{node}"));
        let kv = KvRegion::create(path, layout).unwrap();
        let region = client.register_region("w", &kv, true).await.unwrap();
        nodes.push(Node {
            sidecar,
            client,
            kv,
            region,
        });
    }
    // (from, to, what the pair must use)
    let pairs = [
        (0, 1, "rdma"),
        (0, 2, "quic"),
        (2, 1, "quic"),
        (1, 2, "quic"),
    ];
    for (seed, &(from, to, transport)) in pairs.iter().enumerate() {
        let seed = seed as u64 + 20;
        let src = scattered_blocks(16, 32, seed);
        let dst = scattered_blocks(16, 32, seed + 100);
        fill(&nodes[from].kv, seed, 0..4, &src).unwrap();
        let (to_region, to_name) = (nodes[to].region, names[to]);
        let from_region = nodes[from].region;
        let t = nodes[from]
            .client
            .push(
                "w",
                &format!("mixed-{seed}"),
                to_name,
                blocks(from_region, 0..4, src),
                blocks(to_region, 0..4, dst.clone()),
            )
            .await
            .unwrap();
        let st = nodes[from]
            .client
            .wait(t.transfer_id, Some(Duration::from_secs(120)))
            .await
            .unwrap();
        assert_eq!(
            st.state,
            TransferState::Done as i32,
            "{} -> {to_name}: {st:?}\n--- {} log:\n{}\n--- {to_name} log:\n{}",
            names[from],
            names[from],
            nodes[from].sidecar.log(),
            nodes[to].sidecar.log()
        );
        assert_eq!(
            verify(&nodes[to].kv, seed, 0..4, &dst).unwrap(),
            4 * 2 * 16 * BLOCK_BYTES,
            "{} -> {to_name}",
            names[from]
        );
        let text = scrape(nodes[from].sidecar.metrics.unwrap());
        let peer = format!("peer=\"{to_name}\"");
        let chosen = format!("transport=\"{transport}\"");
        assert_eq!(
            metric_sum(&text, "kvrail_peer_transport", &[&peer, &chosen]),
            1.0,
            "{} -> {to_name} does not use {transport}:\n{}",
            names[from],
            nodes[from].sidecar.log()
        );
        assert!(
            metric_sum(&text, "kvrail_bytes_sent_total", &[&peer, &chosen]) > 0.0,
            "{} -> {to_name}: no payload over {transport}",
            names[from]
        );
        for other in ["rdma", "quic", "tcp"].iter().filter(|&&o| o != transport) {
            let o = format!("transport=\"{other}\"");
            assert_eq!(
                metric_sum(&text, "kvrail_bytes_sent_total", &[&peer, &o]),
                0.0,
                "{} -> {to_name}: payload over {other} too",
                names[from]
            );
        }
        println!(
            "mixed cluster: {} -> {to_name} over {transport}, verified",
            names[from]
        );
    }
    for n in &nodes {
        n.kv.unlink();
    }
}

/// `kvrail doctor` as node A of the VM: each rail's RoCE v2 GID, port and path
/// MTU; a rail cut at its own end; and a bond (the DGX Spark mistake of bonding
/// the two ports) that has no RDMA device.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_doctor_finds_gids_ports_and_a_bond() {
    if !in_vm("rdma_doctor_finds_gids_ports_and_a_bond") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let (a, _) = rails();
    let doctor = |listen: &[IpAddr]| {
        let mut cmd = Command::new(binary("kvrail"));
        cmd.args([
            "doctor",
            "--json",
            "--no-peers",
            "--node",
            "a",
            "--insecure",
        ]);
        for ip in listen {
            cmd.args(["--listen", &SocketAddr::new(*ip, 7470).to_string()]);
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| {
            panic!(
                "no JSON ({e}): {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        json
    };
    let find = |json: &serde_json::Value, check: &str, rail: u64| -> Vec<(String, String)> {
        json["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["check"] == check && f["rail"] == rail)
            .map(|f| {
                (
                    f["status"].as_str().unwrap().to_string(),
                    f["detail"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };

    let json = doctor(&a);
    let devs: Vec<String> = std::env::var("RDMA_VM_A_DEVS")
        .unwrap_or_else(|_| "rxe_a0 rxe_a1".into())
        .split_whitespace()
        .map(str::to_string)
        .collect();
    for rail in 0..2u64 {
        let gid = find(&json, "gid", rail);
        assert_eq!(gid.len(), 1, "{json:#}");
        assert_eq!(gid[0].0, "ok", "{json:#}");
        assert!(
            gid[0]
                .1
                .contains(&format!("{}/1 GID index 1", devs[rail as usize]))
                && gid[0].1.contains("RoCE v2"),
            "{gid:?}"
        );
        assert_eq!(find(&json, "port", rail)[0].0, "ok", "{json:#}");
        let mtu = find(&json, "rdma-mtu", rail);
        assert!(
            mtu[0].0 == "ok" && mtu[0].1.contains("path MTU 4096"),
            "{mtu:?}"
        );
    }

    // Rail 1 cut at A's own end: its port goes DOWN.
    let netdev1 = std::env::var("RDMA_VM_A_NETDEVS")
        .unwrap_or_else(|_| "eth_a0 eth_a1".into())
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    ip(&["link", "set", &netdev1, "down"]);
    let json = doctor(&a);
    ip(&["link", "set", &netdev1, "up"]);
    let port = find(&json, "port", 1);
    assert!(
        port[0].0 == "fail" && port[0].1.contains("DOWN"),
        "{port:?}"
    );
    assert_eq!(find(&json, "link", 1)[0].0, "fail", "{json:#}");
    assert_eq!(find(&json, "port", 0)[0].0, "ok", "{json:#}");

    // A bond: its address has no RDMA device behind it.
    let modules = std::env::var("KVRAIL_VM_MODULES").unwrap_or_default();
    if modules.is_empty() {
        return kvrail_e2e::skip_or_fail(
            "the bond part",
            "the VM kernel's bonding module could not be fetched",
        );
    }
    for m in ["tls.ko", "bonding.ko"] {
        let out = Command::new("insmod")
            .arg(Path::new(&modules).join(m))
            .output()
            .expect("insmod (kmod) in the VM");
        let err = String::from_utf8_lossy(&out.stderr);
        // Loaded once per VM: a second insmod says the module exists.
        assert!(
            out.status.success() || err.contains("File exists"),
            "insmod {m}: {err}"
        );
    }
    ip(&["link", "add", "kvb0", "type", "bond"]);
    ip(&[
        "link", "add", "kvs0", "type", "veth", "peer", "name", "kvs1",
    ]);
    ip(&["link", "set", "kvs0", "master", "kvb0"]);
    ip(&["addr", "add", "169.254.200.1/24", "dev", "kvb0"]);
    ip(&["link", "set", "kvb0", "up"]);
    ip(&["link", "set", "kvs1", "up"]);
    let json = doctor(&["169.254.200.1".parse().unwrap()]);
    ip(&["link", "del", "kvb0"]);
    ip(&["link", "del", "kvs0"]);
    let bond = find(&json, "bond", 0);
    assert!(
        bond.len() == 1 && bond[0].0 == "fail" && bond[0].1.contains("bond kvb0 (slaves: kvs0)"),
        "{json:#}"
    );
    let gid = find(&json, "gid", 0);
    assert!(
        gid[0].0 == "fail" && gid[0].1.contains("no RDMA port has a GID"),
        "{json:#}"
    );
}

/// On a host without RDMA the daemon starts, says why, and moves bytes over TCP.
#[tokio::test(flavor = "multi_thread")]
async fn without_rdma_the_daemon_says_why_and_uses_tcp() {
    if std::env::var_os("RDMA_VM").is_some() || kvrail_verbs_present() {
        kvrail_e2e::say_skipped(
            "without_rdma_the_daemon_says_why_and_uses_tcp",
            "this host has RDMA devices",
        );
        return;
    }
    let mut s = setup_loopback().await;
    let (id, dst) = s.push(3, 0..2, 16).await;
    s.done(id).await;
    assert_eq!(
        verify(&s.d_kv, 3, 0..2, &dst).unwrap(),
        2 * 2 * 16 * BLOCK_BYTES
    );
    let log = s.pair.prefill.log();
    assert!(
        log.contains("RDMA off, serving over tcp"),
        "no reason logged:\n{log}"
    );
    let text = scrape(s.pair.prefill.metrics.unwrap());
    assert!(metric_sum(&text, "kvrail_bytes_sent_total", &["transport=\"tcp\""]) > 0.0);
    s.p_kv.unlink();
    s.d_kv.unlink();
}

fn kvrail_verbs_present() -> bool {
    Path::new("/sys/class/infiniband")
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
}

async fn setup_loopback() -> Setup {
    let lo = [IpAddr::from([127, 0, 0, 1])];
    setup_on("nordma", &lo, &lo, &[], NUM_BLOCKS).await
}

/// A shell that runs `cmd` once told to: started ahead, so the cut lands within
/// milliseconds of `fire` (starting a process in the emulated VM is slow).
struct Cutter(std::process::Child);

impl Cutter {
    fn new(cmd: &str) -> Cutter {
        Cutter(
            Command::new("sh")
                .arg("-c")
                .arg(format!("read go; {cmd}"))
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        )
    }

    fn fire(&mut self) {
        use std::io::Write;
        let stdin = self.0.stdin.as_mut().unwrap();
        writeln!(stdin, "go").unwrap();
    }

    fn finish(mut self) {
        assert!(self.0.wait().unwrap().success(), "cut command failed");
    }
}

/// Every Soft-RoCE port's hardware counters (retries, RNR, sequence errors),
/// one line per device, for failure messages.
fn rxe_counters() -> String {
    let mut out = String::from("Soft-RoCE counters:");
    let Ok(devices) = std::fs::read_dir("/sys/class/infiniband") else {
        return out + " (no /sys/class/infiniband)";
    };
    let mut devices: Vec<_> = devices.flatten().map(|d| d.path()).collect();
    devices.sort();
    for dev in devices {
        let dir = dev.join("ports/1/hw_counters");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut counters: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                let value = std::fs::read_to_string(e.path()).ok()?;
                let value = value.trim();
                (value != "0").then(|| format!("{}={value}", e.file_name().to_string_lossy()))
            })
            .collect();
        counters.sort();
        let name = dev
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        out += &format!("\n  {name}: {}", counters.join(" "));
    }
    out
}

/// The last `n` lines of a log, for failure messages.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What a region's key lets a peer do is what its registration allows: the
/// sidecar registers regions that are not exposed to pulls without remote
/// read, so a push's grant (the key of the whole destination region) does
/// not let the pusher read it. Raw verbs between the two nodes' rail 0: an
/// RDMA READ with a write-only key fails with a remote access error, with a
/// read-write key it completes.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_a_write_only_key_refuses_remote_reads() {
    use kvrail_verbs::{Device, Opcode, QpConfig, QueuePair, RemoteAccess, Sge, WorkRequest};
    if !in_vm("rdma_a_write_only_key_refuses_remote_reads") {
        return;
    }
    let _g = SERIAL.lock().await;
    let (a, b) = rails();
    let owner_dev = Device::open(a[0], None, None).unwrap();
    let reader_dev = Device::open(b[0], None, None).unwrap();
    for (access, readable) in [
        (RemoteAccess::Write, false),
        (RemoteAccess::ReadWrite, true),
    ] {
        let target = owner_dev.register_buffer(vec![7u8; 4096], access).unwrap();
        let local = reader_dev
            .register_buffer(vec![0u8; 4096], RemoteAccess::None)
            .unwrap();
        let mut owner_qp = QueuePair::create(&owner_dev, QpConfig::default()).unwrap();
        let mut reader_qp = QueuePair::create(&reader_dev, QpConfig::default()).unwrap();
        let (owner_end, reader_end) = (owner_qp.endpoint().unwrap(), reader_qp.endpoint().unwrap());
        owner_qp.connect(&reader_end).unwrap();
        reader_qp.connect(&owner_end).unwrap();
        reader_qp
            .post(&[WorkRequest {
                opcode: Opcode::Read,
                wr_id: 1,
                sges: vec![Sge {
                    addr: local.addr,
                    len: 4096,
                    lkey: local.lkey,
                }],
                remote_addr: target.addr,
                rkey: target.rkey,
                inline: Vec::new(),
                signaled: true,
            }])
            .unwrap();
        let mut done = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(30),
            reader_qp.wait(&mut done, Duration::ZERO),
        )
        .await
        .expect("the READ completes or fails within 30 s")
        .unwrap();
        let c = &done[0];
        match (&c.error, readable) {
            (None, true) => {}
            (Some(e), false) => assert!(e.remote_access, "{access:?}: {e}"),
            (e, _) => panic!("{access:?}: READ ended with {e:?}"),
        }
    }
}

/// Prefill at TP 2 (4 KV heads per rank, HND blocks), decode at TP 1: the
/// decode rank pulls each prefill rank's heads as a head slice, one-sided
/// (RDMA READ of each remote run, the local side gathered), and its blocks
/// hold the two ranks' blocks joined head by head.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs RDMA devices: runs in the VM"]
async fn rdma_head_slices_between_ranks_go_one_sided() {
    use kvrail_client::proto::{BlockInterior, BlockRange, HeadSlice, KvGeometry};
    if !in_vm("rdma_head_slices_between_ranks_go_one_sided") {
        return;
    }
    let _g = SERIAL.lock().await;
    let (a, b) = rails();
    let certs = tempfile::tempdir().unwrap();
    generate::cluster(certs.path(), &["prefill", "decode"], Validity::days(1)).unwrap();
    let dir = certs.path().display().to_string();
    let args = ["--tls-dir", &dir, "--transports", "rdma,tcp"];
    let pair = Pair::start_on(&a[..1], &b[..1], &args);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    const TPB: u32 = 16;
    const HEAD: u64 = 128 * 2;
    let geometry = |start: u32, heads: u32| KvGeometry {
        model: "test/8kv".into(),
        dtype: "bfloat16".into(),
        element_bytes: 2,
        head_size: 128,
        model_kv_heads: 8,
        head_start: start,
        heads,
        tokens_per_block: TPB,
        interior: BlockInterior::Hnd as i32,
    };
    let head_block = u64::from(TPB) * HEAD;
    let ids: Vec<u32> = (0..48).map(|b| 2 * b + 1).collect();
    let mut ranks = Vec::new();
    for r in 0..2u32 {
        let layout = dense_layout(4, 2, 128, 4 * head_block);
        let kv = KvRegion::create(pair.shm_path(&format!("tp-p{r}")), layout).unwrap();
        fill(&kv, 10 + u64::from(r), 0..4, &ids).unwrap();
        let region = p
            .register_with_geometry(
                &format!("p{r}"),
                kv.memory.path(),
                layout,
                Some(geometry(4 * r, 4)),
                true,
            )
            .await
            .unwrap();
        ranks.push((kv, region));
    }
    let layout = dense_layout(4, 2, 128, 8 * head_block);
    let d_kv = KvRegion::create(pair.shm_path("tp-d"), layout).unwrap();
    let d_region = d
        .register_with_geometry("d0", d_kv.memory.path(), layout, Some(geometry(0, 8)), true)
        .await
        .unwrap();
    let dst: Vec<u32> = (0..48).rev().collect();
    for (r, (_, region)) in ranks.iter().enumerate() {
        let slice = HeadSlice {
            head_start: 4 * r as u32,
            head_count: 4,
            tokens: 48 * u64::from(TPB),
            chunk_tokens: TPB,
        };
        let t = d
            .pull(
                "d0",
                &format!("tp-pull-{r}"),
                "prefill",
                BlockRange {
                    slice: Some(slice),
                    ..blocks(*region, 0..4, ids.clone())
                },
                blocks(d_region, 0..4, dst.clone()),
            )
            .await
            .unwrap();
        wait_done(&mut d, &pair, t.transfer_id).await;
    }
    for layer in 0..4 {
        for plane in 0..2 {
            for (&s, &t) in ids.iter().zip(&dst) {
                let got = d_kv.read_block(layer, plane, t).unwrap();
                let mut want = ranks[0].0.read_block(layer, plane, s).unwrap();
                want.extend(ranks[1].0.read_block(layer, plane, s).unwrap());
                assert!(got == want, "layer {layer} plane {plane} block {t}");
            }
        }
    }
    // A window starting inside a block (a decode whose prefix cache holds
    // 24 tokens): tokens 24..64 of rank 0's heads, 8 tokens into its second
    // listed block, land from token 0 of fresh decode blocks, read one-sided.
    let window: Vec<u32> = (100..103).collect();
    let tokens = 40u64;
    let t = d
        .pull(
            "d0",
            "tp-pull-window",
            "prefill",
            BlockRange {
                slice: Some(HeadSlice {
                    head_start: 0,
                    head_count: 4,
                    tokens,
                    chunk_tokens: TPB,
                }),
                first_token: 8,
                ..blocks(ranks[0].1, 0..4, ids[1..4].to_vec())
            },
            blocks(d_region, 0..4, window.clone()),
        )
        .await
        .unwrap();
    wait_done(&mut d, &pair, t.transfer_id).await;
    let tpb = u64::from(TPB);
    for layer in 0..4 {
        for plane in 0..2 {
            for t in 0..tokens {
                let src = 24 + t;
                let from = ranks[0]
                    .0
                    .read_block(layer, plane, ids[(src / tpb) as usize])
                    .unwrap();
                let to = d_kv
                    .read_block(layer, plane, window[(t / tpb) as usize])
                    .unwrap();
                for h in 0..4u64 {
                    let at = |tok: u64| ((h * tpb + tok % tpb) * HEAD) as usize;
                    assert!(
                        to[at(t)..at(t) + HEAD as usize] == from[at(src)..at(src) + HEAD as usize],
                        "layer {layer} plane {plane} token {t} head {h}"
                    );
                }
            }
        }
    }
    let text = scrape(pair.decode.metrics.unwrap());
    let read = metric_sum(
        &text,
        "kvrail_bytes_received_total",
        &["transport=\"rdma\""],
    );
    let total = 4 * 2 * 48 * 8 * head_block + 4 * 2 * tokens * 4 * HEAD;
    assert!(read >= total as f64, "RDMA READ bytes {read} < {total}");
    assert_eq!(
        metric_sum(&text, "kvrail_bytes_received_total", &["transport=\"tcp\""]),
        0.0,
        "payload went over TCP"
    );
    for (kv, _) in ranks {
        kv.unlink();
    }
    d_kv.unlink();
}
