//! The dialer's side of a peer handshake: connect, hello, the acceptor's answer,
//! and (authenticated TCP) the signature exchange. Shared by the daemon's peer
//! links and `kvrail doctor`'s probes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrail_auth::Identity;
use kvrail_core::handshake::{transcript, Signer, NONCE_BYTES};
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

/// How long the acceptor has to answer a hello.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh random nonce for an authenticated TCP handshake.
pub fn random_nonce() -> Vec<u8> {
    rand::random::<[u8; NONCE_BYTES]>().to_vec()
}

/// Connects to `addr` (from `local` when given), sends `hello` and checks the
/// acceptor's answer; with `identity` (authenticated TCP) also checks its
/// signature and sends our proof. The connection and the acceptor's ack.
pub async fn handshake(
    transport: &Arc<dyn Transport>,
    identity: Option<&Identity>,
    local: Option<SocketAddr>,
    addr: SocketAddr,
    mut hello: pb::Hello,
    connect_timeout: Duration,
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
    if let Some(id) = identity {
        hello.certificate = id.certificate().to_vec();
        hello.nonce = random_nonce();
    }
    hello.software = env!("CARGO_PKG_VERSION").to_string();
    let frame = wire::encode_control(&wire::message(Body::Hello(hello.clone())));
    conn.writer.write_control(&frame).await.map_err(|e| {
        failed(
            e.to_string(),
            e.kind() == std::io::ErrorKind::PermissionDenied,
        )
    })?;
    let reply = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        read_handshake_frame(conn.reader.as_mut()),
    )
    .await
    .map_err(|_| failed("no handshake reply".into(), false))?
    .map_err(|e| match e {
        TransportError::Io(io) => failed(
            io.to_string(),
            io.kind() == std::io::ErrorKind::PermissionDenied,
        ),
        e => failed(e.to_string(), false),
    })?;
    match reply {
        Frame::Control(Body::HelloAck(ack)) if ack.node_name == peer => {
            if let Some(id) = identity {
                let refused = |reason: String| DialError::Refused {
                    peer: peer.clone(),
                    reason,
                };
                if ack.certificate.is_empty() {
                    return Err(refused("peer did not authenticate its tcp handshake (it runs without certificates, or --insecure)".into()));
                }
                let signed = transcript(Signer::Acceptor, &hello, &ack.node_name, &ack.nonce);
                id.verify_peer(&peer, &ack.certificate, &signed, &ack.signature)
                    .map_err(|e| refused(format!("tcp authentication: {e}")))?;
                let proof = id
                    .sign(&transcript(
                        Signer::Dialer,
                        &hello,
                        &ack.node_name,
                        &ack.nonce,
                    ))
                    .map_err(|e| refused(format!("cannot sign our tcp handshake: {e}")))?;
                let frame =
                    wire::encode_control(&wire::message(Body::HelloProof(pb::HelloProof {
                        signature: proof,
                    })));
                conn.writer
                    .write_control(&frame)
                    .await
                    .map_err(|e| unreachable(e.to_string()))?;
            }
            Ok((conn, ack))
        }
        Frame::Control(Body::HelloAck(ack)) => Err(DialError::Refused {
            peer: peer.clone(),
            reason: format!("answered as {:?}", ack.node_name),
        }),
        Frame::Control(Body::Abort(a)) => Err(DialError::Refused {
            peer: peer.clone(),
            reason: a.message,
        }),
        _ => Err(DialError::Refused {
            peer: peer.clone(),
            reason: "unexpected handshake reply".into(),
        }),
    }
}
