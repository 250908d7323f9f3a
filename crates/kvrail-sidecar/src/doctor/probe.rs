//! Peer probes: each configured peer on each rail, with the real handshake
//! (authenticated where the node has certificates) marked as a probe, so the
//! peer runs every check of a real connection, answers and attaches nothing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrail_auth::{Identity, IdentityFiles};
use kvrail_core::wire::{pb, PROTOCOL_VERSION};
use kvrail_quic::QuicTransport;
use kvrail_transport::tcp::TcpTransport;
use kvrail_transport::Transport;

use super::checks::{Finding, Status};
use crate::config::Config;
use crate::dial::DialError;

/// A stream transport and the node identity it authenticates with.
type ProbeTransport = (Arc<dyn Transport>, Option<Arc<Identity>>);

/// The stream transport and identity a probe uses: the first non-RDMA
/// transport this node would use, set up as the daemon sets it up.
fn probe_transport(config: &Config) -> Result<ProbeTransport, String> {
    let identity = match &config.tls_dir {
        Some(dir) => Some(Arc::new(
            Identity::load(&config.node, &IdentityFiles::in_dir(dir, &config.node))
                .map_err(|e| format!("node identity: {e}"))?,
        )),
        None => None,
    };
    for name in config.transport_order() {
        match name.as_str() {
            "tcp" => return Ok((Arc::new(TcpTransport), identity)),
            "quic" => {
                let Some(id) = &identity else {
                    return Err("quic needs tls_dir".into());
                };
                let quic = QuicTransport::new(id, &config.quic_settings())
                    .map_err(|e| format!("quic: {e}"))?;
                return Ok((Arc::new(quic), identity));
            }
            _ => {}
        }
    }
    Err("no stream transport configured".into())
}

/// Probes every peer on every rail.
pub async fn peers(config: &Config, timeout: Duration) -> Vec<Finding> {
    let mut out = Vec::new();
    if config.peers.is_empty() {
        return out;
    }
    let (transport, identity) = match probe_transport(config) {
        Ok(t) => t,
        Err(e) => {
            out.push(Finding {
                status: Status::Fail,
                check: "peer",
                rail: None,
                detail: format!("cannot probe peers: {e}"),
                fix: Some("fix the node's certificates (kvrail certs) or transports".into()),
            });
            return out;
        }
    };
    let tcp_identity = if transport.name() == "tcp" && !config.insecure {
        identity.as_deref()
    } else {
        None
    };
    for peer in &config.peers {
        for (rail, addr) in peer.rails.iter().enumerate() {
            out.push(
                probe_one(
                    config,
                    &transport,
                    tcp_identity,
                    &peer.name,
                    rail,
                    *addr,
                    timeout,
                )
                .await,
            );
        }
    }
    out
}

async fn probe_one(
    config: &Config,
    transport: &Arc<dyn Transport>,
    identity: Option<&Identity>,
    peer: &str,
    rail: usize,
    addr: SocketAddr,
    timeout: Duration,
) -> Finding {
    let listen = config.listen.get(rail);
    let local = listen
        .filter(|a| !a.ip().is_unspecified() && !a.ip().is_loopback())
        .map(|a| SocketAddr::new(a.ip(), 0));
    let hello = pb::Hello {
        protocol_version: u32::from(PROTOCOL_VERSION),
        node_name: config.node.clone(),
        session_id: rand::random(),
        rail_index: rail as u32,
        connection_index: 0,
        transports: config
            .transport_order()
            .into_iter()
            .filter(|t| t != "rdma")
            .collect(),
        rail_count: config.listen.len() as u32,
        expected_peer: peer.to_string(),
        rail_local_addr: local.map(|a| a.ip().to_string()).unwrap_or_default(),
        rail_peer_addr: addr.to_string(),
        probe: true,
        ..Default::default()
    };
    let tname = transport.name();
    let result = tokio::time::timeout(
        timeout,
        crate::dial::handshake(transport, identity, local, addr, hello, timeout, None),
    )
    .await;
    let finding = |status, detail: String, fix: Option<String>| Finding {
        status,
        check: "peer",
        rail: Some(rail),
        detail,
        fix,
    };
    match result {
        Err(_) => finding(
            Status::Fail,
            format!("{peer} at {addr} over {tname}: no answer within {timeout:?}"),
            Some(format!(
                "check that kvrail serves there and that the rail routes: ping -I {} {}",
                listen.map(|a| a.ip().to_string()).unwrap_or_default(),
                addr.ip()
            )),
        ),
        Ok(Err(DialError::Refused { reason, .. })) => {
            let skew = reason.contains("protocol version");
            let fix = if skew {
                "run the same kvrail release on every node (kvrail --version)".to_string()
            } else if reason.contains("certificate") || reason.contains("authentic") {
                "issue both nodes' certificates from the same CA (kvrail certs node) and check --tls-dir / --insecure on both".to_string()
            } else {
                "compare both nodes' configuration (node names, peers, rails, transports)"
                    .to_string()
            };
            finding(
                Status::Fail,
                format!(
                    "{peer} at {addr} over {tname} refused us: {reason}{}",
                    if skew { " (version skew)" } else { "" }
                ),
                Some(fix),
            )
        }
        Ok(Err(e)) => finding(
            Status::Fail,
            format!("{peer} at {addr} over {tname}: {e}"),
            Some("check that kvrail serves there (kvrail serve --listen ...) and that nothing filters the port".into()),
        ),
        Ok(Ok((_conn, ack))) if ack.protocol_version != u32::from(PROTOCOL_VERSION) => finding(
            Status::Fail,
            format!(
                "{peer} at {addr} answers with protocol version {}, this node speaks {} (version skew)",
                ack.protocol_version, PROTOCOL_VERSION
            ),
            Some("run the same kvrail release on every node (kvrail --version)".into()),
        ),
        Ok(Ok((_conn, ack))) => {
            let local_mtu = listen.and_then(|a| crate::netinfo::mtu_of_address(a.ip()));
            let software = if ack.software.is_empty() {
                "an older kvrail".to_string()
            } else {
                format!("kvrail {}", ack.software)
            };
            let mut detail = format!(
                "{peer} at {addr} over {tname}: handshake ok ({software}, protocol {}, offers {})",
                ack.protocol_version,
                ack.transports.join("/")
            );
            match (local_mtu, ack.rail_mtu) {
                (Some(here), there) if there != 0 && there != here => {
                    return finding(
                        Status::Fail,
                        format!("{detail}; but MTU {here} here and {there} on {peer}'s rail {rail}: frames above {} bytes are dropped", here.min(there)),
                        Some(format!(
                            "set the same MTU on both ends (and the switch): ip link set <port> mtu {}",
                            here.max(there)
                        )),
                    );
                }
                (Some(here), there) if there != 0 => {
                    detail.push_str(&format!(", MTU {here} both ends"));
                }
                _ => {}
            }
            finding(Status::Ok, detail, None)
        }
    }
}
