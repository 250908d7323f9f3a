//! The versioned handshake every peer connection starts with, sans-IO.
//!
//! The dialer sends a `Hello`; the acceptor checks it and answers with a
//! `HelloAck` or refuses with an `Abort`. Over TCP between nodes with identities
//! both sides also prove they hold their certificate's key: the acceptor signs
//! both nonces in its ack, the dialer checks that and answers with a
//! `HelloProof`, which the acceptor checks before the connection joins a
//! session. [`Dialer`] and [`Acceptor`] make every decision of that sequence,
//! with `now` passed in; the sidecar moves their messages, draws the nonces,
//! and does the signing through [`Credentials`].

use std::time::{Duration, Instant};

use crate::wire::{pb, Body, PROTOCOL_VERSION};

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
    #[error("rail {asked} does not exist here (this node has {rails} rails)")]
    UnknownRail { asked: u32, rails: u32 },
    /// The TLS certificate the connection came with names another node.
    #[error("peer says it is {node:?} but its {why}")]
    CertificateName { node: String, why: String },
    #[error("peer {0:?} presented no certificate on tcp (it runs without tls_dir, or --insecure)")]
    NoCertificate(String),
    #[error("tcp handshake nonce of {0} bytes")]
    Nonce(usize),
    #[error("{0}")]
    Certificate(String),
    #[error("expected the tcp handshake proof")]
    NotProof,
    #[error("tcp handshake proof: {0}")]
    Proof(String),
    #[error("no {0} in time")]
    Timeout(&'static str),
    #[error("malformed handshake message: {0}")]
    Malformed(String),
    /// Our side could not sign its answer (our key; not the peer's fault).
    #[error("this node cannot sign its tcp handshake: {0}")]
    CannotSign(String),
    /// A field is longer than any real hello carries (checked before anything
    /// of the hello is looked up, logged or echoed).
    #[error("hello field {field} is {len} long, at most {max} allowed")]
    Oversized {
        field: &'static str,
        len: usize,
        max: usize,
    },
    /// The node holds as many sessions here as it may, each carrying
    /// transfers (decided before anything is answered).
    #[error("{node} already has {sessions} sessions carrying transfers here (at most {max})")]
    TooManySessions {
        node: String,
        sessions: usize,
        max: usize,
    },
    /// A session of a process of the node that a newer one has replaced.
    #[error(
        "{node}'s process {incarnation:#x} was replaced by a newer one: its sessions are refused"
    )]
    Superseded { node: String, incarnation: u64 },
    /// Membership (or a pinned certificate) names another process or
    /// certificate for this node (decided before anything is answered).
    #[error("{node}: {why}")]
    NotRegistered { node: String, why: String },
}

impl HandshakeError {
    /// The refusal's metric label (a fixed set).
    pub fn label(&self) -> &'static str {
        match self {
            HandshakeError::Version { .. } => "version",
            HandshakeError::UnknownPeer(_) => "unknown_peer",
            HandshakeError::WrongNode { .. } => "wrong_node",
            HandshakeError::NoCommonTransport(_) => "no_common_transport",
            HandshakeError::NotHello => "not_hello",
            HandshakeError::Oversized { .. } => "oversized",
            HandshakeError::UnknownRail { .. } => "unknown_rail",
            HandshakeError::CertificateName { .. } => "certificate_name",
            HandshakeError::NoCertificate(_) => "no_certificate",
            HandshakeError::Nonce(_) | HandshakeError::NotProof | HandshakeError::Malformed(_) => {
                "malformed"
            }
            HandshakeError::Certificate(_) => "certificate",
            HandshakeError::Proof(_) => "proof",
            HandshakeError::Timeout(_) => "timeout",
            HandshakeError::CannotSign(_) => "internal",
            HandshakeError::TooManySessions { .. } => "too_many_sessions",
            HandshakeError::Superseded { .. } => "superseded",
            HandshakeError::NotRegistered { .. } => "not_registered",
        }
    }

    /// The code the refusal's `Abort` carries.
    pub fn code(&self) -> crate::wire::ErrorCode {
        match self {
            HandshakeError::TooManySessions { .. } => crate::wire::ErrorCode::TooManySessions,
            _ => crate::wire::ErrorCode::Protocol,
        }
    }
}

/// A session a node already holds here, as the session cap sees it.
#[derive(Debug, Clone)]
pub struct HeldSession {
    pub session_id: u64,
    /// The dialing process's incarnation (0: not sent).
    pub incarnation: u64,
    pub active_transfers: usize,
    pub created: Instant,
}

/// What becomes of a hello's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionAdmission {
    /// The node holds that session already: the connection joins it.
    Join,
    /// A new session, once the sessions named here are closed: those of an
    /// earlier process of the node (it restarted: they can never resume),
    /// and, at the cap, the oldest with nothing in flight.
    New {
        replace: Vec<u64>,
    },
    Refuse(HandshakeError),
}

/// The inbound session cap, decided from the hello before it is answered:
/// a node holds at most `max` sessions here. `retired` lists incarnations of
/// the node that newer ones replaced (their new sessions are refused, so two
/// live processes of one name cannot evict each other for ever). An
/// incarnation of 0 (an older peer) neither replaces nor is replaced.
pub fn admit_session(
    node: &str,
    session_id: u64,
    incarnation: u64,
    held: &[HeldSession],
    retired: &[u64],
    max: usize,
) -> SessionAdmission {
    if held.iter().any(|s| s.session_id == session_id) {
        return SessionAdmission::Join;
    }
    if incarnation != 0 && retired.contains(&incarnation) {
        return SessionAdmission::Refuse(HandshakeError::Superseded {
            node: node.to_string(),
            incarnation,
        });
    }
    let stale =
        |s: &&HeldSession| incarnation != 0 && s.incarnation != 0 && s.incarnation != incarnation;
    let mut replace: Vec<u64> = held.iter().filter(stale).map(|s| s.session_id).collect();
    let current: Vec<&HeldSession> = held.iter().filter(|s| !stale(s)).collect();
    if current.len() >= max {
        // The oldest session with nothing in flight gives way; only
        // sessions all carrying transfers refuse the new one.
        match current
            .iter()
            .filter(|s| s.active_transfers == 0)
            .min_by_key(|s| s.created)
        {
            Some(idle) => replace.push(idle.session_id),
            None => {
                return SessionAdmission::Refuse(HandshakeError::TooManySessions {
                    node: node.to_string(),
                    sessions: current.len(),
                    max,
                })
            }
        }
    }
    SessionAdmission::New { replace }
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

/// Size checks of every variable-length field of an ack (its software
/// string is shown in `kvrail doctor`, its transports chosen from).
pub fn check_ack_sizes(ack: &pb::HelloAck) -> Result<(), HandshakeError> {
    let check = |field, len: usize, max| {
        if len > max {
            Err(HandshakeError::Oversized { field, len, max })
        } else {
            Ok(())
        }
    };
    check("node_name", ack.node_name.len(), MAX_NODE_NAME_BYTES)?;
    check("transports", ack.transports.len(), MAX_TRANSPORTS)?;
    for t in &ack.transports {
        check("transport name", t.len(), MAX_TRANSPORT_NAME_BYTES)?;
    }
    check("certificate", ack.certificate.len(), MAX_CERTIFICATE_BYTES)?;
    check("nonce", ack.nonce.len(), NONCE_BYTES)?;
    check("software", ack.software.len(), MAX_SOFTWARE_BYTES)?;
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

/// How long either side waits for the other's next handshake message.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the authenticated TCP handshake needs of this node's identity (the
/// sidecar's `kvrail_auth::Identity`; a fake in the tests).
/// `Sync`: drivers hold it across awaits on multi-threaded runtimes.
pub trait Credentials: Sync {
    /// Our certificate (DER), sent to the peer.
    fn certificate(&self) -> Vec<u8>;
    /// Our signature over `message`.
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, String>;
    /// That `certificate` chains to our CA, is valid now and names `peer`.
    fn verify_certificate(&self, peer: &str, certificate: &[u8]) -> Result<(), String>;
    /// That the key of `certificate` (already verified) made `signature` over `message`.
    fn verify_signature(
        &self,
        peer: &str,
        certificate: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), String>;
}

/// Decides from the dialer's hello whether one more session may start.
pub type AdmitSession<'a> = dyn Fn(&pb::Hello) -> Result<(), HandshakeError> + Sync + 'a;

/// Given the node name a hello claims, why the connection's TLS certificate
/// does not name it.
pub type NameCheck<'a> = dyn Fn(&str) -> Result<(), String> + Sync + 'a;

/// The accepting side's view of itself.
pub struct AcceptorConfig<'a> {
    /// This node's name.
    pub node: &'a str,
    /// Rails this node listens on.
    pub rail_count: u32,
    /// Transports we offer, best first.
    pub transports: &'a [String],
    /// Whether a dialer of that name is a configured peer.
    pub is_known_peer: &'a (dyn Fn(&str) -> bool + Sync),
    /// The connection's TLS peer certificate (QUIC, TLS over TCP): it must name
    /// the node the hello claims to be. Given the claimed name, why not.
    pub tls_name_check: Option<&'a NameCheck<'a>>,
    /// With an identity (authenticated TCP) the dialer must prove its certificate.
    pub credentials: Option<&'a dyn Credentials>,
    /// Our nonce (drawn by the caller; [`NONCE_BYTES`] random bytes).
    pub nonce: Vec<u8>,
    /// Random per start of this process.
    pub incarnation: u64,
    /// Our kvrail release.
    pub software: &'a str,
    /// The session cap ([`admit_session`]), asked before the ack is made: a
    /// refusal is the answer, instead of an ack followed by a close.
    pub admit: Option<&'a AdmitSession<'a>>,
}

/// What the acceptor's driver does next.
#[derive(Debug)]
pub enum AcceptorStep {
    /// Write this ack (its `rail_mtu` is the driver's to fill in, from the
    /// interface the connection arrived on), then hand the next message to
    /// [`Acceptor::on_message`] before [`Acceptor::deadline`].
    AnswerThenAwaitProof(pb::HelloAck),
    /// Write this ack; the handshake is done.
    AnswerAndAccept(pb::HelloAck, pb::Hello),
    /// The dialer's proof checked out; the handshake is done.
    Accept(pb::Hello),
    /// Send an `Abort` saying why, and close.
    Refuse(HandshakeError),
}

enum AcceptorState {
    AwaitHello,
    AwaitProof { hello: Box<pb::Hello> },
    Finished,
}

/// The accepting side of one connection's handshake.
pub struct Acceptor<'a> {
    config: AcceptorConfig<'a>,
    state: AcceptorState,
    deadline: Instant,
}

impl<'a> Acceptor<'a> {
    /// A connection just accepted at `now`: its hello is due by [`Self::deadline`].
    pub fn new(config: AcceptorConfig<'a>, now: Instant) -> Self {
        Acceptor {
            config,
            state: AcceptorState::AwaitHello,
            deadline: now + HANDSHAKE_TIMEOUT,
        }
    }

    /// When the message awaited is due.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The driver finished writing the ack at `now`: the dialer's proof is
    /// due [`HANDSHAKE_TIMEOUT`] from here (a slow write does not eat into it).
    pub fn answered(&mut self, now: Instant) {
        if matches!(self.state, AcceptorState::AwaitProof { .. }) {
            self.deadline = now + HANDSHAKE_TIMEOUT;
        }
    }

    /// A frame that is not a control message (a slice) came where a
    /// handshake message was due.
    pub fn on_data_frame(&mut self) -> AcceptorStep {
        let e = match self.state {
            AcceptorState::AwaitProof { .. } => HandshakeError::NotProof,
            _ => HandshakeError::NotHello,
        };
        self.state = AcceptorState::Finished;
        AcceptorStep::Refuse(e)
    }

    /// The awaited message did not come by the deadline.
    pub fn on_timeout(&mut self) -> AcceptorStep {
        let what = match self.state {
            AcceptorState::AwaitProof { .. } => "tcp handshake proof",
            _ => "hello",
        };
        self.state = AcceptorState::Finished;
        AcceptorStep::Refuse(HandshakeError::Timeout(what))
    }

    /// A message arrived (`Err`: it could not be decoded, saying why).
    pub fn on_message(&mut self, message: Result<Body, String>, now: Instant) -> AcceptorStep {
        let state = std::mem::replace(&mut self.state, AcceptorState::Finished);
        let refuse = AcceptorStep::Refuse;
        let message = match message {
            Ok(m) => m,
            Err(why) => return refuse(HandshakeError::Malformed(why)),
        };
        match state {
            AcceptorState::AwaitHello => {
                let Body::Hello(hello) = message else {
                    return refuse(HandshakeError::NotHello);
                };
                match self.answer(&hello) {
                    Err(e) => refuse(e),
                    Ok(ack) if self.config.credentials.is_some() => {
                        self.state = AcceptorState::AwaitProof {
                            hello: Box::new(hello),
                        };
                        self.deadline = now + HANDSHAKE_TIMEOUT;
                        AcceptorStep::AnswerThenAwaitProof(ack)
                    }
                    Ok(ack) => AcceptorStep::AnswerAndAccept(ack, hello),
                }
            }
            AcceptorState::AwaitProof { hello } => {
                let Body::HelloProof(proof) = message else {
                    return refuse(HandshakeError::NotProof);
                };
                let Some(id) = self.config.credentials else {
                    return refuse(HandshakeError::NotProof);
                };
                // The certificate itself was checked before we answered.
                let signed =
                    transcript(Signer::Dialer, &hello, self.config.node, &self.config.nonce);
                match id.verify_signature(
                    &hello.node_name,
                    &hello.certificate,
                    &signed,
                    &proof.signature,
                ) {
                    Ok(()) => AcceptorStep::Accept(*hello),
                    Err(e) => refuse(HandshakeError::Proof(e)),
                }
            }
            AcceptorState::Finished => refuse(HandshakeError::Malformed(
                "a message after the handshake ended".into(),
            )),
        }
    }

    /// Every check of a hello, in the order that keeps a hostile one cheap: its
    /// sizes first, then what it claims, then its certificate; the ack.
    fn answer(&self, hello: &pb::Hello) -> Result<pb::HelloAck, HandshakeError> {
        let c = &self.config;
        check_hello_sizes(hello)?;
        if hello.rail_index >= c.rail_count {
            return Err(HandshakeError::UnknownRail {
                asked: hello.rail_index,
                rails: c.rail_count,
            });
        }
        if let Some(check) = c.tls_name_check {
            check(&hello.node_name).map_err(|why| HandshakeError::CertificateName {
                node: hello.node_name.clone(),
                why,
            })?;
        }
        let ours: Vec<&str> = c.transports.iter().map(String::as_str).collect();
        check_hello(hello, c.node, c.is_known_peer, &ours)?;
        if let Some(admit) = c.admit {
            admit(hello)?;
        }
        let mut ack = pb::HelloAck {
            protocol_version: u32::from(PROTOCOL_VERSION),
            node_name: c.node.to_string(),
            transports: c.transports.to_vec(),
            rail_count: c.rail_count,
            rail_index: hello.rail_index,
            software: c.software.to_string(),
            incarnation: c.incarnation,
            ..Default::default()
        };
        if let Some(id) = c.credentials {
            if hello.certificate.is_empty() {
                return Err(HandshakeError::NoCertificate(hello.node_name.clone()));
            }
            if hello.nonce.len() != NONCE_BYTES {
                return Err(HandshakeError::Nonce(hello.nonce.len()));
            }
            id.verify_certificate(&hello.node_name, &hello.certificate)
                .map_err(HandshakeError::Certificate)?;
            ack.certificate = id.certificate();
            ack.nonce = c.nonce.clone();
            ack.signature = id
                .sign(&transcript(Signer::Acceptor, hello, c.node, &ack.nonce))
                .map_err(HandshakeError::CannotSign)?;
        }
        Ok(ack)
    }
}

/// Why the dialer gives up on a handshake the acceptor answered (or did not).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DialRefusal {
    #[error("answered as {0:?}")]
    AnsweredAs(String),
    #[error("{message}")]
    Aborted {
        code: crate::wire::ErrorCode,
        message: String,
    },
    /// The ack carries a field longer than any real one.
    #[error("the answer's {0}")]
    Oversized(HandshakeError),
    #[error("unexpected handshake reply")]
    Unexpected,
    #[error("peer speaks protocol version {0}, this sidecar speaks {PROTOCOL_VERSION}")]
    Version(u32),
    #[error(
        "peer did not authenticate its tcp handshake (it runs without certificates, or --insecure)"
    )]
    NotAuthenticated,
    #[error("tcp authentication: {0}")]
    Authentication(String),
    #[error("cannot sign our tcp handshake: {0}")]
    CannotSign(String),
    #[error("no handshake reply")]
    Timeout,
}

/// The dialer's handshake was answered: the ack, and (authenticated TCP) the
/// proof to send before the connection carries anything else.
#[derive(Debug, PartialEq)]
pub struct Dialed {
    pub ack: pb::HelloAck,
    pub proof: Option<pb::HelloProof>,
}

/// The dialing side of one connection's handshake.
pub struct Dialer<'a> {
    hello: pb::Hello,
    credentials: Option<&'a dyn Credentials>,
    deadline: Instant,
}

impl<'a> Dialer<'a> {
    /// Starts at `now` with our `hello` (its `expected_peer` names whom we
    /// dial); with `credentials` (authenticated TCP) our certificate and
    /// `nonce` go into it. The hello to send.
    pub fn start(
        mut hello: pb::Hello,
        credentials: Option<&'a dyn Credentials>,
        nonce: Vec<u8>,
        now: Instant,
    ) -> (Self, pb::Hello) {
        if let Some(id) = credentials {
            hello.certificate = id.certificate();
            hello.nonce = nonce;
        }
        let sent = hello.clone();
        let dialer = Dialer {
            hello,
            credentials,
            deadline: now + HANDSHAKE_TIMEOUT,
        };
        (dialer, sent)
    }

    /// When the acceptor's answer is due ([`DialRefusal::Timeout`] after).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The acceptor's answer.
    pub fn on_message(&self, message: Body) -> Result<Dialed, DialRefusal> {
        let peer = &self.hello.expected_peer;
        let ack = match message {
            Body::HelloAck(ack) if &ack.node_name == peer => ack,
            Body::HelloAck(ack) => return Err(DialRefusal::AnsweredAs(ack.node_name)),
            Body::Abort(a) => {
                return Err(DialRefusal::Aborted {
                    code: crate::wire::ErrorCode::try_from(a.code)
                        .unwrap_or(crate::wire::ErrorCode::Unspecified),
                    // Bounded: it is shown to workers and in `kvrail doctor`.
                    message: crate::wire::peer_text(a.message),
                });
            }
            _ => return Err(DialRefusal::Unexpected),
        };
        if ack.protocol_version != u32::from(PROTOCOL_VERSION) {
            return Err(DialRefusal::Version(ack.protocol_version));
        }
        check_ack_sizes(&ack).map_err(DialRefusal::Oversized)?;
        let Some(id) = self.credentials else {
            return Ok(Dialed { ack, proof: None });
        };
        if ack.certificate.is_empty() {
            return Err(DialRefusal::NotAuthenticated);
        }
        let signed = transcript(Signer::Acceptor, &self.hello, &ack.node_name, &ack.nonce);
        id.verify_certificate(peer, &ack.certificate)
            .and_then(|()| id.verify_signature(peer, &ack.certificate, &signed, &ack.signature))
            .map_err(DialRefusal::Authentication)?;
        let signature = id
            .sign(&transcript(
                Signer::Dialer,
                &self.hello,
                &ack.node_name,
                &ack.nonce,
            ))
            .map_err(DialRefusal::CannotSign)?;
        Ok(Dialed {
            ack,
            proof: Some(pb::HelloProof { signature }),
        })
    }
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
