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
fn demo_compares_transports_on_the_same_requests() {
    let out = Command::new(binary("loadgen"))
        .args([
            "demo",
            "--requests",
            "3",
            "--max-prompt-tokens",
            "1024",
            "--quiet",
            "--transport",
            "tcp,quic",
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
    let transports: Vec<&str> = lines
        .iter()
        .map(|v| v["transport"].as_str().unwrap())
        .collect();
    assert_eq!(transports, ["tcp", "quic"], "{lines:?}");
    // The same requests moved, and verified, over each.
    assert_eq!(lines[0]["kv_bytes_total"], lines[1]["kv_bytes_total"]);
    assert_eq!(lines[1]["verified_bytes"], lines[1]["kv_bytes_total"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("quic: 3 requests"), "{stderr}");
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
    let (compares, points): (Vec<_>, Vec<_>) = lines.iter().partition(|v| v["bench"] == "compare");
    let kinds: Vec<(String, String, String, u64)> = points
        .iter()
        .map(|v| {
            (
                v["transport"].as_str().unwrap().to_string(),
                v["bench"].as_str().unwrap().to_string(),
                v["op"].as_str().unwrap().to_string(),
                v["bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    // Both transports of the default `--transport tcp,quic`, in one run.
    for transport in ["tcp", "quic"] {
        for (bench, op, bytes) in [
            ("single", "push", 1 << 20),
            ("single", "pull", 65536),
            ("scattered", "push", 16 * 160 * 1024),
            ("latency", "push", 4096),
        ] {
            let want = (
                transport.to_string(),
                bench.to_string(),
                op.to_string(),
                bytes,
            );
            assert!(kinds.contains(&want), "{want:?} missing from {kinds:?}");
        }
    }
    for v in &points {
        assert!(v["p50_us"].as_u64().unwrap() > 0, "{v}");
        if v["bench"] != "latency" {
            assert!(v["gbps"].as_f64().unwrap() > 0.0, "{v}");
        }
    }
    // Every throughput point of quic is put against the same point of tcp.
    let throughput = points
        .iter()
        .filter(|v| v["transport"] == "quic" && v["bench"] != "latency")
        .count();
    assert_eq!(compares.len(), throughput, "{compares:?}");
    for c in &compares {
        assert_eq!((&c["transport"], &c["vs"]), (&"quic".into(), &"tcp".into()));
        let expected = c["gbps"].as_f64().unwrap() / c["vs_gbps"].as_f64().unwrap();
        // Rates are printed to 3 decimals, the ratio comes from the exact ones.
        let ratio = c["ratio"].as_f64().unwrap();
        assert!((ratio - expected).abs() <= 0.05 * expected + 0.002, "{c}");
    }
}
