//! The judgements of `kvrail doctor`: pure functions of the configuration and
//! the host's facts, so each rule is tested with made-up hosts.

use std::net::{IpAddr, Ipv6Addr};

use serde::Serialize;

use super::facts::{HostFacts, RdmaPort};
use crate::config::Config;
use crate::netinfo::{same_subnet, Interface};

/// How bad a finding is. `Fail` makes `kvrail doctor` exit non-zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Info,
    Warn,
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

/// One thing doctor found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub status: Status,
    /// Stable name of the check, e.g. `link`, `mtu`, `bond`, `subnet`, `gid`.
    pub check: &'static str,
    /// The rail it concerns (None: the host).
    pub rail: Option<usize>,
    /// What it found.
    pub detail: String,
    /// How to fix it (for warnings and failures).
    pub fix: Option<String>,
}

impl Finding {
    fn new(status: Status, check: &'static str, rail: Option<usize>, detail: String) -> Self {
        Finding {
            status,
            check,
            rail,
            detail,
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// The MTU the links are expected to run (jumbo frames; RoCE path MTU 4096).
pub const EXPECTED_MTU: u32 = 9000;

/// The largest RoCE path MTU a netdev MTU allows: the netdev MTU less RoCE v2's
/// headers (GRH 40, UDP 8, BTH 12, extended headers 28+4, ICRC 4), rounded down
/// to an IB MTU (the kernel's `iboe_get_mtu`).
pub fn roce_mtu_for(netdev_mtu: u32) -> u32 {
    let room = netdev_mtu.saturating_sub(96);
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| *m <= room)
        .unwrap_or(256)
}

/// RoCE v2 and the GID of an address (IPv4-mapped for IPv4).
fn gid_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// Whether the configuration asks for RDMA.
fn wants_rdma(config: &Config) -> bool {
    config.rdma && config.wants("rdma")
}

/// Host-wide findings: the verbs library and devices, the GPU path.
pub fn host(config: &Config, host: &HostFacts) -> Vec<Finding> {
    let mut out = Vec::new();
    if wants_rdma(config) {
        match (&host.verbs_library, host.rdma_ports.is_empty()) {
            (Ok(lib), false) => out.push(Finding::new(
                Status::Ok,
                "rdma",
                None,
                format!(
                    "{lib} loaded; {} RDMA port(s): {}",
                    host.rdma_ports.len(),
                    host.rdma_ports
                        .iter()
                        .map(|p| format!("{}/{} {}", p.device, p.port, p.state))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
            (Err(why), false) => out.push(
                Finding::new(
                    Status::Fail,
                    "rdma",
                    None,
                    format!("this host has RDMA devices but {why}"),
                )
                .fix("install rdma-core's user space: apt-get install libibverbs1 ibverbs-providers"),
            ),
            (_, true) => out.push(
                Finding::new(
                    Status::Warn,
                    "rdma",
                    None,
                    "no RDMA devices on this host: every rail runs over quic/tcp".to_string(),
                )
                .fix("load the NIC's RDMA driver (mlx5_ib for ConnectX: modprobe mlx5_ib) or set rdma = false"),
            ),
        }
    }
    let g = &host.gpu;
    if g.driver {
        let name = g.name.clone().unwrap_or_else(|| "GPU".into());
        let f = if let Some(e) = &g.error {
            Finding::new(
                Status::Warn,
                "gpu",
                None,
                format!("CUDA driver present but: {e}"),
            )
        } else if g.integrated {
            Finding::new(
                Status::Info,
                "gpu",
                None,
                format!(
                    "{name} shares memory with the CPU (DGX Spark GB10): keep the KV cache in \
                     cudaHostAlloc/pinned host memory and register it as a host region; it is \
                     sent as is, with no staging"
                ),
            )
        } else if g.dma_buf || g.gpudirect_rdma || g.peermem {
            Finding::new(
                Status::Info,
                "gpu",
                None,
                format!(
                    "{name}: GPUDirect RDMA possible (dma-buf {}, nvidia_peermem {}), but kvrail \
                     stages GPU regions through pinned host buffers",
                    g.dma_buf, g.peermem
                ),
            )
        } else {
            Finding::new(
                Status::Info,
                "gpu",
                None,
                format!(
                    "{name}: no GPUDirect RDMA; GPU regions are staged through pinned host buffers"
                ),
            )
        };
        out.push(f);
    }
    out
}

/// Findings for rail `rail`, which listens on `addr`.
pub fn rail(config: &Config, host: &HostFacts, rail: usize, addr: IpAddr) -> Vec<Finding> {
    let r = Some(rail);
    let mut out = Vec::new();
    if addr.is_unspecified() {
        out.push(
            Finding::new(
                Status::Warn,
                "address",
                r,
                format!("rail {rail} listens on {addr}: traffic takes whatever route the kernel picks and no RDMA device can be found for it"),
            )
            .fix("listen on the rail port's own address (listen = [\"10.0.0.1:7470\", ...])"),
        );
        return out;
    }
    let Some(iface) = host.interfaces.iter().find(|i| i.holds(addr)) else {
        out.push(
            Finding::new(
                Status::Fail,
                "address",
                r,
                format!("no interface holds {addr}"),
            )
            .fix(format!(
                "add it to the rail's port: ip addr add {addr}/24 dev <port>, or fix listen"
            )),
        );
        return out;
    };
    let loopback = addr.is_loopback();
    out.push(Finding::new(
        Status::Ok,
        "address",
        r,
        format!("{addr} is on {}", iface.name),
    ));
    out.extend(link(iface, r));
    out.extend(bond(host, iface, r));
    if !loopback {
        out.extend(mtu(iface, r));
        out.extend(subnet(host, iface, addr, r));
        out.extend(multihost(host, iface, r));
    }
    if wants_rdma(config) && host.verbs_library.is_ok() && !host.rdma_ports.is_empty() && !loopback
    {
        let named = config.rdma_devices.get(rail).map(String::as_str);
        out.extend(rdma(host, iface, addr, named, r));
    }
    out
}

fn link(iface: &Interface, r: Option<usize>) -> Vec<Finding> {
    let name = &iface.name;
    if !iface.admin_up {
        return vec![Finding::new(
            Status::Fail,
            "link",
            r,
            format!("{name} is down (administratively)"),
        )
        .fix(format!("ip link set {name} up"))];
    }
    if iface.carrier == Some(false) || iface.oper == "down" || iface.oper == "lowerlayerdown" {
        return vec![Finding::new(
            Status::Fail,
            "link",
            r,
            format!("{name} is up but has no carrier (operstate {})", iface.oper),
        )
        .fix(
            "check the cable or transceiver and the far end's port (ip link show on both sides)",
        )];
    }
    vec![Finding::new(
        Status::Ok,
        "link",
        r,
        format!("{name} is up, carrier present"),
    )]
}

fn bond(host: &HostFacts, iface: &Interface, r: Option<usize>) -> Vec<Finding> {
    let name = &iface.name;
    if let Some(slaves) = &iface.bond_slaves {
        let slave_rails = slaves.join(", ");
        return vec![Finding::new(
            Status::Fail,
            "bond",
            r,
            format!("the rail's address is on bond {name} (slaves: {slave_rails}): RDMA verbs must use the ports, not the bond, and one bond is one rail"),
        )
        .fix(format!(
            "remove the bond ({name}); give each port ({slave_rails}) its own address in its own subnet and list each as a rail"
        ))];
    }
    if let Some(master) = &iface.master {
        let is_bond = host
            .interfaces
            .iter()
            .any(|i| &i.name == master && i.bond_slaves.is_some());
        let what = if is_bond { "bond" } else { "bridge" };
        return vec![Finding::new(
            Status::Fail,
            "bond",
            r,
            format!("{name} is enslaved to {what} {master}: its own address is bypassed"),
        )
        .fix(format!(
            "ip link set {name} nomaster, then give it the rail's address"
        ))];
    }
    if iface.is_bridge {
        return vec![Finding::new(
            Status::Warn,
            "bond",
            r,
            format!("{name} is a bridge: RDMA devices belong to ports, not bridges"),
        )
        .fix("put the rail's address on the port itself")];
    }
    Vec::new()
}

fn mtu(iface: &Interface, r: Option<usize>) -> Vec<Finding> {
    let name = &iface.name;
    match iface.mtu {
        Some(m) if m < EXPECTED_MTU => vec![Finding::new(
            Status::Warn,
            "mtu",
            r,
            format!(
                "{name} MTU {m}: the links are expected at {EXPECTED_MTU} (RoCE path MTU {} instead of 4096; more packets per byte for TCP/QUIC)",
                roce_mtu_for(m)
            ),
        )
        .fix(format!(
            "ip link set {name} mtu {EXPECTED_MTU} on both ends (and the switch ports in between)"
        ))],
        Some(m) => vec![Finding::new(Status::Ok, "mtu", r, format!("{name} MTU {m}"))],
        None => Vec::new(),
    }
}

/// Two interfaces with addresses in one subnet: ARP flux (either may answer for
/// both addresses) and, with strict reverse-path filtering, dropped replies.
/// DGX Spark's two ConnectX ports configured in one /24 hit exactly this.
fn subnet(host: &HostFacts, iface: &Interface, addr: IpAddr, r: Option<usize>) -> Vec<Finding> {
    let prefix = iface
        .addrs
        .iter()
        .find(|(a, _)| *a == addr)
        .map(|(_, p)| *p)
        .unwrap_or(32);
    let mut out = Vec::new();
    for other in &host.interfaces {
        if other.name == iface.name || !other.admin_up {
            continue;
        }
        let Some((their, _)) = other
            .addrs
            .iter()
            .find(|(a, _)| !a.is_loopback() && same_subnet(addr, *a, prefix))
        else {
            continue;
        };
        let eff = |own: Option<u8>, all: Option<u8>| own.unwrap_or(0).max(all.unwrap_or(0));
        let strict_rp = [iface, other]
            .iter()
            .any(|i| eff(i.rp_filter, host.all_rp_filter) == 1);
        let arp_safe = [iface, other].iter().all(|i| {
            eff(i.arp_ignore, host.all_arp_ignore) >= 1
                && eff(i.arp_announce, host.all_arp_announce) == 2
        });
        let status = if strict_rp || !arp_safe {
            Status::Fail
        } else {
            Status::Warn
        };
        let mut detail = format!(
            "{addr}/{prefix} on {} shares a subnet with {their} on {}: either port may answer ARP for both (ARP flux), so one rail's traffic can cross the other",
            iface.name, other.name
        );
        if strict_rp {
            detail.push_str("; strict rp_filter then drops the replies");
        }
        let (a, b) = (&iface.name, &other.name);
        out.push(Finding::new(status, "subnet", r, detail).fix(format!(
            "give each rail its own subnet (e.g. 10.0.0.0/24 and 10.0.1.0/24), or set \
             sysctl -w net.ipv4.conf.{a}.arp_ignore=1 net.ipv4.conf.{a}.arp_announce=2 \
             net.ipv4.conf.{a}.rp_filter=2 and the same for {b}"
        )));
    }
    out
}

/// ConnectX multi-host: one port seen as two PCIe functions in different PCI
/// domains (DGX Spark: `enp1s0f0np0` and `enP2p1s0f0np0`); each half carries
/// part of the port's bandwidth.
fn multihost(host: &HostFacts, iface: &Interface, r: Option<usize>) -> Vec<Finding> {
    let Some(pci) = &iface.pci else {
        return Vec::new();
    };
    let Some((domain, rest)) = pci.split_once(':') else {
        return Vec::new();
    };
    host.interfaces
        .iter()
        .filter(|o| o.name != iface.name)
        .filter_map(|o| {
            let (d, rest2) = o.pci.as_deref()?.split_once(':')?;
            (d != domain && rest2 == rest).then_some(o)
        })
        .map(|twin| {
            Finding::new(
                Status::Info,
                "multihost",
                r,
                format!(
                    "{} (PCI {}) is the other PCIe half of the port behind {} (PCI {pci}): on DGX Spark each half carries part of the port's rate",
                    twin.name,
                    twin.pci.as_deref().unwrap_or("?"),
                    iface.name
                ),
            )
            .fix(format!(
                "to use both halves give {} an address of its own and add it as another rail (listen and the peers' rails)",
                twin.name
            ))
        })
        .collect()
}

/// The rail's RDMA port: found by the address's RoCE v2 GID (or by name).
fn rdma(
    host: &HostFacts,
    iface: &Interface,
    addr: IpAddr,
    named: Option<&str>,
    r: Option<usize>,
) -> Vec<Finding> {
    let gid = gid_of(addr);
    let holding: Vec<(&RdmaPort, &super::facts::GidEntry)> = host
        .rdma_ports
        .iter()
        .filter(|p| named.is_none_or(|n| n == p.device))
        .flat_map(|p| p.gids.iter().filter(|g| g.gid == gid).map(move |g| (p, g)))
        .collect();
    let Some(&(port, entry)) = holding
        .iter()
        .find(|(_, g)| g.kind.eq_ignore_ascii_case("RoCE v2"))
        .or_else(|| holding.first())
    else {
        let ports: Vec<String> = host
            .rdma_ports
            .iter()
            .map(|p| {
                let nd: Vec<&str> = p.gids.iter().filter_map(|g| g.netdev.as_deref()).collect();
                format!(
                    "{}/{} on {}",
                    p.device,
                    p.port,
                    nd.first().copied().unwrap_or("?")
                )
            })
            .collect();
        return vec![Finding::new(
            Status::Fail,
            "gid",
            r,
            format!(
                "no RDMA port{} has a GID for {addr} (ports: {}): {} is not an RDMA port's netdev",
                named.map(|n| format!(" of {n}")).unwrap_or_default(),
                ports.join(", "),
                iface.name
            ),
        )
        .fix("put the rail's address on the RDMA port's own netdev (rdma link shows which), or name the device with rdma_devices")];
    };
    let mut out = Vec::new();
    if entry.kind.eq_ignore_ascii_case("RoCE v2") {
        out.push(Finding::new(
            Status::Ok,
            "gid",
            r,
            format!(
                "{}/{} GID index {} is {addr} (RoCE v2)",
                port.device, port.port, entry.index
            ),
        ));
    } else {
        out.push(
            Finding::new(
                Status::Fail,
                "gid",
                r,
                format!(
                    "{}/{} has {addr} only as a {} GID (index {}): RoCE v2 is needed to route over IP",
                    port.device, port.port, entry.kind, entry.index
                ),
            )
            .fix("enable RoCE v2 on the port (e.g. cma_roce_mode, or the NIC's RoCE mode setting)"),
        );
    }
    if let Some(nd) = entry.netdev.as_deref().filter(|nd| *nd != iface.name) {
        out.push(Finding::new(
            Status::Warn,
            "gid",
            r,
            format!(
                "the GID for {addr} belongs to {nd}, the address to {}",
                iface.name
            ),
        ));
    }
    if port.state.eq_ignore_ascii_case("ACTIVE") {
        out.push(Finding::new(
            Status::Ok,
            "port",
            r,
            format!("{}/{} ACTIVE ({})", port.device, port.port, port.phys_state),
        ));
    } else {
        out.push(
            Finding::new(
                Status::Fail,
                "port",
                r,
                format!(
                    "{}/{} is {} (physical state {})",
                    port.device, port.port, port.state, port.phys_state
                ),
            )
            .fix(format!(
                "bring the link up (ip link set {} up; check the cable and the far end)",
                iface.name
            )),
        );
    }
    if let (Some(active), Some(netdev)) = (port.active_mtu, iface.mtu) {
        let possible = roce_mtu_for(netdev);
        if active < possible {
            out.push(
                Finding::new(
                    Status::Warn,
                    "rdma-mtu",
                    r,
                    format!(
                        "{}/{} runs path MTU {active} though {} (MTU {netdev}) allows {possible}",
                        port.device, port.port, iface.name
                    ),
                )
                .fix("the port's MTU is set below the netdev's: check the NIC's RoCE MTU settings"),
            );
        } else {
            out.push(Finding::new(
                Status::Ok,
                "rdma-mtu",
                r,
                format!("path MTU {active} (netdev MTU {netdev})"),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::facts::{GidEntry, GpuFacts};
    use super::*;

    fn iface(name: &str, addr: &str, prefix: u8) -> Interface {
        Interface {
            name: name.into(),
            admin_up: true,
            oper: "up".into(),
            carrier: Some(true),
            mtu: Some(9000),
            addrs: vec![(addr.parse().unwrap(), prefix)],
            ..Interface::default()
        }
    }

    fn host(interfaces: Vec<Interface>) -> HostFacts {
        HostFacts {
            interfaces,
            all_rp_filter: Some(0),
            all_arp_ignore: Some(0),
            all_arp_announce: Some(0),
            verbs_library: Err("no libibverbs".into()),
            rdma_ports: Vec::new(),
            gpu: GpuFacts::default(),
        }
    }

    fn config() -> Config {
        Config {
            node: "a".into(),
            ..Config::default()
        }
    }

    fn worst(f: &[Finding], check: &str) -> Option<Status> {
        f.iter()
            .filter(|f| f.check == check)
            .map(|f| f.status)
            .max()
    }

    #[test]
    fn roce_mtu_follows_the_kernel_rule() {
        assert_eq!(roce_mtu_for(9000), 4096);
        assert_eq!(roce_mtu_for(4200), 4096);
        assert_eq!(roce_mtu_for(1500), 1024);
        assert_eq!(roce_mtu_for(1000), 512);
    }

    #[test]
    fn a_healthy_rail_has_no_warnings() {
        let h = host(vec![
            iface("eth0", "10.0.0.1", 24),
            iface("eth1", "10.0.1.1", 24),
        ]);
        let f = rail(&config(), &h, 0, "10.0.0.1".parse().unwrap());
        assert!(f.iter().all(|f| f.status <= Status::Info), "{f:#?}");
    }

    #[test]
    fn missing_address_down_link_and_no_carrier_fail() {
        let h = host(vec![iface("eth0", "10.0.0.1", 24)]);
        let f = rail(&config(), &h, 0, "10.9.9.9".parse().unwrap());
        assert_eq!(worst(&f, "address"), Some(Status::Fail));

        let mut down = iface("eth0", "10.0.0.1", 24);
        down.admin_up = false;
        let f = rail(&config(), &host(vec![down]), 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "link"), Some(Status::Fail));
        assert!(f
            .iter()
            .any(|f| f.fix.as_deref() == Some("ip link set eth0 up")));

        let mut dark = iface("eth0", "10.0.0.1", 24);
        dark.carrier = Some(false);
        dark.oper = "lowerlayerdown".into();
        let f = rail(&config(), &host(vec![dark]), 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "link"), Some(Status::Fail));
    }

    #[test]
    fn bonds_and_enslaved_ports_fail() {
        let mut b = iface("bond0", "10.0.0.1", 24);
        b.bond_slaves = Some(vec!["eth0".into(), "eth1".into()]);
        let f = rail(&config(), &host(vec![b]), 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "bond"), Some(Status::Fail));
        assert!(f.iter().any(|f| f.detail.contains("eth0, eth1")));

        let mut bond = iface("bond0", "10.0.9.1", 24);
        bond.bond_slaves = Some(vec!["eth0".into()]);
        let mut slave = iface("eth0", "10.0.0.1", 24);
        slave.master = Some("bond0".into());
        let f = rail(
            &config(),
            &host(vec![bond, slave]),
            0,
            "10.0.0.1".parse().unwrap(),
        );
        assert!(f
            .iter()
            .any(|f| f.status == Status::Fail && f.detail.contains("enslaved to bond bond0")));
    }

    #[test]
    fn small_mtu_warns() {
        let mut i = iface("eth0", "10.0.0.1", 24);
        i.mtu = Some(1500);
        let f = rail(&config(), &host(vec![i]), 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "mtu"), Some(Status::Warn));
        assert!(f.iter().any(|f| f.detail.contains("RoCE path MTU 1024")));
    }

    #[test]
    fn two_ports_in_one_subnet_fail_unless_arp_is_tamed() {
        let h = host(vec![
            iface("eth0", "10.0.0.1", 24),
            iface("eth1", "10.0.0.2", 24),
        ]);
        let f = rail(&config(), &h, 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "subnet"), Some(Status::Fail));

        let mut a = iface("eth0", "10.0.0.1", 24);
        let mut b = iface("eth1", "10.0.0.2", 24);
        for i in [&mut a, &mut b] {
            i.arp_ignore = Some(1);
            i.arp_announce = Some(2);
            i.rp_filter = Some(2);
        }
        let f = rail(&config(), &host(vec![a, b]), 0, "10.0.0.1".parse().unwrap());
        assert_eq!(worst(&f, "subnet"), Some(Status::Warn));
    }

    #[test]
    fn multihost_twins_are_pointed_out() {
        let mut a = iface("enp1s0f0np0", "10.0.0.1", 24);
        a.pci = Some("0000:01:00.0".into());
        let mut b = iface("enP2p1s0f0np0", "10.0.5.1", 24);
        b.pci = Some("0002:01:00.0".into());
        let f = rail(&config(), &host(vec![a, b]), 0, "10.0.0.1".parse().unwrap());
        let m: Vec<_> = f.iter().filter(|f| f.check == "multihost").collect();
        assert_eq!(m.len(), 1, "{f:#?}");
        assert!(m[0].detail.starts_with("enP2p1s0f0np0"));
    }

    fn port(state: &str, gid: &str, kind: &str, netdev: &str, mtu: u32) -> RdmaPort {
        RdmaPort {
            device: "mlx5_0".into(),
            port: 1,
            state: state.into(),
            phys_state: "LinkUp".into(),
            link_layer: "Ethernet".into(),
            active_mtu: Some(mtu),
            gids: vec![GidEntry {
                index: 3,
                gid: gid.parse().unwrap(),
                kind: kind.into(),
                netdev: Some(netdev.into()),
            }],
        }
    }

    fn rdma_host(ports: Vec<RdmaPort>, mtu: u32) -> HostFacts {
        let mut i = iface("eth0", "10.0.0.1", 24);
        i.mtu = Some(mtu);
        let mut h = host(vec![i]);
        h.verbs_library = Ok("libibverbs.so.1".into());
        h.rdma_ports = ports;
        h
    }

    #[test]
    fn rdma_gid_port_and_mtu() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let ok = rdma_host(
            vec![port("ACTIVE", "::ffff:10.0.0.1", "RoCE v2", "eth0", 4096)],
            9000,
        );
        let f = rail(&config(), &ok, 0, ip);
        assert_eq!(worst(&f, "gid"), Some(Status::Ok), "{f:#?}");
        assert_eq!(worst(&f, "port"), Some(Status::Ok));
        assert_eq!(worst(&f, "rdma-mtu"), Some(Status::Ok));

        let v1 = rdma_host(
            vec![port(
                "ACTIVE",
                "::ffff:10.0.0.1",
                "IB/RoCE v1",
                "eth0",
                4096,
            )],
            9000,
        );
        assert_eq!(
            worst(&rail(&config(), &v1, 0, ip), "gid"),
            Some(Status::Fail)
        );

        let none = rdma_host(
            vec![port("ACTIVE", "::ffff:10.0.7.1", "RoCE v2", "eth7", 4096)],
            9000,
        );
        assert_eq!(
            worst(&rail(&config(), &none, 0, ip), "gid"),
            Some(Status::Fail)
        );

        let down = rdma_host(
            vec![port("DOWN", "::ffff:10.0.0.1", "RoCE v2", "eth0", 4096)],
            9000,
        );
        assert_eq!(
            worst(&rail(&config(), &down, 0, ip), "port"),
            Some(Status::Fail)
        );

        let low = rdma_host(
            vec![port("ACTIVE", "::ffff:10.0.0.1", "RoCE v2", "eth0", 1024)],
            9000,
        );
        assert_eq!(
            worst(&rail(&config(), &low, 0, ip), "rdma-mtu"),
            Some(Status::Warn)
        );
    }

    #[test]
    fn rdma_devices_without_libibverbs_fail() {
        let mut h = rdma_host(
            vec![port("ACTIVE", "::ffff:10.0.0.1", "RoCE v2", "eth0", 4096)],
            9000,
        );
        h.verbs_library = Err("libibverbs cannot be loaded".into());
        assert_eq!(
            worst(&super::host(&config(), &h), "rdma"),
            Some(Status::Fail)
        );
    }
}
