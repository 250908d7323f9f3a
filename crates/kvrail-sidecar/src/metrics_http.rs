//! The `/metrics` listener: a deliberately small HTTP/1 server. Anyone who can
//! reach the port can open connections, so each is bounded: at most
//! [`MAX_CONNECTIONS`] at once, a request head of at most 8 KiB that must
//! arrive within [`REQUEST_TIMEOUT`], one response, then close. When all are
//! taken, a new connection closes the oldest one that has not finished
//! sending its request (a scraper sends its GET at once; a client that holds
//! connections open silently can no longer keep every scrape out). Accept
//! errors (such as running out of file descriptors) back off and are logged a
//! few times a second at most.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tracing::warn;

use kvrail_transport::ratelog::RateLimitedLog;

/// Scrapes served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Longest a client may take to send its request (and to read the answer).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head read.
const MAX_REQUEST_BYTES: usize = 8 << 10;
/// How often histograms and summaries are folded (what `install()` would do).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Binds `addr` and serves scrapes in the background; the bound address.
pub async fn serve(addr: SocketAddr, handle: PrometheusHandle) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen for metrics on {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP_EVERY);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(accept_loop(listener, handle));
    Ok(bound)
}

/// A connection being served, and whether its request head has arrived.
struct Served {
    task: JoinHandle<()>,
    asked: Arc<AtomicBool>,
    accepted: std::time::Instant,
}

/// A connection that has not sent its request may be closed for a newcomer
/// once it has had this long to: a scraper sends its GET at once, but it is
/// read only when its task runs.
const SILENT_AGE: Duration = Duration::from_millis(20);

/// Room for one more connection: the oldest silent one gives way once it
/// has had [`SILENT_AGE`] to send its request (waiting that long for it at
/// most); false when every one is being answered.
async fn make_room(served: &mut VecDeque<Served>) -> bool {
    loop {
        served.retain(|c| !c.task.is_finished());
        if served.len() < MAX_CONNECTIONS {
            return true;
        }
        let Some(i) = served.iter().position(|c| !c.asked.load(Ordering::Acquire)) else {
            return false;
        };
        let age = served[i].accepted.elapsed();
        if age >= SILENT_AGE {
            if let Some(c) = served.remove(i) {
                c.task.abort();
            }
            return true;
        }
        tokio::time::sleep(SILENT_AGE - age).await;
    }
}

async fn accept_loop(listener: TcpListener, handle: PrometheusHandle) {
    // Oldest first.
    let mut served: VecDeque<Served> = VecDeque::new();
    let log = RateLimitedLog::new(2);
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                if !make_room(&mut served).await {
                    drop(stream);
                    continue;
                }
                let handle = handle.clone();
                let asked = Arc::new(AtomicBool::new(false));
                let flag = asked.clone();
                let task = tokio::spawn(async move {
                    let _ =
                        tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &handle, &flag)).await;
                });
                served.push_back(Served {
                    task,
                    asked,
                    accepted: std::time::Instant::now(),
                });
            }
            Err(e) => {
                if let Some(suppressed) = log.admit() {
                    warn!(suppressed, "metrics listener: accept failed: {e}");
                }
                // EMFILE and friends: give the process a moment to free descriptors.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    asked: &AtomicBool,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST_BYTES {
            return respond(&mut stream, "431 Request Header Fields Too Large", "").await;
        }
    }
    asked.store(true, Ordering::Release);
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|b| *b == b' ');
    let (method, path) = (
        words.next().unwrap_or_default(),
        words.next().unwrap_or_default(),
    );
    if method != b"GET" {
        return respond(&mut stream, "405 Method Not Allowed", "").await;
    }
    if path != b"/metrics" && path != b"/" {
        return respond(&mut stream, "404 Not Found", "").await;
    }
    respond(&mut stream, "200 OK", &handle.render()).await
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
