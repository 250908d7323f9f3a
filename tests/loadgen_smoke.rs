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
    // The ring beside gRPC, and the layer-wise run over the ring (#23).
    let (ring_lines, points): (Vec<_>, Vec<_>) = points
        .into_iter()
        .partition(|v| v["bench"] == "latency_path" || v["bench"] == "layerwise");
    // After its QUIC points, how each sidecar's connections fall on its
    // receiving sockets: the pushes' receiver carries the connections.
    let (sockets, points): (Vec<_>, Vec<_>) = points
        .into_iter()
        .partition(|v| v["bench"] == "quic_sockets");
    let receiver = sockets
        .iter()
        .find(|v| v["sidecar"] == "decode")
        .unwrap_or_else(|| panic!("no quic_sockets line for the decode sidecar: {sockets:?}"));
    let per_socket: Vec<u64> = receiver["per_socket"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert!(receiver["connections"].as_u64().unwrap() >= 1, "{receiver}");
    assert_eq!(
        per_socket.iter().sum::<u64>(),
        receiver["connections"].as_u64().unwrap(),
        "{receiver}"
    );
    for transport in ["tcp", "quic"] {
        for path in ["grpc", "ring"] {
            for bytes in [4096u64, 65536, 1 << 20] {
                let found = ring_lines.iter().find(|v| {
                    v["bench"] == "latency_path"
                        && v["transport"] == transport
                        && v["path"] == path
                        && v["bytes"].as_u64() == Some(bytes)
                });
                let v = found.unwrap_or_else(|| panic!("{transport} {path} {bytes} missing"));
                assert!(v["p50_us"].as_u64().unwrap() > 0, "{v}");
            }
        }
        for layers in [32u64, 80] {
            let v = ring_lines
                .iter()
                .find(|v| {
                    v["bench"] == "layerwise"
                        && v["transport"] == transport
                        && v["layers"].as_u64() == Some(layers)
                })
                .unwrap_or_else(|| panic!("{transport} layerwise {layers} missing"));
            assert!(v["submit_p50_us"].as_f64().unwrap() > 0.0, "{v}");
            assert!(v["all_landed_p50_us"].as_u64().unwrap() > 0, "{v}");
        }
    }
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

fn replay(args: &[&str]) -> std::process::Output {
    Command::new(binary("loadgen"))
        .arg("replay")
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// The summary line of one series of a replay.
fn series<'a>(
    lines: &'a [serde_json::Value],
    source: &str,
    name: &str,
    overlap: &str,
) -> &'a serde_json::Value {
    lines
        .iter()
        .find(|v| {
            v["replay"] == "summary"
                && v["source"] == source
                && v["series"] == name
                && v["overlap"] == overlap
        })
        .unwrap_or_else(|| panic!("no {source} {name} {overlap} in {lines:?}"))
}

#[test]
fn replay_moves_a_short_trace_live_over_tcp_and_quic_and_projects_it() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = replay(&[
        "--requests",
        "6",
        "--time-scale",
        "0.05",
        "--kv-scale",
        "1/64",
        "--transport",
        "tcp,quic",
        "--overlap",
        "layer,all",
        "--prefix-reuse",
        "--pool-bytes",
        "128M",
        "--max-prompt-tokens",
        "16384",
        "--quiet",
        "--out",
        out_dir.path().to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines = json_lines(&out.stdout);
    let config = &lines[0];
    assert_eq!(config["replay"], "config");
    assert_eq!(config["requests"], 6);
    assert_eq!(config["live_submit"], "ring");
    let total = config["kv_bytes_total"].as_u64().unwrap();
    assert!(total > 0);
    for transport in ["tcp", "quic"] {
        for overlap in ["layer", "all"] {
            let s = series(&lines, "live", transport, overlap);
            assert_eq!(s["requests"], 6, "{s}");
            // Full-size bytes recorded; a 64th of them really moved.
            assert_eq!(s["kv_bytes"].as_u64().unwrap(), total);
            assert_eq!(s["moved_bytes"].as_u64().unwrap(), total / 64);
            assert_eq!(
                stderr
                    .matches(&format!("{transport} {overlap}: 6 requests"))
                    .count(),
                1,
                "{stderr}"
            );
        }
        // Sending each layer as it finishes overlaps prefill; sending after
        // the last layer cannot.
        let layer = series(&lines, "live", transport, "layer")["hidden_share"]
            .as_f64()
            .unwrap();
        let all = series(&lines, "live", transport, "all")["hidden_share"]
            .as_f64()
            .unwrap();
        assert!(layer > all && all <= 0.01, "{layer} {all}");
    }
    assert!(stderr.contains("verified byte for byte"), "{stderr}");
    // A free transfer is never slower than a live one; projections cover the
    // seeds' profiles and one calibrated from each live transport.
    let ideal = series(&lines, "projected", "ideal", "layer")["ttft_p50_ms"]
        .as_f64()
        .unwrap();
    let live = series(&lines, "live", "tcp", "layer")["ttft_p50_ms"]
        .as_f64()
        .unwrap();
    assert!(ideal <= live, "{ideal} {live}");
    for name in [
        "spark-rdma-2rail",
        "spark-rdma-1rail",
        "spark-tcp",
        "calibrated-tcp",
        "calibrated-quic",
    ] {
        for overlap in ["layer", "all"] {
            series(&lines, "projected", name, overlap);
        }
    }
    // One CSV row per request per series, and the summary file.
    let csv = std::fs::read_to_string(out_dir.path().join("requests.csv")).unwrap();
    let series_count = lines.iter().filter(|v| v["replay"] == "summary").count();
    assert_eq!(csv.lines().count(), 1 + 6 * series_count);
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out_dir.path().join("summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["series"].as_array().unwrap().len(), series_count);
    if std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for f in [
            "ttft_cdf.svg",
            "ttft_cdf.png",
            "exposed_vs_kv.svg",
            "exposed_vs_kv.png",
        ] {
            let len = std::fs::metadata(out_dir.path().join(f)).unwrap().len();
            assert!(len > 1000, "{f}: {len} bytes");
        }
    } else {
        kvrail_e2e::say_skipped(
            "the plot files of the loadgen smoke test",
            "no DejaVu Sans font",
        );
    }
}

/// `--submit grpc` replays with one gRPC call per push instead of the ring.
#[test]
fn replay_submits_through_grpc_on_request() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = replay(&[
        "--requests",
        "3",
        "--time-scale",
        "0.05",
        "--kv-scale",
        "1/64",
        "--transport",
        "tcp",
        "--overlap",
        "layer",
        "--submit",
        "grpc",
        "--pool-bytes",
        "64M",
        "--max-prompt-tokens",
        "4096",
        "--quiet",
        "--out",
        out_dir.path().to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines = json_lines(&out.stdout);
    assert_eq!(lines[0]["live_submit"], "grpc");
    assert_eq!(series(&lines, "live", "tcp", "layer")["requests"], 3);
    assert!(
        stderr.contains("tcp layer (gRPC submissions): 3 requests"),
        "{stderr}"
    );
}

#[test]
fn replay_projects_an_azure_trace_and_names_bad_trace_lines() {
    let dir = tempfile::tempdir().unwrap();
    let out = replay(&[
        "--trace",
        // The copy bundled in the binary, by bare name.
        "azure_code_head.csv",
        "--transport",
        "none",
        "--model",
        "llama-3.1-70b",
        "--tp",
        "8",
        "--quiet",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    assert_eq!(lines[0]["requests"], 300);
    // TP 8 of a 70B model: one KV head per rank, 40 KiB per token.
    assert_eq!(lines[0]["kv_bytes_per_token_per_rank"], 40960);
    assert!(lines.iter().all(|v| v["source"] != "live"));
    series(&lines, "projected", "spark-rdma-2rail", "layer");

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n{\"timestamp\":1,\"input_length\":-4}\n",
    )
    .unwrap();
    let out = replay(&["--trace", bad.to_str().unwrap(), "--transport", "none"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.jsonl:2"), "{stderr}");
}

/// `--prefill-tp`/`--decode-tp`: every rank of both engines emulated, each
/// decode rank's heads taken from the prefill ranks holding them and checked
/// byte for byte (the replay fails on any wrong byte); a TP that does not
/// shard the model's heads is refused by name.
#[test]
fn replay_moves_kv_between_engines_of_different_tensor_parallelism() {
    for (prefill, decode, pushes) in [("2", "1", 2), ("1", "4", 4), ("8", "2", 8)] {
        let out_dir = tempfile::tempdir().unwrap();
        let out = replay(&[
            "--requests",
            "3",
            "--time-scale",
            "0.05",
            "--kv-scale",
            "1/16",
            "--transport",
            "tcp",
            "--overlap",
            "layer",
            "--prefill-tp",
            prefill,
            "--decode-tp",
            decode,
            "--pool-bytes",
            "32M",
            "--max-prompt-tokens",
            "2048",
            "--quiet",
            "--out",
            out_dir.path().to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "TP {prefill} -> {decode}: {stderr}");
        let lines = json_lines(&out.stdout);
        assert_eq!(lines[0]["prefill_tp"], prefill.parse::<u32>().unwrap());
        assert_eq!(lines[0]["decode_tp"], decode.parse::<u32>().unwrap());
        // Llama-3.1-8B's 8 KV heads: one push per (decode rank, source rank).
        assert_eq!(lines[0]["live_pushes_per_piece"], pushes, "{}", lines[0]);
        assert_eq!(series(&lines, "live", "tcp", "layer")["requests"], 3);
        assert!(
            stderr.contains("moved and verified byte for byte"),
            "{stderr}"
        );
    }
    let out = replay(&["--prefill-tp", "3", "--transport", "none", "--quiet"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--prefill-tp 3 does not divide"),
        "{stderr}"
    );
}

/// `replay --cluster`: sidecars that know each other only through a real
/// etcd, requests routed by both policies, every byte verified (the replay
/// fails on any wrong byte), TTFT and the spread over instances per policy.
#[test]
fn replay_cluster_routes_over_sidecars_found_through_etcd() {
    let Some(etcd) = kvrail_e2e::etcd::Etcd::start("replay --cluster") else {
        return;
    };
    let url = format!("http://127.0.0.1:{}", etcd.client_port);
    let out = replay(&[
        "--cluster",
        "2:3",
        "--etcd",
        &url,
        "--requests",
        "12",
        "--kv-scale",
        "1/256",
        "--pool-bytes",
        "64M",
        "--time-scale",
        "0.2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines = json_lines(&out.stdout);
    let runs: Vec<&serde_json::Value> = lines.iter().filter(|v| v["replay"] == "cluster").collect();
    let policies: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["round_robin", "least_loaded"], "{stderr}");
    for r in runs {
        assert_eq!(r["requests"], 12, "{r}");
        let full = r["kv_bytes_full_scale"].as_f64().unwrap();
        let verified = r["verified_bytes"].as_f64().unwrap();
        // Every block's bytes at 1/256 of their size (rounded to 8 bytes).
        assert!(
            verified > 0.0 && (verified - full / 256.0).abs() < 0.05 * full / 256.0,
            "{r}"
        );
        let per = |side: &str| -> Vec<u64> {
            r[side]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        assert_eq!(per("per_prefill").iter().sum::<u64>(), 12);
        assert_eq!(per("per_decode").len(), 3);
        assert!(r["summary"]["ttft_p50_ms"].as_f64().unwrap() > 0.0);
        if r["policy"] == "round_robin" {
            assert_eq!(per("per_prefill"), [6, 6], "{r}");
            assert_eq!(per("per_decode"), [4, 4, 4], "{r}");
        }
    }
    // No static peer was given: each decode was found in etcd by name.
    assert!(stderr.contains("no static peers"), "{stderr}");
}
