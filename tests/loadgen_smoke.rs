//! The main job (`loadgen demo`) and the benchmark run end to end on a small
//! workload and print well-formed results.
#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::process::Command;

use kvrail_e2e::binary;

fn json_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn demo_replays_trace_requests_and_verifies_them() {
    let out = Command::new(binary("loadgen"))
        .args([
            "demo",
            "--requests",
            "5",
            "--max-prompt-tokens",
            "2048",
            "--quiet",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let s = &lines[0];
    assert_eq!(s["requests"], 5);
    // The bundled trace's first five prompts, clipped at 2048 tokens, at 128 KiB per token:
    // every one is longer than 2048 tokens, so 5 x 2048 x 128 KiB.
    assert_eq!(s["kv_bytes_total"], 5 * 2048 * 131072u64);
    assert_eq!(s["verified_bytes"], s["kv_bytes_total"]);
    let share = s["transfer_share_of_ttft_p50"].as_f64().unwrap();
    assert!(share > 0.0 && share < 1.0, "{share}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("verified byte for byte"), "{stderr}");
}

#[test]
fn bench_prints_one_json_result_per_measurement() {
    let out = Command::new(binary("loadgen"))
        .args([
            "bench",
            "--only",
            "single,scattered,latency",
            "--sizes",
            "64K,1M",
            "--ops",
            "push,pull",
        ])
        .args([
            "--scattered",
            "16x160K",
            "--latency-samples",
            "20",
            "--bytes-per-point",
            "1M",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let kinds: Vec<(String, String, u64)> = lines
        .iter()
        .map(|v| {
            (
                v["bench"].as_str().unwrap().to_string(),
                v["op"].as_str().unwrap().to_string(),
                v["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    for expected in [
        ("single", "push", 1 << 20),
        ("single", "pull", 65536),
        ("scattered", "push", 16 * 160 * 1024),
        ("latency", "push", 4096),
    ] {
        assert!(
            kinds.contains(&(expected.0.to_string(), expected.1.to_string(), expected.2)),
            "{expected:?} missing from {kinds:?}"
        );
    }
    for v in &lines {
        assert_eq!(v["transport"], "tcp");
        assert!(v["p50_us"].as_u64().unwrap() > 0, "{v}");
        if v["bench"] != "latency" {
            assert!(v["gbps"].as_f64().unwrap() > 0.0, "{v}");
        }
    }
}
