//! Pieces shared by the in-memory session tests: regions as plain byte vectors.

use std::collections::HashMap;

pub mod net;

use std::time::Instant;

use crate::layout::RegionLayout;
use crate::placement::{Admission, ConnPlacer};
use crate::plan::BlockSelection;
use crate::session::{ConnId, RegionAccess, RegionDirectory, Session, SliceDisposition, Transmit};
use crate::wire::{pb, Body, SliceHeader};

/// What a test wire carries: a control message, or a slice with its payload.
// Test wires hold a few items at a time: boxing the control body would only
// add noise to every match in the simulators.
#[allow(clippy::large_enum_variant)]
pub enum Item {
    Control(Body),
    Slice(SliceHeader, Vec<u8>),
}

pub struct Region {
    pub layout: RegionLayout,
    pub bytes: Vec<u8>,
    pub exposed: bool,
    /// One-sided keys the region grants (none: two-sided only).
    pub keys: Vec<pb::MemoryKey>,
    /// Each block's generation (1 until released).
    pub generations: Vec<u64>,
    /// Its bytes are staged (GPU memory, `RegionAccess::staged`).
    pub staged: bool,
}

#[derive(Default)]
pub struct Regions(pub HashMap<u64, Region>);

impl Regions {
    /// A region filled with [`pattern`] (a source) or zeros (a destination).
    pub fn add(&mut self, id: u64, layout: RegionLayout, fill: bool, exposed: bool) {
        let len = layout.extent() as usize;
        let bytes = if fill { pattern(id, len) } else { vec![0; len] };
        self.0.insert(
            id,
            Region {
                layout,
                bytes,
                exposed,
                keys: Vec::new(),
                generations: vec![1; layout.num_blocks as usize],
                staged: false,
            },
        );
    }

    /// The worker released `blocks`: their generations move on.
    pub fn release(&mut self, id: u64, blocks: &[u32]) {
        let r = self.0.get_mut(&id).unwrap();
        for &b in blocks {
            r.generations[b as usize] += 1;
        }
    }

    /// Lets peers reach region `id` one-sided on `rails` (offsets are addresses, rkey = id).
    pub fn grant_rails(&mut self, id: u64, rails: &[u32]) {
        let r = self.0.get_mut(&id).unwrap();
        r.keys = rails
            .iter()
            .map(|&rail| pb::MemoryKey {
                rail_index: rail,
                addr: 0,
                length: r.bytes.len() as u64,
                rkey: id as u32,
            })
            .collect();
    }

    /// A transmit as it goes on the wire: its connection, and the item with the
    /// slice's pieces gathered from the source region.
    pub fn wire_item(&self, t: Transmit) -> (ConnId, Item) {
        match t {
            Transmit::Control { conn, msg } => (conn, Item::Control(msg.body.unwrap())),
            Transmit::Slice {
                conn,
                header,
                len,
                region_id,
                pieces,
                ..
            } => {
                let data = gather(&self.0[&region_id].bytes, &pieces);
                assert_eq!(data.len(), len as usize);
                (conn, Item::Slice(header, data))
            }
        }
    }
}

/// The bytes of `pieces` (offset, len) of `src`, in order.
pub fn gather(src: &[u8], pieces: &[(u64, u64)]) -> Vec<u8> {
    let mut data = Vec::new();
    for &(off, l) in pieces {
        data.extend_from_slice(&src[off as usize..(off + l) as usize]);
    }
    data
}

/// Writes `data` into `pieces` of `dst`, in order; the lengths must match.
pub fn scatter(dst: &mut [u8], pieces: &[(u64, u64)], data: &[u8]) {
    let mut cursor = 0usize;
    for &(off, l) in pieces {
        dst[off as usize..(off + l) as usize].copy_from_slice(&data[cursor..cursor + l as usize]);
        cursor += l as usize;
    }
    assert_eq!(cursor, data.len());
}

/// As [`deliver`], the way the sidecar's readers place slices: through their
/// transfer's gate, without the session, merged into it once the connection
/// has no further input at hand (`more_input`) or enough wait; the session
/// decides the rest (unknown, finished or failing transfers, slices outside one).
/// True if the item was a slice its gate admitted.
pub fn deliver_through_gates(
    session: &mut Session,
    regions: &mut Regions,
    placer: &mut ConnPlacer,
    conn: ConnId,
    item: Item,
    more_input: bool,
    now: Instant,
) -> bool {
    let Item::Slice(header, data) = item else {
        // Control in order after the slices before it.
        session.merge_placed(Some(conn), placer.take_placed(), now);
        deliver(session, regions, conn, item, now);
        return false;
    };
    let len = data.len() as u32;
    let id = header.transfer_id;
    let mut admission = placer.admit(header, len);
    if matches!(admission, Admission::AskSession) && !placer.knows(id) {
        placer.learn(id, session.placement_gate(id));
        admission = placer.admit(header, len);
    }
    let admitted = match admission {
        Admission::Place(slice) => {
            let region = regions.0.get_mut(&slice.region_id()).unwrap();
            scatter(&mut region.bytes, &slice.pieces, &data);
            placer.placed(slice);
            true
        }
        Admission::AskSession => {
            session.merge_placed(Some(conn), placer.take_placed(), now);
            deliver(session, regions, conn, Item::Slice(header, data), now);
            false
        }
    };
    if placer.should_merge(more_input) {
        session.merge_placed(Some(conn), placer.take_placed(), now);
    }
    admitted
}

/// Hands an item that arrived on `conn` to `session`, as a driver does: control
/// messages go in, slice payloads are scattered where the session says.
pub fn deliver(
    session: &mut Session,
    regions: &mut Regions,
    conn: ConnId,
    item: Item,
    now: Instant,
) {
    match item {
        Item::Control(body) => session.handle_control(conn, body, now, regions),
        Item::Slice(header, data) => {
            let len = data.len() as u32;
            if let SliceDisposition::Place { region_id, pieces } =
                session.accept_slice(conn, header, len, now)
            {
                scatter(
                    &mut regions.0.get_mut(&region_id).unwrap().bytes,
                    &pieces,
                    &data,
                );
                session.slice_placed(conn, header, len, now);
            }
        }
    }
}

impl RegionDirectory for Regions {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        self.0.get(&region_id).map(|r| RegionAccess {
            layout: r.layout,
            exposed: r.exposed,
            keys: r.keys.clone(),
            staged: r.staged,
            geometry: None,
        })
    }

    fn check_generations(&self, selection: &BlockSelection) -> Result<(), String> {
        let Some(r) = self.0.get(&selection.region_id) else {
            return Ok(());
        };
        selection.check_generations(|b| r.generations.get(b as usize).copied())
    }
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7) % 251) as u8 + 1)
        .collect()
}

pub fn sel(region: u64, layers: (u32, u32), blocks: &[u32]) -> BlockSelection {
    BlockSelection {
        region_id: region,
        layer_start: layers.0,
        layer_count: layers.1,
        block_ids: blocks.to_vec(),
        generations: Vec::new(),
        slice: None,
        first_token: 0,
    }
}

/// A node identity for handshake tests: a certificate names its node, the CA
/// that issued it and its key; a signature is the key and a digest of the message.
#[derive(Clone)]
pub struct FakeIdentity {
    pub node: String,
    /// The CA that issued our certificate.
    pub ca: u8,
    /// The CA whose certificates we accept.
    pub trusts: u8,
    pub key: u8,
}

impl FakeIdentity {
    pub fn new(node: &str) -> Self {
        FakeIdentity {
            node: node.into(),
            ca: 1,
            trusts: 1,
            key: node.len() as u8,
        }
    }

    fn digest(key: u8, message: &[u8]) -> Vec<u8> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        message.hash(&mut h);
        let mut s = vec![key];
        s.extend_from_slice(&h.finish().to_be_bytes());
        s
    }

    fn parse(cert: &[u8]) -> Option<(u8, String, u8)> {
        let (&ca, rest) = cert.split_first()?;
        let (&key, name) = rest.split_last()?;
        Some((ca, String::from_utf8(name.to_vec()).ok()?, key))
    }
}

impl crate::handshake::Credentials for FakeIdentity {
    fn certificate(&self) -> Vec<u8> {
        let mut c = vec![self.ca];
        c.extend_from_slice(self.node.as_bytes());
        c.push(self.key);
        c
    }
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, String> {
        Ok(Self::digest(self.key, message))
    }
    fn verify_certificate(&self, peer: &str, certificate: &[u8]) -> Result<(), String> {
        match Self::parse(certificate) {
            Some((ca, _, _)) if ca != self.trusts => Err("certificate from another CA".into()),
            Some((_, name, _)) if name != peer => Err(format!("certificate names {name:?}")),
            Some(_) => Ok(()),
            None => Err("not a certificate".into()),
        }
    }
    fn verify_signature(
        &self,
        _peer: &str,
        certificate: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), String> {
        let (_, _, key) = Self::parse(certificate).ok_or("not a certificate")?;
        if signature == Self::digest(key, message) {
            Ok(())
        } else {
            Err("signature does not match its certificate".into())
        }
    }
}

/// Where a handshake run over an in-memory wire ended, on each side.
pub struct HandshakeEnd {
    pub dialer: Result<crate::handshake::Dialed, crate::handshake::DialRefusal>,
    pub acceptor: Result<pb::Hello, crate::handshake::HandshakeError>,
    /// Everything the acceptor sent (acks and aborts), in order.
    pub acceptor_sent: Vec<Body>,
}

/// Runs one connection's handshake over `wire` (0: dialer to acceptor, 1: back),
/// every message encoded into a frame and decoded again as a driver does.
/// `tamper` may change each message the dialer sends before it is encoded.
pub fn run_handshake(
    wire: &mut [std::collections::VecDeque<Item>; 2],
    dialer: &crate::handshake::Dialer<'_>,
    hello: pb::Hello,
    acceptor: &mut crate::handshake::Acceptor<'_>,
    now: Instant,
    tamper: &mut dyn FnMut(&mut Body),
) -> HandshakeEnd {
    use crate::handshake::AcceptorStep;
    let through_frame = |body: Body| -> Result<Body, String> {
        let frame = crate::wire::encode_control(&crate::wire::message(body));
        crate::wire::decode_control(&frame[crate::wire::FRAME_HEADER_LEN..])
            .map_err(|e| e.to_string())
    };
    let mut sent = Body::Hello(hello);
    tamper(&mut sent);
    wire[0].push_back(Item::Control(sent));
    let mut acceptor_sent = Vec::new();
    let mut dialer_end = None;
    let mut acceptor_end = None;
    while acceptor_end.is_none() || dialer_end.is_none() {
        if let Some(Item::Control(body)) = wire[0].pop_front() {
            let step = acceptor.on_message(through_frame(body), now);
            let (reply, end) = match step {
                AcceptorStep::AnswerThenAwaitProof(ack) => (Body::HelloAck(ack), None),
                AcceptorStep::AnswerAndAccept(ack, h) => (Body::HelloAck(ack), Some(Ok(h))),
                AcceptorStep::Accept(h) => {
                    acceptor_end = Some(Ok(h));
                    continue;
                }
                AcceptorStep::Refuse(e) => (
                    Body::Abort(pb::Abort {
                        transfer_id: 0,
                        code: e.code() as i32,
                        message: e.to_string(),
                    }),
                    Some(Err(e)),
                ),
            };
            acceptor_sent.push(reply.clone());
            wire[1].push_back(Item::Control(reply));
            acceptor_end = end;
        } else if let Some(Item::Control(body)) = wire[1].pop_front() {
            let body = through_frame(body).expect("the acceptor's messages decode");
            let result = dialer.on_message(body);
            if let Ok(crate::handshake::Dialed {
                proof: Some(proof), ..
            }) = &result
            {
                let mut p = Body::HelloProof(proof.clone());
                tamper(&mut p);
                wire[0].push_back(Item::Control(p));
            }
            dialer_end = Some(result);
        } else {
            // Nothing in flight: whoever still waits sees its deadline pass.
            if acceptor_end.is_none() {
                if let AcceptorStep::Refuse(e) = acceptor.on_timeout() {
                    acceptor_end = Some(Err(e));
                }
            }
            if dialer_end.is_none() {
                dialer_end = Some(Err(crate::handshake::DialRefusal::Timeout));
            }
        }
    }
    HandshakeEnd {
        dialer: dialer_end.unwrap(),
        acceptor: acceptor_end.unwrap(),
        acceptor_sent,
    }
}

/// Every test that drives a session checks its lifecycle when its side is
/// dropped: no transition the table refuses was attempted (skipped while a
/// test is already failing).
pub fn assert_lifecycle_kept(session: &Session) {
    if !std::thread::panicking() {
        assert_eq!(
            session.invalid_transitions(),
            0,
            "the session attempted a transition its lifecycle table refuses"
        );
    }
}
