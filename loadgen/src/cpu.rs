//! CPU time from /proc: what the sidecars spend per byte they move, and how busy
//! the whole machine was meanwhile (a point at 100% is CPU-bound, not waiting).

/// Clock ticks per second of /proc's CPU times: USER_HZ, which Linux fixes at
/// 100 in its user ABI on every architecture kvrail runs on (whatever the
/// kernel's internal HZ), so no `sysconf` call (and no `unsafe`) is needed.
const TICKS_PER_S: f64 = 100.0;

/// CPU counters at one instant.
#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    /// utime + stime of the watched processes, all threads.
    process_ticks: u64,
    /// The same, per watched process (in the order given).
    each_ticks: [u64; MAX_EACH],
    /// Busy and all ticks of the machine, summed over its cores.
    machine_busy_ticks: u64,
    machine_ticks: u64,
    /// Machine-wide loss counters (zero where /proc/net/snmp cannot be read).
    net: NetCounters,
}

/// The kernel's loss counters of UDP and TCP (`/proc/net/snmp`), machine-wide:
/// on loopback every drop or resend in a run is one of the run's.
#[derive(Debug, Clone, Copy, Default)]
pub struct NetCounters {
    /// UDP datagrams dropped because a socket's receive buffer was full.
    pub udp_rcvbuf_errors: u64,
    /// UDP datagrams dropped because a socket's send buffer was full.
    pub udp_sndbuf_errors: u64,
    /// TCP segments sent again.
    pub tcp_retrans_segs: u64,
}

impl NetCounters {
    /// The counters now.
    pub fn read() -> Option<NetCounters> {
        let snmp = std::fs::read_to_string("/proc/net/snmp").ok()?;
        Some(Self::parse(&snmp))
    }

    /// Reads the `Udp:` and `Tcp:` pairs of lines (names, then values).
    fn parse(snmp: &str) -> NetCounters {
        let mut c = NetCounters::default();
        let lines: Vec<&str> = snmp.lines().collect();
        for pair in lines.windows(2) {
            let (Some((proto, names)), Some((proto2, values))) =
                (pair[0].split_once(':'), pair[1].split_once(':'))
            else {
                continue;
            };
            if proto != proto2 || names.trim_start().starts_with(char::is_numeric) {
                continue;
            }
            for (name, value) in names.split_whitespace().zip(values.split_whitespace()) {
                let Ok(v) = value.parse::<u64>() else {
                    continue;
                };
                match (proto, name) {
                    ("Udp", "RcvbufErrors") => c.udp_rcvbuf_errors = v,
                    ("Udp", "SndbufErrors") => c.udp_sndbuf_errors = v,
                    ("Tcp", "RetransSegs") => c.tcp_retrans_segs = v,
                    _ => {}
                }
            }
        }
        c
    }

    fn since(&self, earlier: &NetCounters) -> NetCounters {
        NetCounters {
            udp_rcvbuf_errors: self
                .udp_rcvbuf_errors
                .saturating_sub(earlier.udp_rcvbuf_errors),
            udp_sndbuf_errors: self
                .udp_sndbuf_errors
                .saturating_sub(earlier.udp_sndbuf_errors),
            tcp_retrans_segs: self
                .tcp_retrans_segs
                .saturating_sub(earlier.tcp_retrans_segs),
        }
    }
}

/// Processes whose CPU time is also kept one by one (the two sidecars).
const MAX_EACH: usize = 2;

/// CPU spent between two samples.
#[derive(Debug, Clone, Copy)]
pub struct CpuUse {
    /// The watched processes' CPU time per byte moved, in nanoseconds.
    pub ns_per_byte: f64,
    /// The same for each of the first two watched processes (the sending
    /// and the receiving sidecar of a push).
    pub each_ns_per_byte: [f64; MAX_EACH],
    /// Fraction of all the machine's cores that were busy.
    pub machine_busy: f64,
    /// Drops and resends meanwhile.
    pub net: NetCounters,
}

/// The counters now, or `None` where /proc cannot tell (then nothing is reported).
pub fn sample(pids: &[u32]) -> Option<CpuSample> {
    let mut process_ticks = 0;
    let mut each_ticks = [0; MAX_EACH];
    for (i, pid) in pids.iter().enumerate() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = stat.get(stat.rfind(')')? + 2..)?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the line, 12 and 13 of `rest`.
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        process_ticks += utime + stime;
        if let Some(each) = each_ticks.get_mut(i) {
            *each = utime + stime;
        }
    }
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<u64> = cpu
        .split_whitespace()
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...; idle and iowait are not busy.
    let machine_ticks: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some(CpuSample {
        process_ticks,
        each_ticks,
        machine_busy_ticks: machine_ticks - idle,
        machine_ticks,
        net: NetCounters::read().unwrap_or_default(),
    })
}

/// What `pids` spent from `before` to now while `bytes` moved.
pub fn since(before: Option<CpuSample>, pids: &[u32], bytes: u64) -> Option<CpuUse> {
    sample(pids)?.since(&before?, bytes)
}

impl std::fmt::Display for CpuUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cpu {:.2} ns/B, busy {:.0}%",
            self.ns_per_byte,
            self.machine_busy * 100.0
        )?;
        let n = &self.net;
        if n.udp_rcvbuf_errors + n.udp_sndbuf_errors + n.tcp_retrans_segs > 0 {
            write!(
                f,
                ", udp drops {}+{}, tcp resent {}",
                n.udp_rcvbuf_errors, n.udp_sndbuf_errors, n.tcp_retrans_segs
            )?;
        }
        Ok(())
    }
}

impl CpuSample {
    /// What was spent from `earlier` to `self` while `bytes` moved.
    pub fn since(&self, earlier: &CpuSample, bytes: u64) -> Option<CpuUse> {
        let process = self.process_ticks.checked_sub(earlier.process_ticks)?;
        let busy = self
            .machine_busy_ticks
            .checked_sub(earlier.machine_busy_ticks)?;
        let all = self.machine_ticks.checked_sub(earlier.machine_ticks)?;
        if bytes == 0 || all == 0 {
            return None;
        }
        let per_byte = |ticks: u64| ticks as f64 / TICKS_PER_S * 1e9 / bytes as f64;
        let mut each_ns_per_byte = [0.0; MAX_EACH];
        for (i, e) in each_ns_per_byte.iter_mut().enumerate() {
            *e = per_byte(self.each_ticks[i].saturating_sub(earlier.each_ticks[i]));
        }
        Some(CpuUse {
            ns_per_byte: per_byte(process),
            each_ns_per_byte,
            machine_busy: busy as f64 / all as f64,
            net: self.net.since(&earlier.net),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snmp_counters_are_read_by_name() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
            Tcp: RtoAlgorithm ActiveOpens RetransSegs InErrs\nTcp: 1 20 7 0\n\
            Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
            Udp: 100 0 42 90 41 3\n\
            UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
            UdpLite: 0 0 0 0 9 9\n";
        let c = NetCounters::parse(snmp);
        assert_eq!(
            (c.udp_rcvbuf_errors, c.udp_sndbuf_errors, c.tcp_retrans_segs),
            (41, 3, 7)
        );
        let later = NetCounters {
            udp_rcvbuf_errors: 50,
            ..c
        };
        assert_eq!(later.since(&c).udp_rcvbuf_errors, 9);
        if std::path::Path::new("/proc/net/snmp").exists() {
            assert!(NetCounters::read().is_some());
        }
    }

    #[test]
    fn our_own_cpu_time_is_counted() {
        let pid = std::process::id();
        let before = sample(&[pid]).unwrap();
        // Burn about 50 ms of CPU (5 ticks) so the counters must move.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(60) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = sample(&[pid]).unwrap();
        let used = after.since(&before, 1_000_000).unwrap();
        assert!(used.ns_per_byte > 0.0, "{used:?}");
        assert!(
            used.machine_busy > 0.0 && used.machine_busy <= 1.0,
            "{used:?}"
        );
    }
}
