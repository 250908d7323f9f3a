//! The metrics port under abuse: hundreds of idle connections from anyone who
//! can reach it, on a daemon with a low file-descriptor limit. Before the fix the
//! exporter never closed them; at the limit the worker API stopped answering and
//! the log grew by hundreds of MB. Now the port holds at most a few connections,
//! closes silent ones, and the API and the log are unaffected.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvrail_e2e::{scrape, Pair};

#[tokio::test(flavor = "multi_thread")]
async fn idle_metrics_connections_cannot_starve_the_daemon() {
    // This test binary runs only this test, so the wrapper is its own.
    std::env::set_var("KVRAIL_EXEC_WRAPPER", "prlimit --nofile=256:256");
    let pair = Pair::start(&[]);
    let mut d = pair.decode.client().await;
    let metrics = pair.decode.metrics.unwrap();
    let log_before = pair.decode.log().len();

    // More idle connections than the daemon has descriptors.
    let mut idle = Vec::new();
    for _ in 0..400 {
        match TcpStream::connect(metrics) {
            Ok(s) => idle.push(s),
            Err(_) => break,
        }
    }
    assert!(idle.len() >= 300, "could open only {}", idle.len());

    // The API answers promptly while they sit there.
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), d.list_peers())
        .await
        .expect("the API must answer while the metrics port is flooded")
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));

    // Silent connections are closed by the daemon (request timeout), not held.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut open = idle.len();
    while open > 0 && Instant::now() < deadline {
        open = 0;
        for s in &mut idle {
            s.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                _ => open += 1,
            }
        }
    }
    assert_eq!(open, 0, "{open} idle connections still held after 15 s");
    drop(idle);

    let logged = pair.decode.log().len() - log_before;
    assert!(logged < 64 << 10, "{logged} bytes of log from a flood");

    // A scrape works again, and other requests get their status.
    let mut s = TcpStream::connect(metrics).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let _ = scrape(metrics);
    let mut s = TcpStream::connect(metrics).unwrap();
    s.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
}
