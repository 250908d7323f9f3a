//! This host's network interfaces as the kernel shows them (addresses from
//! `getifaddrs`, the rest from `/sys/class/net` and `/proc/sys/net`): what a
//! rail's address sits on, its MTU, link state, bond and sysctls.

use std::net::IpAddr;
use std::path::Path;

/// One network interface.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Interface {
    pub name: String,
    /// Administratively up (`IFF_UP`).
    pub admin_up: bool,
    /// `operstate`: "up", "down", "lowerlayerdown", "unknown" (loopback), ...
    pub oper: String,
    /// Carrier (cable and far end present); `None` while the interface is down.
    pub carrier: Option<bool>,
    pub mtu: Option<u32>,
    /// The bond or bridge this interface is enslaved to.
    pub master: Option<String>,
    /// This interface is a bond: its slaves.
    pub bond_slaves: Option<Vec<String>>,
    pub is_bridge: bool,
    /// PCI address of the device behind it (e.g. `0000:01:00.0`), if any.
    pub pci: Option<String>,
    /// Addresses with their prefix lengths.
    pub addrs: Vec<(IpAddr, u8)>,
    /// `net.ipv4.conf.<if>.rp_filter`, `arp_ignore`, `arp_announce`.
    pub rp_filter: Option<u8>,
    pub arp_ignore: Option<u8>,
    pub arp_announce: Option<u8>,
}

impl Interface {
    /// Up and able to carry packets (loopback reports "unknown").
    pub fn is_running(&self) -> bool {
        self.admin_up
            && (self.oper == "up" || self.oper == "unknown")
            && self.carrier != Some(false)
    }

    pub fn holds(&self, ip: IpAddr) -> bool {
        self.addrs.iter().any(|(a, _)| *a == ip)
    }
}

fn read_trimmed(path: impl AsRef<Path>) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn read_num<T: std::str::FromStr>(path: impl AsRef<Path>) -> Option<T> {
    read_trimmed(path)?.parse().ok()
}

fn link_name(path: impl AsRef<Path>) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// Every interface of this network namespace, sorted by name.
pub fn interfaces() -> Vec<Interface> {
    let mut out: Vec<Interface> = Vec::new();
    let names = std::fs::read_dir("/sys/class/net")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for name in names {
        let sys = Path::new("/sys/class/net").join(&name);
        let flags = read_trimmed(sys.join("flags"))
            .and_then(|f| u32::from_str_radix(f.trim_start_matches("0x"), 16).ok())
            .unwrap_or(0);
        let conf = Path::new("/proc/sys/net/ipv4/conf").join(&name);
        out.push(Interface {
            admin_up: flags & 1 != 0,
            oper: read_trimmed(sys.join("operstate")).unwrap_or_default(),
            // Reading `carrier` fails (EINVAL) while the interface is down.
            carrier: read_num::<u8>(sys.join("carrier")).map(|c| c == 1),
            mtu: read_num(sys.join("mtu")),
            master: link_name(sys.join("master")),
            bond_slaves: read_trimmed(sys.join("bonding/slaves"))
                .map(|s| s.split_whitespace().map(str::to_string).collect()),
            is_bridge: sys.join("bridge").is_dir(),
            pci: link_name(sys.join("device")),
            addrs: Vec::new(),
            rp_filter: read_num(conf.join("rp_filter")),
            arp_ignore: read_num(conf.join("arp_ignore")),
            arp_announce: read_num(conf.join("arp_announce")),
            name,
        });
    }
    if let Ok(addrs) = if_addrs::get_if_addrs() {
        for a in addrs {
            let (ip, prefix) = match &a.addr {
                if_addrs::IfAddr::V4(v4) => (IpAddr::V4(v4.ip), v4.prefixlen),
                if_addrs::IfAddr::V6(v6) => (IpAddr::V6(v6.ip), v6.prefixlen),
            };
            if let Some(i) = out.iter_mut().find(|i| i.name == a.name) {
                i.addrs.push((ip, prefix));
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The interface that holds `ip`.
pub fn interface_of(ip: IpAddr) -> Option<Interface> {
    interfaces().into_iter().find(|i| i.holds(ip))
}

/// The MTU of the interface that holds `ip`.
pub fn mtu_of_address(ip: IpAddr) -> Option<u32> {
    interface_of(ip)?.mtu
}

/// Whether `a` and `b` lie in the same subnet of `prefix` bits.
pub fn same_subnet(a: IpAddr, b: IpAddr, prefix: u8) -> bool {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let p = u32::from(prefix.min(32));
            let mask = if p == 0 { 0 } else { u32::MAX << (32 - p) };
            u32::from(a) & mask == u32::from(b) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let p = u32::from(prefix.min(128));
            let mask = if p == 0 { 0 } else { u128::MAX << (128 - p) };
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnets() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(same_subnet(ip("10.0.0.1"), ip("10.0.0.200"), 24));
        assert!(!same_subnet(ip("10.0.0.1"), ip("10.0.1.1"), 24));
        assert!(same_subnet(ip("10.0.0.1"), ip("10.0.1.1"), 16));
        assert!(!same_subnet(ip("10.0.0.1"), ip("fe80::1"), 0));
        assert!(same_subnet(ip("fe80::1"), ip("fe80::2"), 64));
    }

    #[test]
    fn loopback_is_found_and_running() {
        let lo = interface_of("127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(lo.name, "lo");
        assert!(lo.is_running(), "{lo:?}");
        assert!(lo.mtu.is_some());
    }
}
