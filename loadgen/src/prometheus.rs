//! Reading a sidecar's Prometheus text: one place for the benches and the tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::Context;

/// The body of `GET /metrics` at `addr`.
pub fn fetch(addr: SocketAddr) -> anyhow::Result<String> {
    let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .with_context(|| format!("connect to metrics at {addr}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    conn.read_to_string(&mut text)?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .context("metrics answer has no body")?;
    Ok(body)
}

/// Sum of the metric `name`'s series whose labels contain every `want` fragment
/// (0 when none does).
pub fn sum(text: &str, name: &str, want: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && want.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sums_matching_series_only() {
        let text = "# HELP x\nkvrail_bytes_sent_total{rail=\"0\",transport=\"rdma\"} 10\nkvrail_bytes_sent_total{rail=\"1\",transport=\"rdma\"} 5\nkvrail_bytes_sent_total{rail=\"0\",transport=\"tcp\"} 7\n";
        assert_eq!(
            super::sum(text, "kvrail_bytes_sent_total", &["transport=\"rdma\""]),
            15.0
        );
        assert_eq!(
            super::sum(text, "kvrail_bytes_sent_total", &["rail=\"0\""]),
            17.0
        );
        assert_eq!(super::sum(text, "kvrail_other", &[]), 0.0);
    }
}
