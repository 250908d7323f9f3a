//! `loadgen bench --rails RATE,RATE...`: the two sidecars in network namespaces
//! joined by shaped veth rails. Measures, in one run, one rail against all rails
//! (a 256 MiB push and the scattered batch), the per-rail byte split, and a
//! failover: rail 1 cut mid-transfer, then restored. One JSON object per result.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvrail_client::proto::{RegionLayout, TransferState};
use kvrail_client::{blocks, dense_layout, layout_extent, Client};
use serde_json::json;

use crate::bench::{round3, Bench, BenchArgs};
use crate::stats::gbps;
use loadgen::cluster::LocalCluster;
use loadgen::netlab::{Cut, NetLab, RailShape};

/// Per rail of the prefill node's outbound session: (state, bytes sent, re-sent slices).
async fn rail_status(p: &mut Client) -> anyhow::Result<Vec<(String, u64, u64)>> {
    let peers = p.list_peers().await?;
    let peer = peers
        .peers
        .iter()
        .find(|x| x.name == "decode")
        .context("prefill does not list decode")?;
    let mut rails: Vec<_> = peer
        .rail_status
        .iter()
        .filter(|r| r.direction == "out")
        .collect();
    rails.sort_by_key(|r| r.rail);
    Ok(rails
        .iter()
        .map(|r| (r.state.clone(), r.bytes_sent, r.slices_retransmitted))
        .collect())
}

/// Bytes of the contiguous push (1 MiB blocks).
const BIG: u64 = 256 << 20;

/// The contiguous push: 1 MiB blocks over the whole file, and the first `BIG` of them.
fn contiguous(bench: &Bench) -> (RegionLayout, Vec<u32>) {
    let layout = dense_layout(1, 1, (bench.p_mem.len() >> 20) as u32, 1 << 20);
    (layout, (0..(BIG >> 20) as u32).collect())
}

fn bytes_of(s: &[(String, u64, u64)]) -> Vec<u64> {
    s.iter().map(|r| r.1).collect()
}

fn delta(after: &[u64], before: &[u64]) -> Vec<u64> {
    after
        .iter()
        .enumerate()
        .map(|(i, a)| a - before.get(i).copied().unwrap_or(0))
        .collect()
}

pub async fn run(args: BenchArgs, scattered: Vec<u64>) -> anyhow::Result<()> {
    let cut = match args.rail_cut.as_str() {
        "drop" => Some(Cut::DropAll),
        "down" => Some(Cut::LinkDown),
        "none" => None,
        other => bail!("--rail-cut {other:?}: expected drop, down or none"),
    };
    let shapes: Vec<RailShape> = args
        .rails
        .iter()
        .map(|r| RailShape {
            rate: r.clone(),
            delay: args.rail_delay.clone(),
        })
        .collect();
    let rates: Vec<f64> = shapes
        .iter()
        .map(|s| s.rate_bits_per_sec().map(|b| b / 8e9))
        .collect::<anyhow::Result<_>>()?;
    let sum_rate: f64 = rates.iter().sum();
    let lab = NetLab::create(&shapes)?;
    let scattered_layout = dense_layout(1, 1, (scattered[0] * 2) as u32, scattered[1]);
    let file_bytes = BIG.max(layout_extent(&scattered_layout));
    eprintln!(
        "kvrail rail bench: 2 sidecars in network namespaces, rails {:?} (delay {:?}), {} connections per rail",
        args.rails, args.rail_delay, args.connections
    );
    let mut counts = vec![1, shapes.len()];
    counts.dedup();
    for name in &args.transport {
        let transport: &'static str = match name.as_str() {
            "tcp" => "tcp",
            "quic" => "quic",
            other => bail!("--rails runs tcp and quic, not {other}"),
        };
        let mut single: Option<(f64, f64, Duration)> = None; // push GB/s, scattered GB/s, push p50
        for &n in &counts {
            let opts = args.cluster_options(&[transport]);
            let cluster = LocalCluster::start_in_lab(&opts, &lab, n).await?;
            let mut bench = Bench::start(cluster, &args, file_bytes, transport).await?;
            let result = measure(&mut bench, n, &rates, sum_rate, &scattered, &mut single).await;
            let result = match (result, cut) {
                (Ok(()), Some(how)) if n >= 2 => failover(&mut bench, &lab, how, &single).await,
                (r, _) => r,
            };
            bench.remove_files();
            result?;
        }
    }
    Ok(())
}

async fn measure(
    bench: &mut Bench,
    n: usize,
    rates: &[f64],
    sum_rate: f64,
    scattered: &[u64],
    single: &mut Option<(f64, f64, Duration)>,
) -> anyhow::Result<()> {
    let (contiguous, ids) = contiguous(bench);
    let count = scattered[0] as u32;
    let scattered_layout = dense_layout(1, 1, count * 2, scattered[1]);
    let src: Vec<u32> = (0..count).map(|i| i * 2).collect();
    let dst: Vec<u32> = (0..count).rev().map(|i| i * 2 + 1).collect();
    let mut measured = Vec::new();
    for (case, layout, s, d) in [
        ("push_256M", contiguous, ids.clone(), ids.clone()),
        ("scattered", scattered_layout, src, dst),
    ] {
        let before = bytes_of(&rail_status(&mut bench.p).await?);
        let point = bench.point("rails", "push", layout, 1, s, d).await?;
        let split = delta(&bytes_of(&rail_status(&mut bench.p).await?), &before);
        let rate = gbps(point.bytes * point.iterations, point.total);
        let moved: u64 = split.iter().sum::<u64>().max(1);
        let mut v = json!({
            "bench": "rails",
            "transport": bench.transport,
            "case": case,
            "rails": n,
            "rail_rates_gbytes_per_s": rates[..n].iter().map(|r| round3(*r)).collect::<Vec<_>>(),
            "bytes": point.bytes,
            "iterations": point.iterations,
            "gbps": round3(rate),
            "p50_us": point.lat.percentile_us(50.0),
            "rail_bytes": split,
            "rail_share": split.iter().map(|b| round3(*b as f64 / moved as f64)).collect::<Vec<_>>(),
            "ratio_vs_sum_of_rail_rates": round3(rate / rates[..n].iter().sum::<f64>()),
        });
        if n == 1 {
            measured.push((rate, Duration::from_micros(point.lat.percentile_us(50.0))));
        } else if let Some((push, scat, _)) = single {
            let one = if case == "push_256M" { *push } else { *scat };
            v["ratio_vs_single_rail"] = json!(round3(rate / one));
            v["ratio_vs_sum_of_all_rates"] = json!(round3(rate / sum_rate));
        }
        eprintln!(
            "rails={n} {case:<10} {rate:>7.3} GB/s  split {}{}",
            v["rail_share"],
            v.get("ratio_vs_single_rail")
                .map(|r| format!("  {r}x single rail"))
                .unwrap_or_default()
        );
        println!("{v}");
    }
    if n == 1 && measured.len() == 2 {
        *single = Some((measured[0].0, measured[1].0, measured[0].1));
    }
    Ok(())
}

/// A 256 MiB push with rail 1 cut once an eighth of the bytes went over it; then
/// the rail is restored and must carry traffic again.
async fn failover(
    bench: &mut Bench,
    lab: &NetLab,
    how: Cut,
    single: &Option<(f64, f64, Duration)>,
) -> anyhow::Result<()> {
    let (layout, ids) = contiguous(bench);
    let regions = bench.register(layout).await?;
    bench.d_mem.fill(0, bench.d_mem.len(), 0)?;
    let before = rail_status(&mut bench.p).await?;
    let start = Instant::now();
    let t = bench
        .p
        .push(
            "bench-p",
            "failover-1",
            "decode",
            blocks(regions.0, 0..1, ids.clone()),
            blocks(regions.1, 0..1, ids.clone()),
        )
        .await?;
    // Cut rail 1 once it has carried an eighth of the transfer.
    loop {
        let now = rail_status(&mut bench.p).await?;
        if now.get(1).map_or(0, |r| r.1) - before.get(1).map_or(0, |r| r.1) >= BIG / 8 {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("rail 1 carried nothing for 60 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    lab.cut(1, how)?;
    let cut_at = start.elapsed();
    let s = bench
        .p
        .wait(t.transfer_id, Some(Duration::from_secs(120)))
        .await?;
    let took = start.elapsed();
    if s.state != TransferState::Done as i32 {
        lab.restore(1)?;
        bail!("the transfer failed over a cut rail: {:?}", s.failure);
    }
    crate::verify::compare_blocks(&bench.p_mem, &bench.d_mem, &layout, 1, &ids, &ids, false)
        .context("failover moved wrong bytes")?;
    let after_cut = rail_status(&mut bench.p).await?;
    let restored = Instant::now();
    lab.restore(1)?;
    // Poll until the prober has re-admitted the rail.
    let back = loop {
        let st = rail_status(&mut bench.p).await?;
        if st.get(1).is_some_and(|r| r.0 == "up") {
            break restored.elapsed();
        }
        if restored.elapsed() > Duration::from_secs(30) {
            bail!("rail 1 not back 30 s after it returned: {st:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let before_again = bytes_of(&rail_status(&mut bench.p).await?);
    let (again, _) = bench
        .transfer(
            "push",
            blocks(regions.0, 0..1, ids.clone()),
            blocks(regions.1, 0..1, ids.clone()),
        )
        .await?;
    let split_again = delta(&bytes_of(&rail_status(&mut bench.p).await?), &before_again);
    bench.unregister(regions).await?;
    let resent: u64 =
        after_cut.iter().map(|r| r.2).sum::<u64>() - before.iter().map(|r| r.2).sum::<u64>();
    let moved_again = split_again.iter().sum::<u64>().max(1);
    let mut v = json!({
        "bench": "rails",
        "transport": bench.transport,
        "case": "failover",
        "cut": match how { Cut::DropAll => "drop", Cut::LinkDown => "down" },
        "bytes": BIG,
        "cut_after_ms": cut_at.as_millis() as u64,
        "seconds": round3(took.as_secs_f64()),
        "slices_retransmitted": resent,
        "rail_back_after_restore_ms": back.as_millis() as u64,
        "next_push_seconds": round3(again.as_secs_f64()),
        "next_push_rail_share": split_again.iter().map(|b| round3(*b as f64 / moved_again as f64)).collect::<Vec<_>>(),
    });
    if let Some((_, _, p50)) = single {
        v["single_rail_seconds"] = json!(round3(p50.as_secs_f64()));
        v["ratio_vs_single_rail_time"] = json!(round3(took.as_secs_f64() / p50.as_secs_f64()));
    }
    eprintln!(
        "failover   cut rail 1 ({}) at {} ms: done in {:.3} s ({}x single-rail time), {resent} slices re-sent; rail back {} ms after restore; next push split {}",
        v["cut"], v["cut_after_ms"], took.as_secs_f64(), v.get("ratio_vs_single_rail_time").cloned().unwrap_or_default(), v["rail_back_after_restore_ms"], v["next_push_rail_share"]
    );
    println!("{v}");
    Ok(())
}
