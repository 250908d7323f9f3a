//! The versioned handshake every peer connection starts with.

use crate::wire::{pb, PROTOCOL_VERSION};

/// Why a peer's hello is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("peer speaks protocol version {theirs}, this sidecar speaks {ours}")]
    Version { theirs: u32, ours: u32 },
    #[error("peer calls itself {0:?}, which is not a configured peer")]
    UnknownPeer(String),
    #[error("peer expected to reach {expected:?} but this node is {actual:?}")]
    WrongNode { expected: String, actual: String },
    #[error("peer offers no transport in common (it has {0:?})")]
    NoCommonTransport(Vec<String>),
    #[error("first message was not a hello")]
    NotHello,
}

/// Checks a dialer's hello on the accepting side.
pub fn check_hello(
    hello: &pb::Hello,
    local_node: &str,
    is_known_peer: impl Fn(&str) -> bool,
    local_transports: &[&str],
) -> Result<(), HandshakeError> {
    if hello.protocol_version != u32::from(PROTOCOL_VERSION) {
        return Err(HandshakeError::Version {
            theirs: hello.protocol_version,
            ours: u32::from(PROTOCOL_VERSION),
        });
    }
    if !hello.expected_peer.is_empty() && hello.expected_peer != local_node {
        return Err(HandshakeError::WrongNode {
            expected: hello.expected_peer.clone(),
            actual: local_node.to_string(),
        });
    }
    if !is_known_peer(&hello.node_name) {
        return Err(HandshakeError::UnknownPeer(hello.node_name.clone()));
    }
    if !hello
        .transports
        .iter()
        .any(|t| local_transports.contains(&t.as_str()))
    {
        return Err(HandshakeError::NoCommonTransport(hello.transports.clone()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> pb::Hello {
        pb::Hello {
            protocol_version: 1,
            node_name: "prefill".into(),
            expected_peer: "decode".into(),
            transports: vec!["tcp".into()],
            ..Default::default()
        }
    }

    #[test]
    fn accepts_a_known_peer_and_refuses_the_rest() {
        let known = |n: &str| n == "prefill";
        assert_eq!(check_hello(&hello(), "decode", known, &["tcp"]), Ok(()));
        let v = pb::Hello {
            protocol_version: 9,
            ..hello()
        };
        assert!(matches!(
            check_hello(&v, "decode", known, &["tcp"]),
            Err(HandshakeError::Version { .. })
        ));
        let stranger = pb::Hello {
            node_name: "mallory".into(),
            ..hello()
        };
        assert_eq!(
            check_hello(&stranger, "decode", known, &["tcp"]),
            Err(HandshakeError::UnknownPeer("mallory".into()))
        );
        assert!(matches!(
            check_hello(&hello(), "other", known, &["tcp"]),
            Err(HandshakeError::WrongNode { .. })
        ));
        let quic_only = pb::Hello {
            transports: vec!["quic".into()],
            ..hello()
        };
        assert!(matches!(
            check_hello(&quic_only, "decode", known, &["tcp"]),
            Err(HandshakeError::NoCommonTransport(_))
        ));
    }
}
