//! Request traces: Mooncake JSONL (`timestamp` ms, `input_length`,
//! `output_length`, `hash_ids` of 512-token prefix blocks) and the Azure 2023
//! CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`). A bad line is an error
//! naming the file and line.

use std::path::Path;

use anyhow::{anyhow, bail};
use serde::Deserialize;

/// Tokens covered by one Mooncake `hash_ids` entry.
pub const HASH_BLOCK_TOKENS: u64 = 512;

/// One request of a trace.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Request {
    /// Arrival, milliseconds from the trace's first request.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    /// Prefix-chained hashes of 512-token prompt blocks (Mooncake only).
    #[serde(default)]
    pub hash_ids: Vec<u64>,
}

/// Which format a trace file is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFormat {
    MooncakeJsonl,
    AzureCsv,
}

impl TraceFormat {
    /// By extension: `.csv` is Azure, anything else Mooncake JSONL.
    pub fn of(path: &Path) -> TraceFormat {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("csv") => TraceFormat::AzureCsv,
            _ => TraceFormat::MooncakeJsonl,
        }
    }
}

/// Reads up to `limit` requests of a trace in either format.
pub fn read(path: &Path, limit: usize) -> anyhow::Result<Vec<Request>> {
    match TraceFormat::of(path) {
        TraceFormat::MooncakeJsonl => read_mooncake(path, limit),
        TraceFormat::AzureCsv => read_azure(path, limit),
    }
}

/// The traces shipped inside the binary, by file name, so that a copied
/// `loadgen` runs its demo anywhere (`--trace NAME` with no directory).
pub const BUNDLED: [(&str, &str); 2] = [
    (
        "conversation_trace_head.jsonl",
        include_str!("../traces/conversation_trace_head.jsonl"),
    ),
    (
        "azure_code_head.csv",
        include_str!("../traces/azure_code_head.csv"),
    ),
];

/// The default `--trace`: the first 500 requests of the Mooncake conversation trace.
pub const DEFAULT_TRACE: &str = "conversation_trace_head.jsonl";

fn read_text(path: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        // A bare bundled name that is not a file here names the embedded copy.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && path.components().count() == 1 => {
            BUNDLED
                .iter()
                .find(|(name, _)| Path::new(name) == path)
                .map(|(_, text)| text.to_string())
                .ok_or_else(|| anyhow!("cannot read {}: {e}", path.display()))
        }
        Err(e) => Err(anyhow!("cannot read {}: {e}", path.display())),
    }
}

/// Reads up to `limit` Mooncake JSONL requests.
pub fn read_mooncake(path: &Path, limit: usize) -> anyhow::Result<Vec<Request>> {
    let text = read_text(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let r: Request =
            serde_json::from_str(line).map_err(|e| anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        out.push(r);
    }
    Ok(out)
}

/// Reads up to `limit` Azure CSV requests; timestamps become milliseconds
/// after the first row's.
pub fn read_azure(path: &Path, limit: usize) -> anyhow::Result<Vec<Request>> {
    let text = read_text(path)?;
    let mut out = Vec::new();
    let mut first_ms: Option<i64> = None;
    for (i, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let at = |msg: String| anyhow!("{}:{}: {msg}", path.display(), i + 1);
        let fields: Vec<&str> = line.split(',').collect();
        let [ts, context, generated] = fields[..] else {
            return Err(at(format!(
                "expected TIMESTAMP,ContextTokens,GeneratedTokens, got {} fields",
                fields.len()
            )));
        };
        let ms = parse_azure_timestamp(ts).map_err(&at)?;
        let count = |name: &str, v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|e| at(format!("{name} {v:?}: {e}")))
        };
        let input_length = count("ContextTokens", context)?;
        let output_length = count("GeneratedTokens", generated)?;
        let first = *first_ms.get_or_insert(ms);
        if ms < first {
            return Err(at(format!("timestamp {ts} is before the first row's")));
        }
        out.push(Request {
            timestamp: (ms - first) as u64,
            input_length,
            output_length,
            hash_ids: Vec::new(),
        });
    }
    Ok(out)
}

/// `2023-11-16 18:17:03.9799600` (no time zone) as milliseconds since 1970.
fn parse_azure_timestamp(ts: &str) -> Result<i64, String> {
    let bad = || format!("bad TIMESTAMP {ts:?} (want YYYY-MM-DD HH:MM:SS[.fraction])");
    let (date, time) = ts.trim().split_once(' ').ok_or_else(bad)?;
    let num = |s: &str| s.parse::<i64>().map_err(|_| bad());
    let d: Vec<&str> = date.split('-').collect();
    let [y, mo, da] = d[..] else {
        return Err(bad());
    };
    let (y, mo, da) = (num(y)?, num(mo)?, num(da)?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let t: Vec<&str> = hms.split(':').collect();
    let [h, mi, s] = t[..] else { return Err(bad()) };
    let (h, mi, s) = (num(h)?, num(mi)?, num(s)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&da) || h > 23 || mi > 59 || s > 60 {
        return Err(bad());
    }
    if frac.is_empty() || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    // Milliseconds from the first three fraction digits.
    let ms: i64 = format!("{frac:0<3}")[..3].parse().map_err(|_| bad())?;
    let days = days_from_civil(y, mo, da);
    Ok(((days * 24 + h) * 60 + mi) * 60_000 + s * 1000 + ms)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's method).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// How a trace is turned into load here.
#[derive(Debug, Clone, Copy)]
pub struct Shaping {
    /// Arrival times are multiplied by this (0.05: twenty times faster).
    pub time_scale: f64,
    /// Spread requests that share a timestamp evenly over this many ms after
    /// it (the Mooncake conversation trace's 3-second buckets); 0: as given.
    pub spread_bucket_ms: u64,
    /// Prompts longer than this are clipped (the model's context).
    pub max_prompt_tokens: u64,
}

/// A request as replayed: arrival in replay milliseconds, clipped prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival {
    pub index: usize,
    pub at_ms: f64,
    pub prompt_tokens: u64,
    /// Leading prompt tokens whose KV an earlier request already produced (by
    /// `hash_ids`, an unbounded prefix cache on the decode side).
    pub reusable_tokens: u64,
}

/// Applies `shaping` and works out each request's reusable prefix.
pub fn shape(requests: &[Request], shaping: Shaping) -> anyhow::Result<Vec<Arrival>> {
    if !(shaping.time_scale > 0.0 && shaping.time_scale.is_finite()) {
        bail!("time scale must be a positive number");
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(requests.len());
    let mut i = 0;
    while i < requests.len() {
        // The run of requests sharing this timestamp.
        let ts = requests[i].timestamp;
        let run = requests[i..]
            .iter()
            .take_while(|r| r.timestamp == ts)
            .count();
        for k in 0..run {
            let r = &requests[i + k];
            let spread = shaping.spread_bucket_ms as f64 * k as f64 / run as f64;
            let prompt_tokens = r.input_length.min(shaping.max_prompt_tokens);
            let cached = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count() as u64;
            seen.extend(r.hash_ids.iter().copied());
            out.push(Arrival {
                index: i + k,
                at_ms: (ts as f64 + spread) * shaping.time_scale,
                prompt_tokens,
                reusable_tokens: (cached * HASH_BLOCK_TOKENS).min(prompt_tokens),
            });
        }
        i += run;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_names_the_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(&p, "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n\n{\"timestamp\":5,\"input_length\":\"x\"}\n").unwrap();
        let err = read(&p, 10).unwrap_err().to_string();
        assert!(err.contains("t.jsonl:3"), "{err}");
        let ok = read(&p, 1).unwrap();
        assert_eq!(ok[0].input_length, 10);
        // A missing field is named.
        std::fs::write(&p, "{\"timestamp\":0,\"output_length\":2}\n").unwrap();
        let err = read(&p, 10).unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:1") && err.contains("input_length"),
            "{err}"
        );
    }

    #[test]
    fn azure_csv_parses_relative_times_and_names_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.csv");
        std::fs::write(
            &p,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-11-16 23:59:59.9799600,4808,10\n\
             2023-11-17 00:00:01.0319600,3180,8\n",
        )
        .unwrap();
        let r = read(&p, usize::MAX).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].timestamp, r[0].input_length, r[0].output_length),
            (0, 4808, 10)
        );
        // Across midnight: 00:00:01.031 - 23:59:59.979 = 1052 ms.
        assert_eq!((r[1].timestamp, r[1].input_length), (1052, 3180));
        for (bad, want) in [
            ("2023-11-16 18:17:03.97,12", "got 2 fields"),
            ("2023-11-16 18:17:03.97,x,4", "ContextTokens"),
            ("2023-11-16 18:17:03.97,4,-1", "GeneratedTokens"),
            ("yesterday,4,1", "TIMESTAMP"),
            ("2023-13-16 18:17:03.97,4,1", "TIMESTAMP"),
            ("2023-11-16 18:17:03.97,4,1,9", "got 4 fields"),
            ("2023-11-16 18:17:02.0,4,1", "before the first"),
        ] {
            std::fs::write(
                &p,
                format!(
                    "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,1,1\n{bad}\n"
                ),
            )
            .unwrap();
            let err = read(&p, usize::MAX).unwrap_err().to_string();
            assert!(
                err.contains("a.csv:3") && err.contains(want),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn bundled_traces_parse() {
        // By bare name: the copies embedded in the binary, whatever the directory.
        let r = read(Path::new(DEFAULT_TRACE), usize::MAX).unwrap();
        assert_eq!(r.len(), 500);
        assert_eq!(r[0].input_length, 6758);
        let a = read(Path::new("azure_code_head.csv"), usize::MAX).unwrap();
        assert_eq!(a.len(), 300);
        assert_eq!((a[0].timestamp, a[0].input_length), (0, 4808));
        assert_eq!((a[1].timestamp, a[1].input_length), (52, 3180));
    }

    fn req(ts: u64, len: u64, hashes: &[u64]) -> Request {
        Request {
            timestamp: ts,
            input_length: len,
            output_length: 1,
            hash_ids: hashes.to_vec(),
        }
    }

    #[test]
    fn shaping_spreads_buckets_scales_clips_and_finds_prefixes() {
        let trace = [
            req(0, 1000, &[1, 2]),
            req(0, 1500, &[1, 2, 3]),
            req(0, 600, &[4, 2]),
            req(3000, 200_000, &[1, 5]),
        ];
        let s = Shaping {
            time_scale: 0.5,
            spread_bucket_ms: 3000,
            max_prompt_tokens: 131_072,
        };
        let a = shape(&trace, s).unwrap();
        let at: Vec<f64> = a.iter().map(|a| a.at_ms).collect();
        assert_eq!(at, vec![0.0, 500.0, 1000.0, 1500.0]);
        let reuse: Vec<u64> = a.iter().map(|a| a.reusable_tokens).collect();
        // Second: 2 of 3 hash blocks seen (1024 tokens); third: first block
        // differs, so nothing; fourth: block 1 seen.
        assert_eq!(reuse, vec![0, 1024, 0, 512]);
        assert_eq!(a[3].prompt_tokens, 131_072);
        assert_eq!(a[0].reusable_tokens, 0);
        let literal = shape(
            &trace,
            Shaping {
                spread_bucket_ms: 0,
                time_scale: 1.0,
                ..s
            },
        )
        .unwrap();
        assert_eq!(literal[2].at_ms, 0.0);
        assert!(shape(
            &trace,
            Shaping {
                time_scale: 0.0,
                ..s
            }
        )
        .is_err());
    }
}
