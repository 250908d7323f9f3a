//! The replay's arithmetic, without I/O: prefill scheduling, the TTFT of each
//! request from its transfer's timing, a link model for projections, and the
//! summaries. The live replay feeds measured transfer times into the same
//! records, so live and projected rows are computed the same way.

use serde::Serialize;

/// One request as the emulated workers see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub index: usize,
    /// Replay milliseconds.
    pub arrival_ms: f64,
    pub prompt_tokens: u64,
    /// vLLM blocks to move (prompt blocks less those the decode node holds).
    pub blocks: u64,
    /// Bytes to move, per tensor-parallel rank, at full scale.
    pub kv_bytes: u64,
    pub prefill_ms: f64,
    pub layers: u32,
}

/// When a prefill worker sends a request's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// Each layer's blocks as soon as that layer's prefill finishes.
    LayerWise,
    /// Every layer after the whole prefill.
    AllAtOnce,
}

impl Overlap {
    pub fn parse(s: &str) -> Result<Overlap, String> {
        match s {
            "layer" | "layer-wise" => Ok(Overlap::LayerWise),
            "all" | "all-at-once" => Ok(Overlap::AllAtOnce),
            _ => Err(format!("overlap {s:?}: want layer or all")),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Overlap::LayerWise => "layer",
            Overlap::AllAtOnce => "all",
        }
    }

    /// When each piece (layer or whole) is ready, as (ms after prefill start,
    /// share of the request's bytes); pieces in order.
    pub fn pieces(self, job: &Job) -> Vec<(f64, u32)> {
        match self {
            Overlap::AllAtOnce => vec![(job.prefill_ms, job.layers)],
            Overlap::LayerWise => (0..job.layers)
                .map(|l| (job.prefill_ms * f64::from(l + 1) / f64::from(job.layers), 1))
                .collect(),
        }
    }
}

/// Prefill start and end (replay ms) of each job: jobs in arrival order, each
/// on the instance that is free first.
pub fn prefill_schedule(jobs: &[Job], instances: usize) -> Vec<(f64, f64)> {
    let mut free = vec![0.0f64; instances.max(1)];
    jobs.iter()
        .map(|j| {
            let (slot, at) = free
                .iter()
                .copied()
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, 0.0));
            let start = at.max(j.arrival_ms);
            let end = start + j.prefill_ms;
            free[slot] = end;
            (start, end)
        })
        .collect()
}

/// Prefill instances that keep utilisation at or below `target` over the
/// trace's span (at least one).
pub fn instances_for(jobs: &[Job], target: f64) -> usize {
    let work: f64 = jobs.iter().map(|j| j.prefill_ms).sum();
    let span = jobs
        .iter()
        .map(|j| j.arrival_ms)
        .fold(0.0f64, f64::max)
        .max(1.0);
    ((work / (span * target)).ceil() as usize).max(1)
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    pub index: usize,
    pub arrival_ms: f64,
    pub prompt_tokens: u64,
    pub kv_bytes: u64,
    /// Arrival to prefill start (waiting for a prefill instance or KV memory).
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// First byte offered to the transport until the decode side holds all of it.
    pub transfer_ms: f64,
    /// Transfer time after prefill ended: what the request waits for the link.
    pub exposed_ms: f64,
    /// Arrival to the decode side's first token (queue + prefill + exposed).
    pub ttft_ms: f64,
}

impl Record {
    /// A request whose prefill ran `start..end` and whose KV was first offered
    /// at `first_offer` and complete at `done` (all replay ms).
    pub fn new(job: &Job, start: f64, end: f64, first_offer: f64, done: f64) -> Record {
        let done = done.max(end);
        Record {
            index: job.index,
            arrival_ms: job.arrival_ms,
            prompt_tokens: job.prompt_tokens,
            kv_bytes: job.kv_bytes,
            queue_ms: start - job.arrival_ms,
            prefill_ms: end - start,
            transfer_ms: if job.kv_bytes == 0 {
                0.0
            } else {
                done - first_offer
            },
            exposed_ms: done - end,
            ttft_ms: done - job.arrival_ms,
        }
    }
}

/// A link for projections: bandwidth striped over rails, one-way latency, and a
/// fixed cost per transfer operation (one push).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinkProfile {
    pub name: String,
    pub rails: u32,
    pub gbit_per_rail: f64,
    pub latency_us: f64,
    pub per_op_us: f64,
    /// Where the numbers come from.
    pub source: String,
}

impl LinkProfile {
    /// Bytes per millisecond over all rails.
    fn bytes_per_ms(&self) -> f64 {
        f64::from(self.rails) * self.gbit_per_rail * 1e9 / 8.0 / 1000.0
    }

    /// The seeds' DGX Spark figures (ConnectX-7, two 100G ports).
    pub fn builtin() -> Vec<LinkProfile> {
        let spark = |name: &str, rails, gbit, lat, source: &str| LinkProfile {
            name: name.into(),
            rails,
            gbit_per_rail: gbit,
            latency_us: lat,
            per_op_us: 0.0,
            source: source.into(),
        };
        vec![
            spark(
                "spark-rdma-2rail",
                2,
                93.4,
                2.0,
                "DGX Spark ib_write_bw 93.4 Gbit/s per link, 2 links striped, RDMA latency 1-2 us (2 us used)",
            ),
            spark(
                "spark-rdma-1rail",
                1,
                93.4,
                2.0,
                "DGX Spark ib_write_bw 93.4 Gbit/s, one link, latency 2 us",
            ),
            spark(
                "spark-tcp",
                1,
                33.7,
                125.0,
                "DGX Spark TCP single stream 33.7 Gbit/s, latency 50-200 us (125 us used)",
            ),
        ]
    }
}

/// Replays `jobs` on `link` (None: a free, instant transfer), with prefill at
/// `schedule`. The link is shared fairly by every piece in flight (processor
/// sharing, as concurrent transfers over many connections share a link); a
/// piece is delivered its bytes' share of time after it was offered, plus the
/// link's latency and fixed cost per push.
pub fn project(
    jobs: &[Job],
    schedule: &[(f64, f64)],
    overlap: Overlap,
    link: Option<&LinkProfile>,
) -> Vec<Record> {
    // (ready ms, job position, bytes)
    let mut pieces: Vec<(f64, usize, u64)> = Vec::new();
    for (pos, (job, &(start, _))) in jobs.iter().zip(schedule).enumerate() {
        if job.kv_bytes == 0 {
            continue;
        }
        let parts = overlap.pieces(job);
        let mut left = job.kv_bytes;
        for (k, (at, layers)) in parts.iter().enumerate() {
            let bytes = if k + 1 == parts.len() {
                left
            } else {
                job.kv_bytes * u64::from(*layers) / u64::from(job.layers)
            };
            left -= bytes;
            pieces.push((start + at, pos, bytes));
        }
    }
    pieces.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut first = vec![f64::INFINITY; jobs.len()];
    let mut done = vec![0.0f64; jobs.len()];
    for &(ready, pos, _) in &pieces {
        first[pos] = first[pos].min(ready);
    }
    match link {
        None => {
            for &(ready, pos, _) in &pieces {
                done[pos] = done[pos].max(ready);
            }
        }
        Some(l) => {
            let fixed = (l.latency_us + l.per_op_us) / 1000.0;
            for (pos, finished) in fair_share(&pieces, l.bytes_per_ms()) {
                done[pos] = done[pos].max(finished + fixed);
            }
        }
    }
    jobs.iter()
        .zip(schedule)
        .enumerate()
        .map(|(pos, (job, &(start, end)))| {
            let offered = if first[pos].is_finite() {
                first[pos]
            } else {
                end
            };
            Record::new(job, start, end, offered, done[pos])
        })
        .collect()
}

/// When each piece (ready ms, owner, bytes; sorted by ready time) finishes on
/// a link of `rate` bytes/ms shared equally by the pieces in flight. Virtual
/// time counts the bytes each piece in flight has been served, so a piece
/// finishes when it reaches its start plus its size.
fn fair_share(pieces: &[(f64, usize, u64)], rate: f64) -> Vec<(usize, f64)> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    /// f64 ordered for the heap (values are finite).
    struct Key(f64);
    impl PartialEq for Key {
        fn eq(&self, o: &Self) -> bool {
            self.cmp(o).is_eq()
        }
    }
    impl Eq for Key {}
    impl PartialOrd for Key {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Key {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            self.0.total_cmp(&o.0)
        }
    }
    let mut out = Vec::with_capacity(pieces.len());
    let mut in_flight: BinaryHeap<Reverse<(Key, usize)>> = BinaryHeap::new();
    let (mut now, mut virt) = (0.0f64, 0.0f64);
    let mut next = 0;
    while next < pieces.len() || !in_flight.is_empty() {
        let n = in_flight.len() as f64;
        let completion = in_flight
            .peek()
            .map(|Reverse((Key(v), _))| now + (v - virt) * n / rate);
        let arrival = pieces.get(next).map(|p| p.0);
        match (completion, arrival) {
            (Some(c), a) if a.is_none_or(|a| c <= a) => {
                let Some(Reverse((Key(v), owner))) = in_flight.pop() else {
                    break;
                };
                now = c.max(now);
                virt = v;
                out.push((owner, now));
            }
            (_, Some(a)) => {
                if n > 0.0 {
                    virt += (a - now).max(0.0) * rate / n;
                }
                now = a.max(now);
                let (_, owner, bytes) = pieces[next];
                in_flight.push(Reverse((Key(virt + bytes as f64), owner)));
                next += 1;
            }
            _ => break,
        }
    }
    out
}

/// The distribution of a replay's records.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub requests: usize,
    pub kv_bytes: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub exposed_p50_ms: f64,
    pub exposed_p99_ms: f64,
    pub queue_p50_ms: f64,
    /// Exposed transfer time over TTFT, summed over requests.
    pub transfer_share_of_ttft: f64,
    /// Share of in-flight transfer time that overlapped prefill.
    pub hidden_share: f64,
    /// Bytes over the time any transfer was in flight (10^9 B/s).
    pub gbps: f64,
}

/// The `p`th percentile by nearest rank (p in 0..=100) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Total length of the union of intervals.
pub fn busy_ms(mut spans: Vec<(f64, f64)>) -> f64 {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (a, b) in spans {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

pub fn summarize(records: &[Record]) -> Summary {
    let sorted = |f: fn(&Record) -> f64| {
        let mut v: Vec<f64> = records.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let ttft = sorted(|r| r.ttft_ms);
    let exposed = sorted(|r| r.exposed_ms);
    let queue = sorted(|r| r.queue_ms);
    let sum = |f: fn(&Record) -> f64| records.iter().map(f).sum::<f64>();
    let (ttft_sum, exposed_sum, transfer_sum) = (
        sum(|r| r.ttft_ms),
        sum(|r| r.exposed_ms),
        sum(|r| r.transfer_ms),
    );
    let kv_bytes: u64 = records.iter().map(|r| r.kv_bytes).sum();
    let busy = busy_ms(
        records
            .iter()
            .filter(|r| r.kv_bytes > 0)
            .map(|r| {
                let done = r.arrival_ms + r.ttft_ms;
                (done - r.transfer_ms, done)
            })
            .collect(),
    );
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Summary {
        requests: records.len(),
        kv_bytes,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        exposed_p50_ms: percentile(&exposed, 50.0),
        exposed_p99_ms: percentile(&exposed, 99.0),
        queue_p50_ms: percentile(&queue, 50.0),
        transfer_share_of_ttft: ratio(exposed_sum, ttft_sum),
        hidden_share: ratio(transfer_sum - exposed_sum, transfer_sum),
        gbps: ratio(kv_bytes as f64, busy * 1e6),
    }
}

/// One measured transfer operation (a push) of a live replay.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Op {
    pub start_ms: f64,
    pub done_ms: f64,
    pub bytes: u64,
}

/// A link profile fitted to a live run: bandwidth = the bytes its pushes
/// moved over the time any push was in flight (given at full size: divided by
/// `bytes_scale`); then the fixed cost per push that makes the projection of
/// the same requests (`jobs` at `schedule`, sent as `overlap`) expose the
/// live run's median transfer time. p90, p99 and the hidden share are not
/// fitted: they show how well the model follows the live run.
pub fn calibrate(
    name: &str,
    ops: &[Op],
    live: &Summary,
    jobs: &[Job],
    schedule: &[(f64, f64)],
    overlap: Overlap,
    bytes_scale: f64,
) -> Option<LinkProfile> {
    let bytes: u64 = ops.iter().map(|o| o.bytes).sum();
    let busy = busy_ms(ops.iter().map(|o| (o.start_ms, o.done_ms)).collect());
    if bytes == 0 || busy <= 0.0 {
        return None;
    }
    let mut link = LinkProfile {
        name: format!("calibrated-{name}"),
        rails: 1,
        gbit_per_rail: bytes as f64 / busy * 1000.0 * 8.0 / 1e9 / bytes_scale,
        latency_us: 0.0,
        per_op_us: 0.0,
        source: String::new(),
    };
    let exposed_p50 =
        |l: &LinkProfile| summarize(&project(jobs, schedule, overlap, Some(l))).exposed_p50_ms;
    // Exposed time grows with the fixed cost: bisect on it (0 to 10 s).
    let (mut lo, mut hi) = (0.0f64, 10_000_000.0f64);
    if exposed_p50(&link) < live.exposed_p50_ms {
        for _ in 0..40 {
            let mid = (lo + hi) / 2.0;
            link.per_op_us = mid;
            if exposed_p50(&link) < live.exposed_p50_ms {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        link.per_op_us = (lo + hi) / 2.0;
    }
    link.source = format!(
        "fitted to the live {name} run ({} send): {} pushes, {bytes} bytes over {busy:.1} ms in flight{}; per-push cost fitted to its exposed p50",
        overlap.label(),
        ops.len(),
        if bytes_scale == 1.0 {
            String::new()
        } else {
            format!(", blocks scaled by {bytes_scale:.5} (bandwidth given at full size)")
        }
    );
    Some(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(index: usize, arrival_ms: f64, kv_bytes: u64, prefill_ms: f64, layers: u32) -> Job {
        Job {
            index,
            arrival_ms,
            prompt_tokens: 1000,
            blocks: 10,
            kv_bytes,
            prefill_ms,
            layers,
        }
    }

    #[test]
    fn schedule_queues_on_the_first_free_instance() {
        let jobs = [
            job(0, 0.0, 0, 100.0, 1),
            job(1, 10.0, 0, 50.0, 1),
            job(2, 20.0, 0, 10.0, 1),
        ];
        let one = prefill_schedule(&jobs, 1);
        assert_eq!(one, vec![(0.0, 100.0), (100.0, 150.0), (150.0, 160.0)]);
        let two = prefill_schedule(&jobs, 2);
        assert_eq!(two, vec![(0.0, 100.0), (10.0, 60.0), (60.0, 70.0)]);
        // 160 ms of work over a 20 ms span at 80%: 10 instances.
        assert_eq!(instances_for(&jobs, 0.8), 10);
    }

    /// 1 Gbit/s = 125,000 bytes per ms; no latency unless given.
    fn gbit(latency_us: f64, per_op_us: f64) -> LinkProfile {
        LinkProfile {
            name: "t".into(),
            rails: 1,
            gbit_per_rail: 1.0,
            latency_us,
            per_op_us,
            source: String::new(),
        }
    }

    #[test]
    fn ttft_by_hand_all_at_once() {
        // 1,250,000 bytes = 10 ms at 1 Gbit/s; prefill 40 ms; arrival 5 ms.
        let jobs = [job(0, 5.0, 1_250_000, 40.0, 4)];
        let sched = prefill_schedule(&jobs, 1);
        let r = &project(
            &jobs,
            &sched,
            Overlap::AllAtOnce,
            Some(&gbit(500.0, 1000.0)),
        )[0];
        // Prefill 5..45; send 45 + 1 ms op + 10 ms + 0.5 ms latency = 56.5.
        assert_eq!(r.queue_ms, 0.0);
        assert_eq!(r.prefill_ms, 40.0);
        assert!((r.exposed_ms - 11.5).abs() < 1e-9, "{r:?}");
        assert!((r.transfer_ms - 11.5).abs() < 1e-9);
        assert!((r.ttft_ms - 51.5).abs() < 1e-9);
        let ideal = &project(&jobs, &sched, Overlap::AllAtOnce, None)[0];
        assert_eq!((ideal.exposed_ms, ideal.ttft_ms), (0.0, 40.0));
    }

    #[test]
    fn ttft_by_hand_layer_wise() {
        // 4 layers of 10 ms, 2.5 ms of link each: each layer is sent while the
        // next computes; only the last layer's 2.5 ms shows.
        let jobs = [job(0, 0.0, 1_250_000, 40.0, 4)];
        let sched = prefill_schedule(&jobs, 1);
        let r = &project(&jobs, &sched, Overlap::LayerWise, Some(&gbit(0.0, 0.0)))[0];
        assert!((r.exposed_ms - 2.5).abs() < 1e-9, "{r:?}");
        // Offered from 10 ms (layer 0 done) to 42.5 ms.
        assert!((r.transfer_ms - 32.5).abs() < 1e-9);
        assert!((r.ttft_ms - 42.5).abs() < 1e-9);
        // A link slower than prefill: 4 x 25 ms from 10 ms = 110, exposed 70.
        let slow = LinkProfile {
            gbit_per_rail: 0.1,
            ..gbit(0.0, 0.0)
        };
        let r = &project(&jobs, &sched, Overlap::LayerWise, Some(&slow))[0];
        assert!((r.exposed_ms - 70.0).abs() < 1e-9, "{r:?}");
        let s = summarize(&project(
            &jobs,
            &sched,
            Overlap::LayerWise,
            Some(&gbit(0.0, 0.0)),
        ));
        // 30 of 32.5 ms in flight overlapped prefill.
        assert!((s.hidden_share - 30.0 / 32.5).abs() < 1e-9);
        assert!((s.transfer_share_of_ttft - 2.5 / 42.5).abs() < 1e-9);
    }

    #[test]
    fn requests_share_the_link_in_order() {
        // Two requests end prefill together (two instances); the second waits
        // for the first's 10 ms on the link. Rails add bandwidth.
        let jobs = [
            job(0, 0.0, 1_250_000, 40.0, 1),
            job(1, 0.0, 1_250_000, 40.0, 1),
        ];
        let sched = prefill_schedule(&jobs, 2);
        let r = project(&jobs, &sched, Overlap::AllAtOnce, Some(&gbit(0.0, 0.0)));
        assert_eq!((r[0].exposed_ms, r[1].exposed_ms), (20.0, 20.0));
        let two = LinkProfile {
            rails: 2,
            ..gbit(0.0, 0.0)
        };
        let r = project(&jobs, &sched, Overlap::AllAtOnce, Some(&two));
        assert_eq!((r[0].exposed_ms, r[1].exposed_ms), (10.0, 10.0));
        let s = summarize(&r);
        assert_eq!(s.ttft_p50_ms, 50.0);
        // 2.5 MB over 10 ms in flight.
        assert!((s.gbps - 0.25).abs() < 1e-9);
        // A small request next to a big one finishes first: 0.25 MB offered
        // with a 2.5 MB one shares the link 1:1 until it is done (4 ms for
        // 2 x 0.25 MB at 125 KB/ms), the big one then has the link alone.
        let mixed = [
            job(0, 0.0, 2_500_000, 40.0, 1),
            job(1, 0.0, 250_000, 40.0, 1),
        ];
        let r = project(
            &mixed,
            &prefill_schedule(&mixed, 2),
            Overlap::AllAtOnce,
            Some(&gbit(0.0, 0.0)),
        );
        assert!((r[1].exposed_ms - 4.0).abs() < 1e-9, "{r:?}");
        assert!((r[0].exposed_ms - 22.0).abs() < 1e-9, "{r:?}");
        // Nothing to move: TTFT is prefill alone.
        let none = [job(0, 0.0, 0, 40.0, 4)];
        let r = &project(
            &none,
            &prefill_schedule(&none, 1),
            Overlap::LayerWise,
            Some(&two),
        )[0];
        assert_eq!((r.ttft_ms, r.exposed_ms, r.transfer_ms), (40.0, 0.0, 0.0));
    }

    #[test]
    fn percentiles_unions_and_calibration() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(busy_ms(vec![(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]), 4.0);
        // One request of 1 MB per 100 ms, all at once after 40 ms of prefill;
        // live: 1 MB moved in 4 ms (2 Gbit/s) and 6 ms exposed, i.e. 2 ms of
        // fixed cost per push.
        let jobs: Vec<Job> = (0..5)
            .map(|i| job(i, i as f64 * 100.0, 1_000_000, 40.0, 4))
            .collect();
        let sched = prefill_schedule(&jobs, 1);
        let ops: Vec<Op> = sched
            .iter()
            .map(|&(_, end)| Op {
                start_ms: end,
                done_ms: end + 4.0,
                bytes: 1_000_000,
            })
            .collect();
        let live: Vec<Record> = jobs
            .iter()
            .zip(&sched)
            .map(|(j, &(s, e))| Record::new(j, s, e, e, e + 6.0))
            .collect();
        let live = summarize(&live);
        let p = calibrate("tcp", &ops, &live, &jobs, &sched, Overlap::AllAtOnce, 1.0).unwrap();
        assert!((p.gbit_per_rail - 2.0).abs() < 1e-9, "{p:?}");
        assert!((p.per_op_us - 2000.0).abs() < 0.01, "{p:?}");
        // Measured at a quarter of the bytes: the same link at full size is 4x.
        let q = calibrate("tcp", &ops, &live, &jobs, &sched, Overlap::AllAtOnce, 0.25).unwrap();
        assert!((q.gbit_per_rail - 8.0).abs() < 1e-9);
        assert!(calibrate("tcp", &[], &live, &jobs, &sched, Overlap::AllAtOnce, 1.0).is_none());
    }
}
