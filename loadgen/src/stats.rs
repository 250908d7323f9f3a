//! Latency and throughput summaries.

use std::time::Duration;

use hdrhistogram::Histogram;

/// Durations in microseconds, 1 us to 1 h, 3 significant digits.
#[derive(Clone)]
pub struct Latencies(Histogram<u64>);

impl Default for Latencies {
    fn default() -> Self {
        Self(Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds"))
    }
}

impl Latencies {
    pub fn record(&mut self, d: Duration) {
        let us = (d.as_micros() as u64).clamp(1, 3_600_000_000);
        let _ = self.0.record(us);
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &Latencies) {
        let _ = self.0.add(&other.0);
    }

    pub fn percentile_us(&self, p: f64) -> u64 {
        self.0.value_at_quantile(p / 100.0)
    }
}

/// GB/s (10^9 bytes per second).
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    if d.is_zero() {
        return 0.0;
    }
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Human size, binary units.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// Parses `4K`, `160KiB`, `1M`, `256MiB`, `1G` or plain bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits: String = s.chars().take_while(|c| c.is_ascii_digit()).collect();
    let n: u64 = digits.parse().map_err(|_| format!("bad size {s:?}"))?;
    let unit = s[digits.len()..].trim().to_ascii_lowercase();
    let mul = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    match n.checked_mul(mul) {
        None => Err(format!("size {s:?} overflows")),
        Some(0) => Err(format!("size {s:?}: must be more than 0")),
        Some(size) => Ok(size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("160KiB"), Ok(160 * 1024));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("0").is_err() && parse_size("0K").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(human_bytes(256 << 20), "256 MiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn percentiles_and_rates() {
        let mut l = Latencies::default();
        for us in 1..=100 {
            l.record(Duration::from_micros(us));
        }
        assert_eq!(l.percentile_us(50.0), 50);
        assert_eq!(l.percentile_us(99.0), 99);
        assert!((gbps(2_000_000_000, Duration::from_secs(1)) - 2.0).abs() < 1e-9);
    }
}
