//! perftest (`ib_write_bw`, `ib_write_lat`) on the device pairs kvrail's rails use,
//! run in the same `loadgen bench --transport rdma` invocation for side-by-side
//! ratios. The server and client run as two processes on this host (the RDMA VM's
//! two nodes share one kernel); their out-of-band exchange goes over loopback.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// One rail's devices: the server (decode node) and the client (prefill node), and
/// the GID index of their RoCE v2 address.
#[derive(Debug, Clone)]
pub struct DevicePair {
    pub server: String,
    pub client: String,
    pub gid_index: u8,
}

/// What `ib_write_lat` reports, in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct WriteLatency {
    pub typical_us: f64,
    pub average_us: f64,
    pub p99_us: f64,
}

/// The numbers on the line after the table header that starts with `#bytes`.
fn result_row(stdout: &str) -> anyhow::Result<Vec<f64>> {
    let mut lines = stdout
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next().context("perftest printed no result table")?;
    let row = lines.next().context("perftest printed no result row")?;
    row.split_whitespace()
        .map(|x| {
            x.parse::<f64>()
                .with_context(|| format!("result row {row:?}"))
        })
        .collect()
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `tool` as server on `pair.server` and client on `pair.client` with `args`;
/// the client's output once it succeeds.
fn run_pair(tool: &str, pair: &DevicePair, args: &[String]) -> anyhow::Result<Output> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let common = |dev: &str| {
        let mut c = Command::new(tool);
        c.args([
            "-d",
            dev,
            "-x",
            &pair.gid_index.to_string(),
            "-p",
            &port,
            "-F",
        ])
        .args(args);
        c
    };
    let server = common(&pair.server)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("{tool} is not installed (apt-get install perftest)"))?;
    let _server = Server(server);
    // The client fails fast until the server listens.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = common(&pair.client).arg("127.0.0.1").output()?;
        if out.status.success() {
            return Ok(out);
        }
        if Instant::now() > deadline {
            bail!(
                "{tool} on {} -> {} failed: {}{}",
                pair.client,
                pair.server,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `ib_write_bw` with `qps` queue pairs and `size`-byte messages on every pair at
/// once; the sum of their average rates, GB/s. perftest busy-polls completions
/// (this build has no event mode): on a CPU-emulated NIC that costs the NIC a CPU.
pub fn write_bw(
    pairs: &[DevicePair],
    size: u64,
    iterations: u64,
    qps: usize,
) -> anyhow::Result<f64> {
    let args = [
        "-s".to_string(),
        size.to_string(),
        "-n".into(),
        iterations.to_string(),
        "-q".into(),
        qps.to_string(),
        "--report_gbits".into(),
    ];
    std::thread::scope(|scope| {
        let runs: Vec<_> = pairs
            .iter()
            .map(|p| scope.spawn(|| run_pair("ib_write_bw", p, &args)))
            .collect();
        let mut total = 0.0;
        for r in runs {
            let out = r
                .join()
                .map_err(|_| anyhow::anyhow!("ib_write_bw thread panicked"))??;
            let row = result_row(&String::from_utf8_lossy(&out.stdout))?;
            // #bytes #iterations peak average msg-rate; --report_gbits: Gbit/s.
            let avg = *row.get(3).context("ib_write_bw row has no average")?;
            total += avg / 8.0;
        }
        Ok(total)
    })
}

/// `ib_write_lat` of `size`-byte writes on one pair.
pub fn write_lat(pair: &DevicePair, size: u64, iterations: u64) -> anyhow::Result<WriteLatency> {
    let args = [
        "-s".to_string(),
        size.to_string(),
        "-n".into(),
        iterations.to_string(),
    ];
    let out = run_pair("ib_write_lat", pair, &args)?;
    let row = result_row(&String::from_utf8_lossy(&out.stdout))?;
    // #bytes #iterations t_min t_max t_typical t_avg t_stdev p99 p99.9
    if row.len() < 8 {
        bail!("ib_write_lat row has {} columns, expected 9", row.len());
    }
    Ok(WriteLatency {
        typical_us: row[4],
        average_us: row[5],
        p99_us: row[7],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_row_after_the_header() {
        let bw = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n 1048576    300              0.41               0.40   \t\t   0.000047\n-----\n";
        assert_eq!(
            result_row(bw).unwrap(),
            vec![1048576.0, 300.0, 0.41, 0.40, 0.000047]
        );
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 4096    1000          69.40          266.30       81.77    \t       90.62       \t23.40  \t\t204.28  \t\t266.30 \n";
        let row = result_row(lat).unwrap();
        assert_eq!((row[4], row[5], row[7]), (81.77, 90.62, 204.28));
        assert!(result_row("no table here").is_err());
        assert!(result_row(" #bytes x\n 12 abc\n").is_err());
    }
}
