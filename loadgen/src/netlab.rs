//! Two nodes joined by several rails, on one machine: two network namespaces and
//! one veth pair per rail, each shaped with `tc` (a rate, optionally a delay).
//! Rails can be cut (link down, or every packet dropped) and restored. Needs root
//! and iproute2; [`NetLab::unavailable`] says why it cannot run, for a clean skip.

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context};

/// The two ends of the lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    A,
    B,
}

impl Node {
    fn index(self) -> usize {
        match self {
            Node::A => 0,
            Node::B => 1,
        }
    }
}

/// How one rail is shaped (applied to both directions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RailShape {
    /// A `tc` rate such as `2gbit` or `500mbit`.
    pub rate: String,
    /// A `tc netem` delay such as `1ms`, if any.
    pub delay: Option<String>,
}

impl RailShape {
    pub fn rate_bits_per_sec(&self) -> anyhow::Result<f64> {
        let r = self.rate.to_ascii_lowercase();
        let (num, mult) = if let Some(n) = r.strip_suffix("gbit") {
            (n, 1e9)
        } else if let Some(n) = r.strip_suffix("mbit") {
            (n, 1e6)
        } else if let Some(n) = r.strip_suffix("kbit") {
            (n, 1e3)
        } else {
            bail!(
                "rate {:?}: expected a number with gbit, mbit or kbit",
                self.rate
            )
        };
        Ok(num.trim().parse::<f64>().context("rate number")? * mult)
    }
}

/// How to cut a rail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// `ip link set ... down` on both ends.
    LinkDown,
    /// A qdisc dropping every packet on both ends (netem `loss 100%`, or a starved
    /// token bucket where the kernel has no netem). The link stays up: nothing
    /// reports an error, traffic just stops.
    DropAll,
}

/// A running lab; dropping it deletes the namespaces (and so the veths).
pub struct NetLab {
    ns: [String; 2],
    rails: Vec<RailShape>,
}

/// Why the lab cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    // The effective uid, from /proc/self/status (no libc call needed).
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("");
    if euid != "0" {
        return Some("network namespaces need root (CI runs as root)".into());
    }
    for tool in ["ip", "tc"] {
        let ok = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Some(format!("`{tool}` (iproute2) is not installed"));
        }
    }
    None
}

fn run(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("run {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl NetLab {
    /// Creates the namespaces and one shaped veth pair per entry of `rails`.
    pub fn create(rails: &[RailShape]) -> anyhow::Result<NetLab> {
        if let Some(why) = unavailable() {
            bail!("{why}");
        }
        if rails.is_empty() || rails.len() > 8 {
            bail!("a lab has 1..=8 rails");
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let ns = [format!("kvr{pid}-{n}a"), format!("kvr{pid}-{n}b")];
        for name in &ns {
            run(&["ip", "netns", "add", name])?;
        }
        let lab = NetLab {
            ns,
            rails: rails.to_vec(),
        };
        for (i, _) in rails.iter().enumerate() {
            let dev = Self::dev(i);
            run(&[
                "ip", "link", "add", &dev, "netns", &lab.ns[0], "type", "veth", "peer", "name",
                &dev, "netns", &lab.ns[1],
            ])?;
            for node in [Node::A, Node::B] {
                let ns = &lab.ns[node.index()];
                let addr = format!("{}/24", lab.addr(node, i));
                run(&["ip", "-n", ns, "addr", "add", &addr, "dev", &dev])?;
                run(&["ip", "-n", ns, "link", "set", &dev, "up"])?;
            }
            lab.shape(i)?;
        }
        for ns in &lab.ns {
            run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(lab)
    }

    fn dev(rail: usize) -> String {
        format!("rail{rail}")
    }

    pub fn rails(&self) -> &[RailShape] {
        &self.rails
    }

    /// The namespace of a node.
    pub fn namespace(&self, node: Node) -> &str {
        &self.ns[node.index()]
    }

    /// A node's address on a rail: 10.77.<rail>.1 (A) or .2 (B).
    pub fn addr(&self, node: Node, rail: usize) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 77, rail as u8, 1 + node.index() as u8))
    }

    /// `program` run inside a node's namespace.
    pub fn command(&self, node: Node, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.namespace(node)]).arg(program);
        c
    }

    /// Runs `ip ARGS` inside a node's namespace (e.g. to plant a fault).
    pub fn ip(&self, node: Node, args: &[&str]) -> anyhow::Result<()> {
        let mut a = vec!["ip", "-n", self.namespace(node)];
        a.extend_from_slice(args);
        run(&a)
    }

    /// The veth of a rail (the same name at both ends).
    pub fn rail_dev(rail: usize) -> String {
        Self::dev(rail)
    }

    /// (Re)applies a rail's rate and delay on both ends.
    fn shape(&self, rail: usize) -> anyhow::Result<()> {
        let shape = &self.rails[rail];
        let dev = Self::dev(rail);
        for ns in &self.ns {
            let _ = run(&["tc", "-n", ns, "qdisc", "del", "dev", &dev, "root"]);
            let tbf = [
                "tbf",
                "rate",
                &shape.rate,
                "burst",
                "1mb",
                "latency",
                "50ms",
            ];
            match &shape.delay {
                Some(delay) => {
                    let mut a = vec!["tc", "-n", ns, "qdisc", "add", "dev", &dev];
                    a.extend(["root", "handle", "1:", "netem", "delay", delay]);
                    a.extend(["limit", "100000"]);
                    run(&a)?;
                    let mut b = vec!["tc", "-n", ns, "qdisc", "add", "dev", &dev];
                    b.extend(["parent", "1:", "handle", "2:"]);
                    b.extend(tbf);
                    run(&b)?;
                }
                None => {
                    let mut a = vec!["tc", "-n", ns, "qdisc", "add", "dev", &dev, "root"];
                    a.extend(tbf);
                    run(&a)?;
                }
            }
        }
        Ok(())
    }

    /// Cuts a rail on both ends.
    pub fn cut(&self, rail: usize, how: Cut) -> anyhow::Result<()> {
        let dev = Self::dev(rail);
        for ns in &self.ns {
            match how {
                Cut::LinkDown => run(&["ip", "-n", ns, "link", "set", &dev, "down"])?,
                Cut::DropAll => {
                    let netem = run(&[
                        "tc", "-n", ns, "qdisc", "replace", "dev", &dev, "root", "netem", "loss",
                        "100%",
                    ]);
                    if netem.is_err() {
                        // Kernels without sch_netem: a token bucket that refills at one
                        // byte per second drops everything past its first packet.
                        run(&[
                            "tc", "-n", ns, "qdisc", "replace", "dev", &dev, "root", "tbf", "rate",
                            "8bit", "burst", "1600", "limit", "1600",
                        ])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Brings a cut rail back with its original shape.
    pub fn restore(&self, rail: usize) -> anyhow::Result<()> {
        let dev = Self::dev(rail);
        for ns in &self.ns {
            run(&["ip", "-n", ns, "link", "set", &dev, "up"])?;
        }
        self.shape(rail)
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for ns in &self.ns {
            let _ = run(&["ip", "netns", "del", ns]);
        }
    }
}
