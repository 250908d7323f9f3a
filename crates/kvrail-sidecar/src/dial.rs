//! The dialer's side of a peer handshake: connect, hello, the acceptor's answer,
//! and (authenticated TCP) the signature exchange. Shared by the daemon's peer
//! links and `kvrail doctor`'s probes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrail_auth::Identity;
use kvrail_core::handshake::{Credentials, Dialed, Dialer, NONCE_BYTES};
use kvrail_core::wire::{self, pb, Body};
use kvrail_transport::{read_handshake_frame, Connection, Frame, Transport, TransportError};

/// Why a peer could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("no rail of peer {peer} answered: {reasons}")]
    Unreachable { peer: String, reasons: String },
    #[error("peer {peer} refused the handshake: {reason}")]
    Refused { peer: String, reason: String },
    #[error("every rail to peer {peer} has been down past the failover deadline ({causes}); still probing")]
    RailsDown { peer: String, causes: String },
}

/// A fresh random nonce for an authenticated TCP handshake.
pub fn random_nonce() -> Vec<u8> {
    rand::random::<[u8; NONCE_BYTES]>().to_vec()
}

/// This node's identity as the core's handshake uses it.
pub struct IdentityCredentials<'a>(pub &'a Identity);

impl Credentials for IdentityCredentials<'_> {
    fn certificate(&self) -> Vec<u8> {
        self.0.certificate().to_vec()
    }
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, String> {
        self.0.sign(message).map_err(|e| e.to_string())
    }
    fn verify_certificate(&self, peer: &str, certificate: &[u8]) -> Result<(), String> {
        self.0
            .verify_certificate(peer, certificate)
            .map_err(|e| e.to_string())
    }
    fn verify_signature(
        &self,
        peer: &str,
        certificate: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), String> {
        self.0
            .verify_signature(peer, certificate, message, signature)
            .map_err(|e| e.to_string())
    }
}

/// Connects to `addr` (from `local` when given) and runs the core's dialer
/// handshake over the connection: our hello, the acceptor's answer, and (with
/// `identity`, authenticated TCP) our proof. The connection and the
/// acceptor's ack. With `expected_cert` (a SHA-256, hex) the acceptor's
/// certificate must be that one: membership says which certificate a node
/// presents, the certificate says who it is.
pub async fn handshake(
    transport: &Arc<dyn Transport>,
    identity: Option<&Identity>,
    local: Option<SocketAddr>,
    addr: SocketAddr,
    mut hello: pb::Hello,
    connect_timeout: Duration,
    expected_cert: Option<&str>,
) -> Result<(Connection, pb::HelloAck), DialError> {
    let peer = hello.expected_peer.clone();
    let unreachable = |reason: String| DialError::Unreachable {
        peer: peer.clone(),
        reasons: reason,
    };
    let mut conn = tokio::time::timeout(
        connect_timeout,
        transport.connect(local, addr, &hello.expected_peer),
    )
    .await
    .map_err(|_| unreachable(format!("{} connect timed out", transport.name())))?
    .map_err(|e| match e.kind() {
        // A TLS refusal is not a reason to try a weaker transport.
        std::io::ErrorKind::PermissionDenied => DialError::Refused {
            peer: peer.clone(),
            reason: e.to_string(),
        },
        _ => unreachable(e.to_string()),
    })?;
    // Past an authenticated connect, a failed hello is the peer refusing us
    // (TLS 1.3 rejects a client certificate after the client's side of the
    // handshake is done, and the alert can be lost with the handshake keys):
    // never a reason to fall back to a weaker transport.
    let authenticated = conn.peer_certificate.is_some();
    let failed = |e: String, refused: bool| {
        if refused || authenticated {
            DialError::Refused {
                peer: peer.clone(),
                reason: format!("{} handshake failed: {e}", transport.name()),
            }
        } else {
            unreachable(e)
        }
    };
    hello.software = env!("CARGO_PKG_VERSION").to_string();
    let credentials = identity.map(IdentityCredentials);
    let (dialer, hello) = Dialer::start(
        hello,
        credentials.as_ref().map(|c| c as &dyn Credentials),
        random_nonce(),
        tokio::time::Instant::now().into_std(),
    );
    let frame = wire::encode_control(&wire::message(Body::Hello(hello)));
    conn.writer.write_control(&frame).await.map_err(|e| {
        failed(
            e.to_string(),
            e.kind() == std::io::ErrorKind::PermissionDenied,
        )
    })?;
    let reply = tokio::time::timeout_at(
        dialer.deadline().into(),
        read_handshake_frame(conn.reader.as_mut()),
    )
    .await
    .map_err(|_| {
        failed(
            kvrail_core::handshake::DialRefusal::Timeout.to_string(),
            false,
        )
    })?
    .map_err(|e| match e {
        TransportError::Io(io) => failed(
            io.to_string(),
            io.kind() == std::io::ErrorKind::PermissionDenied,
        ),
        e => failed(e.to_string(), false),
    })?;
    let Frame::Control(body) = reply else {
        return Err(DialError::Refused {
            peer: peer.clone(),
            reason: kvrail_core::handshake::DialRefusal::Unexpected.to_string(),
        });
    };
    let Dialed { ack, proof } = dialer.on_message(body).map_err(|e| DialError::Refused {
        peer: peer.clone(),
        reason: e.to_string(),
    })?;
    if let Some(expected) = expected_cert {
        // Checked only after the dialer verified the certificate is the
        // cluster CA's and names the peer (TLS, or the ack's signature).
        let presented = conn
            .peer_certificate
            .as_deref()
            .or((!ack.certificate.is_empty()).then_some(ack.certificate.as_slice()));
        if let Err(reason) = check_fingerprint(presented, expected) {
            return Err(DialError::Refused {
                peer: peer.clone(),
                reason,
            });
        }
    }
    if let Some(proof) = proof {
        let frame = wire::encode_control(&wire::message(Body::HelloProof(proof)));
        conn.writer
            .write_control(&frame)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
    }
    Ok((conn, ack))
}

/// That `presented` (a certificate, DER) has the SHA-256 `expected` (hex).
pub fn check_fingerprint(presented: Option<&[u8]>, expected: &str) -> Result<(), String> {
    let Some(cert) = presented else {
        return Err(format!(
            "it presented no certificate, but its record names one (sha256 {})",
            short(expected)
        ));
    };
    let got = kvrail_auth::certificate_sha256(cert);
    if got.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        Err(format!(
            "its certificate (sha256 {}) is not the one its record names (sha256 {})",
            short(&got),
            short(expected)
        ))
    }
}

fn short(fingerprint: &str) -> &str {
    fingerprint.get(..16).unwrap_or(fingerprint)
}
