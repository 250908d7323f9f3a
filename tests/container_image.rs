//! deploy/Containerfile builds an image (with podman, on a Debian base made
//! here with debootstrap: this machine reaches no container registry), and
//! two containers of it on the host network move a verified transfer for
//! workers on the host. Needs root, podman and debootstrap (CI has them);
//! containers run in a mount namespace with the cgroup v1 `unified` mount
//! removed, with explicit ulimits, as this machine requires.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, Client, KvRegion};
use kvrail_e2e::{binary, free_port, shm_path, skip_or_fail, workspace_root};
use kvrail_examples::{fill, verify};

const TEST: &str = "the_image_builds_and_two_containers_move_a_verified_transfer";
const BASE: &str = "localhost/kvrail-test-base:bookworm";
const IMAGE: &str = "localhost/kvrail:test";

/// `podman ARGS` in a mount namespace without the cgroup v1 `unified` mount.
fn podman(args: &[&str]) -> Output {
    Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg("umount /sys/fs/cgroup/unified 2>/dev/null; exec podman \"$@\"")
        .arg("podman")
        .args(args)
        .output()
        .expect("run podman")
}

/// `podman run` with the limits this machine's podman needs given explicitly.
fn podman_run(args: &[&str]) -> Output {
    let limits = [
        "--ulimit",
        "nofile=4096:4096",
        "--ulimit",
        "nproc=4096:4096",
    ];
    let all: Vec<&str> = ["run"].iter().chain(&limits).chain(args).copied().collect();
    podman(&all)
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn have(program: &str) -> bool {
    Command::new(program).arg("--version").output().is_ok()
}

/// A Debian 12 base image made with debootstrap (cached under target/).
fn base_image() {
    if podman(&["image", "exists", BASE]).status.success() {
        return;
    }
    let dir = workspace_root().join("target/container-base");
    let rootfs = dir.join("rootfs");
    let stamp = dir.join("complete");
    if !stamp.exists() {
        let _ = std::fs::remove_dir_all(&rootfs);
        std::fs::create_dir_all(&dir).unwrap();
        ok(
            "debootstrap",
            Command::new("debootstrap")
                .args(["--variant=minbase", "bookworm"])
                .arg(&rootfs)
                .arg("http://deb.debian.org/debian")
                .output()
                .unwrap(),
        );
        std::fs::write(&stamp, b"").unwrap();
    }
    let import = format!(
        "umount /sys/fs/cgroup/unified 2>/dev/null; tar -C {} -c . | podman import - {BASE}",
        rootfs.display()
    );
    ok(
        "podman import",
        Command::new("unshare")
            .args(["-m", "sh", "-c", &import])
            .output()
            .unwrap(),
    );
}

/// A container removed when dropped.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "-f", "-t", "2", &self.0]);
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Starts a sidecar container named NAME with its socket in `dir`.
fn sidecar(dir: &Path, node: &str, port: u16, peer: &str, peer_port: u16) -> Container {
    let name = format!("kvrail-test-{}-{node}", std::process::id());
    let _ = podman(&["rm", "-f", &name]);
    let socket_dir = format!("{}:/run/kvrail", dir.display());
    let listen = loopback(port).to_string();
    let peer = format!("{peer}={}", loopback(peer_port));
    let socket = format!("/run/kvrail/{node}.sock");
    ok(
        "podman run",
        podman_run(&[
            "-d",
            "--name",
            &name,
            "--network",
            "host",
            "-v",
            &socket_dir,
            "-v",
            "/dev/shm:/dev/shm",
            IMAGE,
            "serve",
            "--node",
            node,
            "--socket",
            &socket,
            "--listen",
            &listen,
            "--peer",
            &peer,
            "--insecure",
            "--no-rdma",
        ]),
    );
    Container(name)
}

async fn connect(socket: &Path, container: &Container) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = Client::connect(socket).await {
            if c.list_peers().await.is_ok() {
                return c;
            }
        }
        if Instant::now() > deadline {
            let logs = podman(&["logs", &container.0]);
            panic!(
                "the sidecar in {} did not answer on {}:\n{}",
                container.0,
                socket.display(),
                String::from_utf8_lossy(&logs.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_image_builds_and_two_containers_move_a_verified_transfer() {
    let root = kvrail_e2e::running_as_root();
    if !root || !have("podman") || !have("debootstrap") {
        skip_or_fail(
            TEST,
            "needs root, podman and debootstrap (apt-get install podman debootstrap)",
        );
        return;
    }
    base_image();
    // The build context: the binary this checkout built, as deploy/Containerfile
    // takes target/release/kvrail from the repository.
    let context = tempfile::tempdir().unwrap();
    std::fs::copy(binary("kvrail"), context.path().join("kvrail")).unwrap();
    let containerfile: PathBuf = workspace_root().join("deploy/Containerfile");
    let built = Instant::now();
    ok(
        "podman build",
        podman(&[
            "build",
            "--network",
            "host",
            "-f",
            containerfile.to_str().unwrap(),
            "--build-arg",
            &format!("RUNTIME_IMAGE={BASE}"),
            "--build-arg",
            "KVRAIL_BIN=kvrail",
            "-t",
            IMAGE,
            context.path().to_str().unwrap(),
        ]),
    );
    println!("image built in {:?}", built.elapsed());
    let version = ok(
        "podman run --version",
        podman_run(&["--rm", "--network", "host", IMAGE, "--version"]),
    );
    assert!(version.starts_with("kvrail "), "{version}");

    let dir = tempfile::tempdir().unwrap();
    let (pp, dp) = (free_port(), free_port());
    let p = sidecar(dir.path(), "prefill", pp, "decode", dp);
    let d = sidecar(dir.path(), "decode", dp, "prefill", pp);
    let mut pc = connect(&dir.path().join("prefill.sock"), &p).await;
    let mut dc = connect(&dir.path().join("decode.sock"), &d).await;

    let layout = dense_layout(2, 2, 32, 16384);
    let src = KvRegion::create(shm_path(pp, "container-src"), layout).unwrap();
    let dst = KvRegion::create(shm_path(dp, "container-dst"), layout).unwrap();
    let ids: Vec<u32> = (0..32).collect();
    fill(&src, 42, 0..2, &ids).unwrap();
    let rs = pc.register_region("w", &src, true).await.unwrap();
    let rd = dc.register_region("w", &dst, true).await.unwrap();
    let t = pc
        .push(
            "w",
            "in-containers",
            "decode",
            blocks(rs, 0..2, ids.clone()),
            blocks(rd, 0..2, ids.clone()),
        )
        .await
        .unwrap();
    let s = pc
        .wait(t.transfer_id, Some(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    assert_eq!(verify(&dst, 42, 0..2, &ids).unwrap(), 2 << 20);
    src.unlink();
    dst.unlink();
}
