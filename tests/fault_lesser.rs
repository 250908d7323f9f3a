//! The lesser findings of the outside review, each against real processes:
//! notification streams resume without loss and are never taken over silently,
//! certificates together with `--insecure` are refused at start, and a
//! sidecar given `--parent-pid` does not outlive that parent.
//! (An Abort overtaking its open is tested deterministically in kvrail-core:
//! `an_abort_that_overtakes_its_open_leaves_no_orphan`; Python's default
//! `:authority` in clients/python/tests/test_client.py.)
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::time::Duration;

use kvrail_client::proto::{NotificationKind, TransferState};
use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_e2e::{binary, command, wait_until, Pair};
use kvrail_examples::fill;
use tokio_stream::StreamExt;
use tonic::Code;

/// 50 pushes land while the decode worker's stream is open; the worker reads
/// 10 notifications, drops the stream (a restart, a reconnect), and resubscribes
/// after the last sequence it saw: it gets exactly the other 40. Before the fix
/// those 40 were handed to the dropped stream and lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_resubscribing_worker_misses_no_notification() {
    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(1, 1, 64, 4096);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let pr = p.register_region("p0", &p_kv, false).await.unwrap();
    let dr = d.register_region("d0", &d_kv, false).await.unwrap();
    fill(&p_kv, 4, 0..1, &(0..50).collect::<Vec<_>>()).unwrap();

    let mut first = d.subscribe("d0").await.unwrap();
    let mut ids = Vec::new();
    for b in 0..50u32 {
        let t = p
            .push(
                "p0",
                &format!("r{b}"),
                "decode",
                blocks(pr, 0..1, vec![b]),
                blocks(dr, 0..1, vec![b]),
            )
            .await
            .unwrap();
        ids.push(t.transfer_id);
    }
    for id in &ids {
        let st = p.wait(*id, Some(Duration::from_secs(30))).await.unwrap();
        assert_eq!(st.state, TransferState::Done as i32);
    }
    let mut seen = Vec::new();
    for _ in 0..10 {
        let n = first.next().await.unwrap().unwrap();
        seen.push((n.sequence, n.request_id));
    }
    drop(first);
    let last = seen.last().unwrap().0;
    // The sidecar may not have seen the first stream close yet: a worker
    // resuming its own stream takes it over (a silent takeover is what the
    // next test rules out).
    let mut second = d.subscribe_after("d0", last, true).await.unwrap();
    for _ in 0..40 {
        let n = tokio::time::timeout(Duration::from_secs(10), second.next())
            .await
            .expect("a notification the first stream was handed is missing")
            .unwrap()
            .unwrap();
        assert_eq!(n.kind, NotificationKind::PushReceived as i32);
        seen.push((n.sequence, n.request_id));
    }
    let seqs: Vec<u64> = seen.iter().map(|s| s.0).collect();
    assert_eq!(
        seqs,
        (seqs[0]..seqs[0] + 50).collect::<Vec<_>>(),
        "no gap, no repeat"
    );
    let mut reqs: Vec<String> = seen.into_iter().map(|s| s.1).collect();
    reqs.sort();
    reqs.dedup();
    assert_eq!(reqs.len(), 50);
    p_kv.unlink();
    d_kv.unlink();
}

/// A second live subscription for a worker is refused, unless it asks to take
/// over; then the first stream is told why it ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_subscription_does_not_silently_take_over() {
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let mut first = d.subscribe("w").await.unwrap();
    let mut other = pair.decode.client().await;
    let err = other.subscribe("w").await.unwrap_err();
    assert_eq!(err.code(), Some(Code::AlreadyExists), "{err}");
    let _taker = other.subscribe_after("w", 0, true).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), first.next())
        .await
        .unwrap()
        .unwrap();
    let status = end.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert!(status.message().contains("taken over"), "{status}");
}

#[test]
fn certificates_with_insecure_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = command("kvrail")
        .args([
            "serve",
            "--node",
            "a",
            "--listen",
            "127.0.0.1:0",
            "--insecure",
        ])
        .arg("--tls-dir")
        .arg(dir.path())
        .arg("--socket")
        .arg(dir.path().join("a.sock"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("insecure and tls_dir together"), "{err}");
}

/// A sidecar given `--parent-pid` shuts down, removing its socket, once that
/// parent is killed outright (loadgen and the tests pass theirs, so that no
/// sidecar outlives a harness killed with SIGKILL).
#[test]
fn a_sidecar_goes_when_the_parent_it_was_given_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("orphan.sock");
    let pid_file = dir.path().join("sidecar.pid");
    // A shell starts the sidecar with the shell's own pid, then waits.
    let mut shell = std::process::Command::new("sh")
        .arg("-c")
        .arg(
            r#""$0" serve --node orphan --socket "$1" --listen 127.0.0.1:0 --insecure \
                 --parent-pid $$ >/dev/null 2>"$3" &
               echo $! > "$2"; wait"#,
        )
        .arg(binary("kvrail"))
        .arg(&socket)
        .arg(&pid_file)
        .arg(dir.path().join("orphan.log"))
        .spawn()
        .unwrap();
    let read_pid = || {
        std::fs::read_to_string(&pid_file)
            .ok()?
            .trim()
            .parse::<u32>()
            .ok()
    };
    wait_until("the sidecar serves", || {
        socket.exists() && read_pid().is_some()
    });
    let pid = read_pid().unwrap();
    let running = || {
        // Gone, or a zombie nobody has reaped yet.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    };
    assert!(running(), "the sidecar stopped while its parent lived");
    // A pid that is not its parent is refused at start, saying so.
    let refused = command("kvrail")
        .args([
            "serve",
            "--node",
            "x",
            "--insecure",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--socket")
        .arg(dir.path().join("x.sock"))
        .args(["--parent-pid", &pid.to_string()])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("is not this process's parent"), "{err}");
    shell.kill().unwrap();
    shell.wait().unwrap();
    wait_until("the orphaned sidecar exits", || !running());
    assert!(!socket.exists(), "the sidecar left its socket behind");
}
