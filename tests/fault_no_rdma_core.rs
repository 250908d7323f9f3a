//! A host without rdma-core: `kvrail` must still start, say once why RDMA is
//! off, and move verified blocks over TCP. libibverbs is loaded at run time, so
//! the binary does not even link it (checked with `readelf`); where the library
//! is installed, each sidecar runs in a mount namespace in which every copy of
//! it is hidden under /dev/null.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvrail_client::proto::TransferState;
use kvrail_client::{blocks, dense_layout, KvRegion};
use kvrail_e2e::{binary, Pair};
use kvrail_examples::{fill, scattered_blocks, verify};

/// Every libibverbs file the dynamic loader could find.
fn installed_verbs_libraries() -> Vec<PathBuf> {
    let mut found = Vec::new();
    if let Ok(out) = Command::new("ldconfig").arg("-p").output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some((name, path)) = line.split_once("=>") {
                if name.trim_start().starts_with("libibverbs.so") {
                    found.push(PathBuf::from(path.trim()));
                }
            }
        }
    }
    for dir in ["/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib"] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let candidates = if p.is_dir() {
                std::fs::read_dir(&p)
                    .map(|d| d.flatten().map(|e| e.path()).collect())
                    .unwrap_or_default()
            } else {
                vec![p]
            };
            for c in candidates {
                let name = c.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                if name.starts_with("libibverbs.so") {
                    found.push(c);
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn kvrail_does_not_link_libibverbs() {
    let out = match Command::new("readelf")
        .args(["-d"])
        .arg(binary("kvrail"))
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            return kvrail_e2e::skip_or_fail(
                "kvrail_does_not_link_libibverbs",
                &format!("readelf not available ({e})"),
            )
        }
    };
    assert!(out.status.success());
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(
        dynamic.contains("(NEEDED)"),
        "no dynamic section? {dynamic}"
    );
    for lib in ["libibverbs", "librdmacm", "libnl", "libcuda"] {
        assert!(
            !dynamic.contains(lib),
            "kvrail links {lib} at load time:\n{dynamic}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_rdma_core_kvrail_serves_over_tcp_and_says_why() {
    let hide = installed_verbs_libraries();
    let dir = tempfile::tempdir().unwrap();
    if !hide.is_empty() {
        // A wrapper that starts each sidecar where libibverbs cannot be loaded.
        let unshare_ok = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "true"])
            .status()
            .is_ok_and(|s| s.success());
        if !unshare_ok {
            return kvrail_e2e::skip_or_fail(
                "without_rdma_core_kvrail_serves_over_tcp_and_says_why",
                "libibverbs is installed and no mount namespace can hide it (unshare --mount failed)",
            );
        }
        let mounts: String = hide
            .iter()
            .map(|p| format!("mount --bind /dev/null '{}' && ", p.display()))
            .collect();
        let script = dir.path().join("hide-rdma-core");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\nexec unshare --mount --propagation private sh -c \
                 \"{mounts}exec \\\"\\$0\\\" \\\"\\$@\\\"\" \"$@\"\n"
            ),
        )
        .unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // SAFETY of the environment: set before any sidecar starts; this test
        // binary runs no other test that reads it concurrently.
        std::env::set_var("KVRAIL_EXEC_WRAPPER", &script);
    }

    let pair = Pair::start(&[]);
    let mut p = pair.prefill.client().await;
    let mut d = pair.decode.client().await;
    let layout = dense_layout(2, 2, 32, 8192);
    let p_kv = KvRegion::create(pair.shm_path("p"), layout).unwrap();
    let d_kv = KvRegion::create(pair.shm_path("d"), layout).unwrap();
    let p_region = p.register_region("p0", &p_kv, true).await.unwrap();
    let d_region = d.register_region("d0", &d_kv, true).await.unwrap();

    let src = scattered_blocks(12, 32, 1);
    let dst = scattered_blocks(12, 32, 2);
    fill(&p_kv, 7, 0..2, &src).unwrap();
    let t = p
        .push(
            "p0",
            "r-push",
            "decode",
            blocks(p_region, 0..2, src.clone()),
            blocks(d_region, 0..2, dst.clone()),
        )
        .await
        .unwrap();
    let s = p
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "push: {s:?}");
    assert_eq!(verify(&d_kv, 7, 0..2, &dst).unwrap(), t.total_bytes);

    // And one-sided the other way: decode pulls other blocks.
    let src2 = scattered_blocks(8, 32, 3);
    let dst2: Vec<u32> = (0..32).filter(|b| !dst.contains(b)).take(8).collect();
    fill(&p_kv, 9, 0..2, &src2).unwrap();
    let t = d
        .pull(
            "d0",
            "r-pull",
            "prefill",
            blocks(p_region, 0..2, src2.clone()),
            blocks(d_region, 0..2, dst2.clone()),
        )
        .await
        .unwrap();
    let s = d
        .wait(t.transfer_id, Some(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(s.state, TransferState::Done as i32, "pull: {s:?}");
    assert_eq!(verify(&d_kv, 9, 0..2, &dst2).unwrap(), t.total_bytes);

    for side in [&pair.prefill, &pair.decode] {
        let log = side.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("RDMA off")).collect();
        assert_eq!(lines.len(), 1, "the reason is said once:\n{log}");
        assert!(
            lines[0].contains("libibverbs") && lines[0].contains("tcp"),
            "the reason names the library and the fallback: {}",
            lines[0]
        );
    }
}
