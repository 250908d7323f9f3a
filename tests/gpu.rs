//! GPU regions end to end: two real sidecars on loopback, KV in GPU memory
//! exported by CUDA IPC, moved through the staged pipeline over TCP and
//! verified on the GPU. Tests that need a GPU print why they skip when there is
//! none; the refusal of GPU regions without one is tested everywhere.

#[allow(dead_code)]
mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

use kvrail_client::gpu::{cuda, Gpu, GpuKvRegion};
use kvrail_client::proto::{RegionLayout, TransferState};
use kvrail_client::{blocks, dense_layout, KvRegion};
use support::{binary, Pair};
use tonic::Code;

/// The GPU, or the reason there is none (printed, and the test passes).
fn gpu_or_skip(test: &str) -> Option<Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(e) => {
            kvrail_e2e::say_skipped(test, &format!("no GPU here ({e})"));
            None
        }
    }
}

fn small_layout() -> RegionLayout {
    dense_layout(4, 2, 16, 32 << 10)
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_gpu_gpu_regions_are_refused_with_the_reason() {
    if Gpu::open(0).is_ok() {
        kvrail_e2e::say_skipped(
            "without_a_gpu_gpu_regions_are_refused_with_the_reason",
            "this machine has a GPU (the GPU tests cover it)",
        );
        return;
    }
    let pair = Pair::start(&[]);
    let mut c = pair.prefill.client().await;
    let err = c
        .register_gpu("w", &[0u8; 64], 0, small_layout(), false)
        .await
        .expect_err("a GPU region without a GPU");
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("no CUDA driver") || text.contains("no CUDA device"),
        "{text}"
    );
    // Asking for both kinds of memory at once, or neither, is malformed.
    let err = c
        .register_gpu("w", &[], 0, small_layout(), false)
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Some(Code::FailedPrecondition), "{err}");
    assert!(c.list_peers().await.is_ok(), "the daemon stays up");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exited_workers_regions_are_unregistered() {
    // A worker process registers a host region and dies; the sidecar drops it.
    let pair = Pair::start(&[]);
    // Answering its API means its metrics listener is up too.
    let _ = pair.prefill.client().await;
    let metrics = pair.prefill.metrics.expect("metrics");
    // Registration takes shared-memory files only: a directory in /dev/shm.
    let shm_dir = tempfile::tempdir_in(kvrail_client::shm_dir()).expect("shm dir");
    let mut worker = Command::new(binary("prefill_worker"))
        .args([
            "--socket",
            &pair.prefill.socket.display().to_string(),
            "--expose",
            "--handoff",
            &shm_dir.path().join("handoff").display().to_string(),
            "--shm-dir",
            &shm_dir.path().display().to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start prefill_worker");
    let registered = |n: u64| {
        support::scrape(metrics)
            .lines()
            .any(|l| l == format!("kvrail_regions_registered {n}"))
    };
    support::wait_until("the worker's region is registered", || registered(1));
    worker.kill().expect("kill the worker");
    let _ = worker.wait();
    support::wait_until("the exited worker's region is dropped", || registered(0));
    assert!(
        pair.prefill
            .log()
            .contains("worker exited: region unregistered"),
        "{}",
        pair.prefill.log()
    );
}

/// Runs the example worker for one transfer and checks its report.
fn gpu_transfer(pair: &Pair, bytes: u64, mode: &str) -> serde_json::Value {
    let out = Command::new(binary("gpu_worker"))
        .args([
            "transfer",
            "--prefill-socket",
            &pair.prefill.socket.display().to_string(),
            "--decode-socket",
            &pair.decode.socket.display().to_string(),
            "--bytes",
            &bytes.to_string(),
            "--mode",
            mode,
        ])
        .output()
        .expect("run gpu_worker");
    assert!(
        out.status.success(),
        "gpu_worker {mode} failed: {}\nprefill log:\n{}\ndecode log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        pair.prefill.log(),
        pair.decode.log()
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("gpu_worker prints one JSON line");
    assert_eq!(report["mismatched_words"], 0, "{report}");
    report
}

#[tokio::test(flavor = "multi_thread")]
async fn one_gib_of_gpu_kv_moves_gpu_to_gpu_over_tcp_verified_on_the_gpu() {
    if gpu_or_skip("one_gib_of_gpu_kv_moves_gpu_to_gpu_over_tcp_verified_on_the_gpu").is_none() {
        return;
    }
    let pair = Pair::start(&[]);
    let push = gpu_transfer(&pair, 1 << 30, "push");
    assert_eq!(push["bytes"], 1u64 << 30, "{push}");
    let pull = gpu_transfer(&pair, 1 << 30, "pull");
    assert_eq!(pull["bytes"], 1u64 << 30, "{pull}");
    // Both directions went through the staging buffers of both sidecars.
    for (s, direction) in [(&pair.prefill, "to_host"), (&pair.decode, "to_device")] {
        let text = support::scrape(s.metrics.expect("metrics"));
        let staged = support::metric_sum(
            &text,
            "kvrail_gpu_staged_bytes_total",
            &[&format!("direction=\"{direction}\"")],
        );
        assert!(
            staged >= (2u64 << 30) as f64,
            "{} staged {staged} bytes {direction}",
            s.node
        );
    }
}

/// A prefill sidecar that cuts GPU transfers into 8 MiB slices sends them to
/// a decode sidecar whose staging buffers are 4 MiB (its default): the
/// receiver's buffers grow to the larger slices instead of failing them, both
/// ways (a push, and a pull the prefill side serves).
#[tokio::test(flavor = "multi_thread")]
async fn larger_gpu_slices_than_the_receivers_staging_buffers_still_land() {
    if gpu_or_skip("larger_gpu_slices_than_the_receivers_staging_buffers_still_land").is_none() {
        return;
    }
    let lo = [std::net::IpAddr::from([127, 0, 0, 1])];
    let pair = Pair::start_each(
        &lo,
        &lo,
        &["--gpu-slice-bytes", "8388608", "--window-bytes", "16777216"],
        &[],
    );
    for mode in ["push", "pull"] {
        let report = gpu_transfer(&pair, 256 << 20, mode);
        assert_eq!(report["bytes"], 256u64 << 20, "{report}");
    }
    let text = support::scrape(pair.decode.metrics.expect("metrics"));
    let staged = support::metric_sum(
        &text,
        "kvrail_gpu_staged_bytes_total",
        &["direction=\"to_device\""],
    );
    assert!(
        staged >= (512u64 << 20) as f64,
        "decode staged {staged} bytes"
    );
    let buffer = support::metric_sum(&text, "kvrail_gpu_staging_buffer_bytes", &[]);
    assert!(
        buffer > (4u64 << 20) as f64,
        "the decode side's staging buffers never grew past 4 MiB ({buffer}): no larger slice arrived"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn gpu_to_host_and_host_to_gpu_mix_in_one_pair() {
    let Some(gpu) = gpu_or_skip("gpu_to_host_and_host_to_gpu_mix_in_one_pair") else {
        return;
    };
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = small_layout();
    let src = GpuKvRegion::create(&gpu, layout).expect("gpu region");
    src.fill(7).expect("fill");
    let src_id = src.register(&mut p, "p", true).await.expect("register gpu");
    let host = KvRegion::create(pair.shm_path("mix-host"), layout).expect("host region");
    let host_id = d
        .register_region("d", &host, true)
        .await
        .expect("register host");
    // GPU -> host, the source blocks scattered (a permutation): each staged
    // slice gathers many separate pieces (one batched copy where the driver
    // has cuMemcpyBatchAsync).
    let ids: Vec<u32> = (0..16).collect();
    let scattered: Vec<u32> = (0..16).map(|i| (i * 7) % 16).collect();
    let t = p
        .push(
            "p",
            "mix-1",
            "decode",
            blocks(src_id, 0..4, scattered.clone()),
            blocks(host_id, 0..4, ids.clone()),
        )
        .await
        .expect("push");
    let s = p.wait(t.transfer_id, None).await.expect("wait");
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    let word = |bytes: &[u8], i: usize| {
        u32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    for layer in 0..4 {
        for plane in 0..2 {
            for b in 0..16u32 {
                let got = host.read_block(layer, plane, b).expect("read");
                let source = scattered[b as usize];
                let first = kvrail_client::block_offset(&layout, layer, plane, source) / 4;
                for i in 0..got.len() / 4 {
                    assert_eq!(
                        word(&got, i),
                        cuda::pattern_word(7, first + i as u64),
                        "block {layer}/{plane}/{b}"
                    );
                }
            }
        }
    }
    // Host -> GPU: the host blocks back into a second GPU region, blocks reversed.
    let back = GpuKvRegion::create(&gpu, layout).expect("gpu region");
    let back_id = back.register(&mut p, "p", false).await.expect("register");
    let rev: Vec<u32> = (0..16).rev().collect();
    let t = p
        .pull(
            "p",
            "mix-2",
            "decode",
            blocks(host_id, 0..4, ids.clone()),
            blocks(back_id, 0..4, rev.clone()),
        )
        .await
        .expect("pull");
    let s = p.wait(t.transfer_id, None).await.expect("wait");
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    // Host block i holds source block scattered[i], now in GPU block rev[i].
    let pairs: Vec<(u32, u32)> = scattered.into_iter().zip(rev).collect();
    assert_eq!(back.mismatches(&layout, 7, &pairs).expect("verify"), 0);
    host.unlink();
}

#[tokio::test(flavor = "multi_thread")]
async fn unified_memory_is_written_by_the_gpu_and_sent_without_staging() {
    // The integrated-GPU path: the KV cache is a shared-memory file pinned and
    // mapped for the GPU; kernels write it in place and the sidecar sends it as
    // host memory, with no staging copy.
    let Some(gpu) = gpu_or_skip("unified_memory_is_written_by_the_gpu_and_sent_without_staging")
    else {
        return;
    };
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = small_layout();
    let src = KvRegion::create(pair.shm_path("um-src"), layout).expect("src");
    let dst = KvRegion::create(pair.shm_path("um-dst"), layout).expect("dst");
    let src_gpu = cuda::HostRegistration::pin(&gpu, &src.memory).expect("pin src");
    let dst_gpu = cuda::HostRegistration::pin(&gpu, &dst.memory).expect("pin dst");
    let bytes = kvrail_client::layout_extent(&layout);
    src_gpu.fill(0, bytes, 11, 0).expect("fill on the GPU");
    let src_id = p.register_region("p", &src, false).await.expect("register");
    let dst_id = d.register_region("d", &dst, false).await.expect("register");
    let ids: Vec<u32> = (0..16).collect();
    let t = p
        .push(
            "p",
            "um-1",
            "decode",
            blocks(src_id, 0..4, ids.clone()),
            blocks(dst_id, 0..4, ids),
        )
        .await
        .expect("push");
    let s = p.wait(t.transfer_id, None).await.expect("wait");
    assert_eq!(s.state, TransferState::Done as i32, "{s:?}");
    // Verified by the GPU through its mapping of the decode side's pages.
    assert_eq!(
        dst_gpu.count_mismatches(0, bytes, 11, 0).expect("verify"),
        0
    );
    for s in [&pair.prefill, &pair.decode] {
        let text = support::scrape(s.metrics.expect("metrics"));
        assert_eq!(
            support::metric_sum(&text, "kvrail_gpu_staged_bytes_total", &[]),
            0.0,
            "{}",
            s.node
        );
    }
    drop((src_gpu, dst_gpu));
    src.unlink();
    dst.unlink();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_gpu_handles_get_clear_errors_and_the_daemon_stays_up() {
    let Some(gpu) = gpu_or_skip("bad_gpu_handles_get_clear_errors_and_the_daemon_stays_up") else {
        return;
    };
    let pair = Pair::start(&[]);
    let mut c = pair.prefill.client().await;
    let layout = small_layout();
    let expect_refused = |r: Result<u64, kvrail_client::ClientError>, what: &str, needle: &str| {
        let err = r.expect_err(what);
        assert_eq!(err.code(), Some(Code::InvalidArgument), "{what}: {err}");
        assert!(err.to_string().contains(needle), "{what}: {err}");
    };
    // Garbage bytes, and a handle of the wrong length.
    let garbage: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
    expect_refused(
        c.register_gpu("w", &garbage, 0, layout, false).await,
        "garbage handle",
        "bad CUDA IPC handle",
    );
    expect_refused(
        c.register_gpu("w", &[1, 2, 3], 0, layout, false).await,
        "short handle",
        "expected 64",
    );
    // A region larger than the allocation behind a real handle.
    let small = cuda::DeviceBuffer::zeroed(&gpu, 1 << 20).expect("alloc");
    let handle = small.ipc_handle().expect("handle");
    let big = dense_layout(4, 2, 64, 32 << 10); // 16 MiB
    expect_refused(
        c.register_gpu("w", &handle, 0, big, false).await,
        "region too large",
        "does not fit",
    );
    // A handle from a process that has exited.
    let mut exporter = Command::new(binary("gpu_worker"))
        .args(["export", "--bytes", &(1u64 << 20).to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start exporter");
    let mut line = String::new();
    BufReader::new(exporter.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("handle line");
    let stale: Vec<u8> = (0..line.trim().len() / 2)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    drop(exporter.stdin.take());
    assert!(exporter.wait().expect("exporter exits").success());
    expect_refused(
        c.register_gpu("w", &stale, 0, dense_layout(1, 1, 1, 4096), false)
            .await,
        "handle of an exited process",
        "bad CUDA IPC handle",
    );
    // Still serving: a good region registers and moves.
    let good = GpuKvRegion::create(&gpu, layout).expect("alloc");
    let id = good
        .register(&mut c, "w", false)
        .await
        .expect("a good handle registers");
    c.unregister_region(id).await.expect("unregister");
    assert!(c.list_peers().await.is_ok());
}
