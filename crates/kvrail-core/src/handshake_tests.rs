//! The handshake's two sides joined in memory: every message goes through a
//! frame and back, and each side sees only what the other sent.

use std::collections::VecDeque;
use std::time::Instant;

use crate::handshake::*;
use crate::testkit::{run_handshake, FakeIdentity, HandshakeEnd};
use crate::wire::{pb, Body, PROTOCOL_VERSION};

fn hello() -> pb::Hello {
    pb::Hello {
        protocol_version: u32::from(PROTOCOL_VERSION),
        node_name: "prefill".into(),
        expected_peer: "decode".into(),
        session_id: 7,
        rail_index: 1,
        connection_index: 2,
        transports: vec!["rdma".into(), "tcp".into()],
        incarnation: 11,
        ..Default::default()
    }
}

/// One side's set-up: its identity (None: unauthenticated) and, for the
/// acceptor, the certificate TLS showed it (None: no TLS).
struct Setup {
    dialer_id: Option<FakeIdentity>,
    acceptor_id: Option<FakeIdentity>,
    tls_certificate_names: Option<String>,
    hello: pb::Hello,
    /// The nonce the acceptor draws.
    acceptor_nonce: Vec<u8>,
}

impl Setup {
    fn plain() -> Self {
        Setup {
            dialer_id: None,
            acceptor_id: None,
            tls_certificate_names: None,
            hello: hello(),
            acceptor_nonce: vec![0xa5; NONCE_BYTES],
        }
    }

    fn authenticated() -> Self {
        Setup {
            dialer_id: Some(FakeIdentity::new("prefill")),
            acceptor_id: Some(FakeIdentity::new("decode")),
            ..Setup::plain()
        }
    }

    fn run(&self) -> HandshakeEnd {
        self.run_tampered(&mut |_| {})
    }

    fn run_tampered(&self, tamper: &mut dyn FnMut(&mut Body)) -> HandshakeEnd {
        let now = Instant::now();
        let transports = vec!["tcp".to_string()];
        let known = |n: &str| n == "prefill";
        let tls = self.tls_certificate_names.clone();
        let tls_check = move |claimed: &str| match &tls {
            Some(n) if n == claimed => Ok(()),
            Some(n) => Err(format!("certificate names {n:?}")),
            None => Ok(()),
        };
        let mut acceptor = Acceptor::new(
            AcceptorConfig {
                node: "decode",
                rail_count: 2,
                transports: &transports,
                is_known_peer: &known,
                tls_name_check: self
                    .tls_certificate_names
                    .as_ref()
                    .map(|_| &tls_check as &NameCheck),
                credentials: self.acceptor_id.as_ref().map(|c| c as &dyn Credentials),
                nonce: self.acceptor_nonce.clone(),
                incarnation: 99,
                software: "test",
                admit: None,
            },
            now,
        );
        let (dialer, sent) = Dialer::start(
            self.hello.clone(),
            self.dialer_id.as_ref().map(|c| c as &dyn Credentials),
            vec![0x5a; NONCE_BYTES],
            now,
        );
        let mut wire = [VecDeque::new(), VecDeque::new()];
        run_handshake(&mut wire, &dialer, sent, &mut acceptor, now, tamper)
    }
}

#[test]
fn an_unauthenticated_handshake_agrees_on_rail_and_incarnations() {
    let end = Setup::plain().run();
    let dialed = end.dialer.unwrap();
    assert!(dialed.proof.is_none());
    assert_eq!(dialed.ack.node_name, "decode");
    assert_eq!(dialed.ack.rail_index, 1);
    assert_eq!(dialed.ack.rail_count, 2);
    assert_eq!(dialed.ack.incarnation, 99);
    assert_eq!(dialed.ack.transports, ["tcp"]);
    assert!(dialed.ack.certificate.is_empty() && dialed.ack.signature.is_empty());
    let accepted = end.acceptor.unwrap();
    assert_eq!(
        (
            accepted.session_id,
            accepted.connection_index,
            accepted.incarnation
        ),
        (7, 2, 11)
    );
}

#[test]
fn an_authenticated_handshake_proves_both_keys() {
    let end = Setup::authenticated().run();
    let dialed = end.dialer.unwrap();
    assert!(dialed.proof.is_some());
    assert_eq!(dialed.ack.nonce, vec![0xa5; NONCE_BYTES]);
    let accepted = end.acceptor.unwrap();
    assert_eq!(accepted.nonce, vec![0x5a; NONCE_BYTES]);
    assert_eq!(
        accepted.certificate,
        FakeIdentity::new("prefill").certificate()
    );
}

/// The acceptor's refusal, and that the dialer heard it as the same reason.
fn refused(end: HandshakeEnd) -> HandshakeError {
    let e = end.acceptor.unwrap_err();
    match (&end.dialer, end.acceptor_sent.last()) {
        (Err(DialRefusal::Aborted { message: m, .. }), Some(Body::Abort(a))) => {
            assert_eq!(m, &e.to_string());
            assert_eq!(a.message, e.to_string());
        }
        // A refused proof comes after the dialer is done: it learns on its first use.
        (Ok(_), _) if matches!(e, HandshakeError::Proof(_) | HandshakeError::NotProof) => {}
        other => panic!("dialer saw {other:?} for the acceptor's {e}"),
    }
    e
}

#[test]
fn the_acceptor_refuses_bad_hellos_saying_why() {
    let with = |change: fn(&mut pb::Hello)| {
        let mut s = Setup::plain();
        change(&mut s.hello);
        refused(s.run())
    };
    assert_eq!(
        with(|h| h.protocol_version = 9),
        HandshakeError::Version {
            theirs: 9,
            ours: u32::from(PROTOCOL_VERSION)
        }
    );
    assert_eq!(
        with(|h| h.node_name = "mallory".into()),
        HandshakeError::UnknownPeer("mallory".into())
    );
    assert!(matches!(
        with(|h| h.expected_peer = "other".into()),
        HandshakeError::WrongNode { .. }
    ));
    assert_eq!(
        with(|h| h.rail_index = 2),
        HandshakeError::UnknownRail { asked: 2, rails: 2 }
    );
    assert!(matches!(
        with(|h| h.transports = vec!["quic".into()]),
        HandshakeError::NoCommonTransport(_)
    ));
    // Oversized fields are refused before anything else is looked at. (A
    // hello over 64 KiB does not decode at all: `wire` refuses it first.)
    let e = with(|h| {
        h.node_name = "x".repeat(32 << 10);
        h.rail_index = 9;
    });
    assert_eq!(e.label(), "oversized");
    assert!(e.to_string().len() < 100);
}

#[test]
fn a_first_message_that_is_not_a_hello_is_refused() {
    let e = refused(Setup::plain().run_tampered(&mut |b| {
        if matches!(b, Body::Hello(_)) {
            *b = Body::HelloProof(pb::HelloProof::default());
        }
    }));
    assert_eq!(e, HandshakeError::NotHello);
}

#[test]
fn a_tls_certificate_must_name_the_node_the_hello_claims() {
    let mut s = Setup::plain();
    s.tls_certificate_names = Some("prefill".into());
    assert!(s.run().acceptor.is_ok());
    s.tls_certificate_names = Some("other".into());
    assert_eq!(refused(s.run()).label(), "certificate_name");
}

#[test]
fn authenticated_acceptors_refuse_missing_or_foreign_certificates() {
    // A dialer without an identity presents no certificate.
    let mut s = Setup::authenticated();
    s.dialer_id = None;
    assert_eq!(
        refused(s.run()),
        HandshakeError::NoCertificate("prefill".into())
    );
    // A certificate from another CA, or naming someone else.
    let mut s = Setup::authenticated();
    s.dialer_id.as_mut().unwrap().ca = 2;
    assert_eq!(refused(s.run()).label(), "certificate");
    let mut s = Setup::authenticated();
    s.dialer_id.as_mut().unwrap().node = "decode".into();
    assert_eq!(refused(s.run()).label(), "certificate");
    // A nonce of the wrong length.
    let e = refused(Setup::authenticated().run_tampered(&mut |b| {
        if let Body::Hello(h) = b {
            h.nonce.truncate(3);
        }
    }));
    assert_eq!(e, HandshakeError::Nonce(3));
}

#[test]
fn a_dialer_without_the_key_of_its_certificate_is_refused_at_the_proof() {
    // The right certificate, but a proof signed with another key.
    let e = refused(Setup::authenticated().run_tampered(&mut |b| {
        if let Body::HelloProof(p) = b {
            p.signature[0] ^= 1;
        }
    }));
    assert_eq!(e.label(), "proof");
    // A proof that is something else entirely.
    let e = refused(Setup::authenticated().run_tampered(&mut |b| {
        if matches!(b, Body::HelloProof(_)) {
            *b = Body::Hello(hello());
        }
    }));
    assert_eq!(e, HandshakeError::NotProof);
}

#[test]
fn a_proof_replayed_into_another_connection_is_refused() {
    // Record a good proof, then replay it where everything is the same but
    // the acceptor drew another nonce.
    let good = Setup::authenticated().run();
    let proof = good.dialer.unwrap().proof.unwrap();
    let mut fresh_nonce = Setup::authenticated();
    fresh_nonce.acceptor_nonce = vec![0x3c; NONCE_BYTES];
    assert!(
        fresh_nonce.run().acceptor.is_ok(),
        "the same set-up, unreplayed"
    );
    let e = refused(fresh_nonce.run_tampered(&mut |b| {
        if let Body::HelloProof(p) = b {
            *p = proof.clone();
        }
    }));
    assert_eq!(e.label(), "proof");
}

#[test]
fn the_dialer_refuses_answers_it_cannot_trust() {
    // The acceptor runs without an identity while we have one.
    let mut s = Setup::authenticated();
    s.acceptor_id = None;
    let end = s.run();
    assert_eq!(end.dialer.unwrap_err(), DialRefusal::NotAuthenticated);
    // The acceptor's certificate is from another CA.
    let mut s = Setup::authenticated();
    s.acceptor_id.as_mut().unwrap().ca = 3;
    assert!(matches!(
        s.run().dialer.unwrap_err(),
        DialRefusal::Authentication(_)
    ));
    // A forged signature (the acceptor's key is not its certificate's).
    // The same hello and dialer nonce as the run that made the ack.
    let ack = |change: fn(&mut pb::HelloAck)| {
        let now = Instant::now();
        let id = FakeIdentity::new("prefill");
        let (dialer, _) = Dialer::start(hello(), Some(&id), vec![0x5a; NONCE_BYTES], now);
        let mut a = Setup::authenticated().run().dialer.unwrap().ack;
        change(&mut a);
        dialer.on_message(Body::HelloAck(a))
    };
    assert!(ack(|_| {}).is_ok(), "the untouched ack is accepted");
    assert!(matches!(
        ack(|a| a.signature[0] ^= 1).unwrap_err(),
        DialRefusal::Authentication(_)
    ));
    assert_eq!(
        ack(|a| a.node_name = "other".into()).unwrap_err(),
        DialRefusal::AnsweredAs("other".into())
    );
    assert_eq!(
        ack(|a| a.protocol_version = 2).unwrap_err(),
        DialRefusal::Version(2)
    );
    let (dialer, _) = Dialer::start(hello(), None, Vec::new(), Instant::now());
    assert_eq!(
        dialer.on_message(Body::HelloProof(pb::HelloProof::default())),
        Err(DialRefusal::Unexpected)
    );
}

/// An acceptor of node "decode" on one rail, offering TCP to any peer, with
/// no identity and no TLS.
fn plain_acceptor_config<'a>(
    transports: &'a [String],
    known: &'a (dyn Fn(&str) -> bool + Sync),
) -> AcceptorConfig<'a> {
    AcceptorConfig {
        node: "decode",
        rail_count: 1,
        transports,
        is_known_peer: known,
        tls_name_check: None,
        credentials: None,
        nonce: Vec::new(),
        incarnation: 1,
        software: "test",
        admit: None,
    }
}

#[test]
fn silence_ends_each_side_at_its_deadline() {
    let now = Instant::now();
    let (dialer, _) = Dialer::start(hello(), None, Vec::new(), now);
    assert_eq!(dialer.deadline(), now + HANDSHAKE_TIMEOUT);
    let transports = vec!["tcp".to_string()];
    let known = |_: &str| true;
    let id = FakeIdentity::new("decode");
    let mut acceptor = Acceptor::new(
        AcceptorConfig {
            rail_count: 2,
            credentials: Some(&id),
            nonce: vec![0; NONCE_BYTES],
            ..plain_acceptor_config(&transports, &known)
        },
        now,
    );
    assert_eq!(acceptor.deadline(), now + HANDSHAKE_TIMEOUT);
    // The hello came late but in time; the proof's deadline starts at the answer.
    let later = now + HANDSHAKE_TIMEOUT / 2;
    let dialer_id = FakeIdentity::new("prefill");
    let (_, sent) = Dialer::start(hello(), Some(&dialer_id), vec![1; NONCE_BYTES], later);
    let step = acceptor.on_message(Ok(Body::Hello(sent)), later);
    assert!(matches!(step, AcceptorStep::AnswerThenAwaitProof(_)));
    // A slow write of the ack: the proof's time starts once it is written.
    let written = later + HANDSHAKE_TIMEOUT / 4;
    acceptor.answered(written);
    assert_eq!(acceptor.deadline(), written + HANDSHAKE_TIMEOUT);
    match acceptor.on_timeout() {
        AcceptorStep::Refuse(e) => {
            assert_eq!(e, HandshakeError::Timeout("tcp handshake proof"));
            assert_eq!(e.label(), "timeout");
        }
        other => panic!("{other:?}"),
    }
    // Nothing more is taken once it ended.
    assert!(matches!(
        acceptor.on_message(Ok(Body::HelloProof(pb::HelloProof::default())), later),
        AcceptorStep::Refuse(HandshakeError::Malformed(_))
    ));
}

#[test]
fn a_data_frame_in_place_of_a_handshake_message_is_refused_as_such() {
    let transports = vec!["tcp".to_string()];
    let known = |_: &str| true;
    let mut acceptor = Acceptor::new(plain_acceptor_config(&transports, &known), Instant::now());
    match acceptor.on_data_frame() {
        AcceptorStep::Refuse(e) => assert_eq!(e.label(), "not_hello"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_undecodable_message_is_refused_as_malformed() {
    let now = Instant::now();
    let transports = vec!["tcp".to_string()];
    let known = |_: &str| true;
    let mut acceptor = Acceptor::new(plain_acceptor_config(&transports, &known), now);
    match acceptor.on_message(Err("bad varint".into()), now) {
        AcceptorStep::Refuse(e) => assert_eq!(e.label(), "malformed"),
        other => panic!("{other:?}"),
    }
}

/// The session cap is decided before the ack: a node holding `max` sessions
/// here that all carry transfers has its next session refused (the dialer
/// hears why, with the code), an idle one gives way, a session it holds
/// already is joined, and sessions of an earlier process of the node give
/// way to its new one (whose own are never confused with them).
#[test]
fn the_session_cap_is_decided_before_anything_is_answered() {
    let now = Instant::now();
    let held = |id, incarnation, active| HeldSession {
        session_id: id,
        incarnation,
        active_transfers: active,
        created: now + std::time::Duration::from_secs(id),
    };
    let busy: Vec<HeldSession> = (1..=8).map(|id| held(id, 5, 1)).collect();
    assert_eq!(
        admit_session("prefill", 3, 5, &busy, &[], 8),
        SessionAdmission::Join
    );
    let SessionAdmission::Refuse(e) = admit_session("prefill", 9, 5, &busy, &[], 8) else {
        panic!("a ninth busy session must be refused")
    };
    assert_eq!(e.code(), crate::wire::ErrorCode::TooManySessions);
    assert!(e.to_string().contains("8 sessions"), "{e}");
    let mut one_idle = busy.clone();
    one_idle[5].active_transfers = 0;
    one_idle[2].active_transfers = 0;
    assert_eq!(
        admit_session("prefill", 9, 5, &one_idle, &[], 8),
        SessionAdmission::New { replace: vec![3] },
        "the oldest idle one gives way"
    );
    // A new process of the node: all eight of the old one's go, busy or not.
    assert_eq!(
        admit_session("prefill", 9, 6, &busy, &[], 8),
        SessionAdmission::New {
            replace: (1..=8).collect()
        }
    );
    // Incarnation 0 (an older peer) neither replaces nor is replaced.
    assert!(matches!(
        admit_session("prefill", 9, 0, &busy, &[], 8),
        SessionAdmission::Refuse(_)
    ));
    // A replaced process cannot come back and evict its successor.
    assert!(matches!(
        admit_session("prefill", 10, 5, &[held(9, 6, 1)], &[5], 8),
        SessionAdmission::Refuse(HandshakeError::Superseded { .. })
    ));

    // Through the acceptor: the refusal is the answer, no ack is sent.
    let transports = vec!["tcp".to_string()];
    let known = |_: &str| true;
    let admit = |h: &pb::Hello| match admit_session(
        &h.node_name,
        h.session_id,
        h.incarnation,
        &busy,
        &[],
        8,
    ) {
        SessionAdmission::Refuse(e) => Err(e),
        _ => Ok(()),
    };
    let mut acceptor = Acceptor::new(
        AcceptorConfig {
            rail_count: 2,
            admit: Some(&admit),
            ..plain_acceptor_config(&transports, &known)
        },
        now,
    );
    let mut wire = [VecDeque::new(), VecDeque::new()];
    let ninth = pb::Hello {
        session_id: 99,
        incarnation: 5,
        ..hello()
    };
    let (dialer, sent) = Dialer::start(ninth, None, Vec::new(), now);
    let end = run_handshake(&mut wire, &dialer, sent, &mut acceptor, now, &mut |_| {});
    assert!(matches!(
        end.acceptor,
        Err(HandshakeError::TooManySessions { .. })
    ));
    assert!(end
        .acceptor_sent
        .iter()
        .all(|b| !matches!(b, Body::HelloAck(_))));
    match end.dialer {
        Err(DialRefusal::Aborted { code, message }) => {
            assert_eq!(code, crate::wire::ErrorCode::TooManySessions);
            assert!(message.contains("sessions"), "{message}");
        }
        other => panic!("the dialer must hear the refusal: {other:?}"),
    }
}

/// An ack with fields no real one has (a software string of escape
/// sequences for `kvrail doctor`'s table) is refused by the dialer.
#[test]
fn an_oversized_ack_is_refused_by_the_dialer() {
    let (dialer, _) = Dialer::start(hello(), None, Vec::new(), Instant::now());
    let ack = |software: String| pb::HelloAck {
        protocol_version: u32::from(PROTOCOL_VERSION),
        node_name: "decode".into(),
        transports: vec!["tcp".into()],
        software,
        ..Default::default()
    };
    assert!(dialer
        .on_message(Body::HelloAck(ack("kvrail 1".into())))
        .is_ok());
    let forged = "\u{1b}[2K\rOK all good".repeat(8);
    assert!(matches!(
        dialer.on_message(Body::HelloAck(ack(forged))),
        Err(DialRefusal::Oversized(_))
    ));
}
