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
    /// A field is longer than any real hello carries (checked before anything
    /// of the hello is looked up, logged or echoed).
    #[error("hello field {field} is {len} long, at most {max} allowed")]
    Oversized {
        field: &'static str,
        len: usize,
        max: usize,
    },
}

/// Longest node name (as in a DNS label set).
pub const MAX_NODE_NAME_BYTES: usize = 255;
/// Most transports a hello may offer.
pub const MAX_TRANSPORTS: usize = 8;
/// Longest transport name.
pub const MAX_TRANSPORT_NAME_BYTES: usize = 16;
/// Longest rail address text ("[v6 address%scope]:port").
pub const MAX_ADDR_BYTES: usize = 64;
/// Largest node certificate (DER); real ones are 400-1,500 bytes.
pub const MAX_CERTIFICATE_BYTES: usize = 8 << 10;
/// Longest kvrail release string.
pub const MAX_SOFTWARE_BYTES: usize = 64;

/// Size checks of every variable-length hello field.
pub fn check_hello_sizes(hello: &pb::Hello) -> Result<(), HandshakeError> {
    let check = |field, len: usize, max| {
        if len > max {
            Err(HandshakeError::Oversized { field, len, max })
        } else {
            Ok(())
        }
    };
    check("node_name", hello.node_name.len(), MAX_NODE_NAME_BYTES)?;
    check(
        "expected_peer",
        hello.expected_peer.len(),
        MAX_NODE_NAME_BYTES,
    )?;
    check("transports", hello.transports.len(), MAX_TRANSPORTS)?;
    for t in &hello.transports {
        check("transport name", t.len(), MAX_TRANSPORT_NAME_BYTES)?;
    }
    check(
        "rail_local_addr",
        hello.rail_local_addr.len(),
        MAX_ADDR_BYTES,
    )?;
    check("rail_peer_addr", hello.rail_peer_addr.len(), MAX_ADDR_BYTES)?;
    check(
        "certificate",
        hello.certificate.len(),
        MAX_CERTIFICATE_BYTES,
    )?;
    check("nonce", hello.nonce.len(), NONCE_BYTES)?;
    check("software", hello.software.len(), MAX_SOFTWARE_BYTES)?;
    Ok(())
}

/// Bytes of the random nonce each side of an authenticated TCP handshake sends.
pub const NONCE_BYTES: usize = 32;

/// Which side of an authenticated TCP handshake signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signer {
    Dialer,
    Acceptor,
}

/// What a side of an authenticated TCP handshake signs: both node names, the
/// session, rail and connection, and both nonces, under the signer's role, so a
/// signature is good for this one connection and never for the other side.
pub fn transcript(
    signer: Signer,
    hello: &pb::Hello,
    acceptor: &str,
    acceptor_nonce: &[u8],
) -> Vec<u8> {
    let mut t = Vec::with_capacity(160);
    let mut field = |bytes: &[u8]| {
        t.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        t.extend_from_slice(bytes);
    };
    field(b"kvrail tcp handshake v1");
    field(match signer {
        Signer::Dialer => b"dialer",
        Signer::Acceptor => b"acceptor",
    });
    field(hello.node_name.as_bytes());
    field(acceptor.as_bytes());
    field(&hello.session_id.to_be_bytes());
    field(&hello.rail_index.to_be_bytes());
    field(&hello.connection_index.to_be_bytes());
    field(&hello.nonce);
    field(acceptor_nonce);
    t
}

/// Checks a dialer's hello on the accepting side.
pub fn check_hello(
    hello: &pb::Hello,
    local_node: &str,
    is_known_peer: impl Fn(&str) -> bool,
    local_transports: &[&str],
) -> Result<(), HandshakeError> {
    check_hello_sizes(hello)?;
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

    #[test]
    fn oversized_fields_are_refused_first() {
        let mut h = hello();
        h.node_name = "x".repeat(16 << 20);
        let e = check_hello(&h, "decode", |_| true, &["tcp"]).unwrap_err();
        assert!(matches!(
            e,
            HandshakeError::Oversized {
                field: "node_name",
                ..
            }
        ));
        // The refusal text stays short whatever the peer sent.
        assert!(e.to_string().len() < 100, "{e}");
        let mut h = hello();
        h.transports = vec!["tcp".into(); 1000];
        assert!(check_hello(&h, "decode", |_| true, &["tcp"]).is_err());
    }

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
    fn transcripts_differ_by_signer_and_by_every_field() {
        let h = pb::Hello {
            nonce: vec![1; NONCE_BYTES],
            session_id: 9,
            ..hello()
        };
        let base = transcript(Signer::Acceptor, &h, "decode", &[2; NONCE_BYTES]);
        assert_eq!(
            base,
            transcript(Signer::Acceptor, &h, "decode", &[2; NONCE_BYTES])
        );
        let changed = |change: fn(&mut pb::Hello)| {
            let mut v = h.clone();
            change(&mut v);
            transcript(Signer::Acceptor, &v, "decode", &[2; NONCE_BYTES])
        };
        let others = [
            transcript(Signer::Dialer, &h, "decode", &[2; NONCE_BYTES]),
            transcript(Signer::Acceptor, &h, "decodf", &[2; NONCE_BYTES]),
            transcript(Signer::Acceptor, &h, "decode", &[3; NONCE_BYTES]),
            changed(|v| v.session_id = 10),
            changed(|v| v.rail_index = 1),
            changed(|v| v.connection_index = 1),
            changed(|v| v.nonce = vec![4; NONCE_BYTES]),
        ];
        for o in &others {
            assert_ne!(&base, o);
        }
        // Length prefixes: moving a byte from one name to the other changes it.
        let shifted = pb::Hello {
            node_name: "prefilld".into(),
            ..h.clone()
        };
        assert_ne!(
            transcript(Signer::Acceptor, &h, "decode", &[2; NONCE_BYTES]),
            transcript(Signer::Acceptor, &shifted, "ecode", &[2; NONCE_BYTES])
        );
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
