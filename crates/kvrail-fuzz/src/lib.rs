//! Fuzz targets: every decoder that takes bytes from a peer or a worker, each
//! as `fn(&[u8])` that must never panic, hang or allocate without bound on any
//! input. The same functions serve the stable mutation fuzzer of this crate
//! (`kvrail-fuzz TARGET --seconds N`, and the short runs `cargo test` makes)
//! and coverage-guided fuzzers (a libFuzzer harness calls [`run`]).
//!
//! | target | input | what is exercised |
//! | --- | --- | --- |
//! | `frame` | bytes off a peer connection | frame header, control body (protobuf), slice header |
//! | `handshake` | a hello as the acceptor reads it | bounded handshake frame, field sizes, `check_hello`, transcripts |
//! | `trailer` | an RDMA receive slot | slice trailer decoding |
//! | `plan` | a worker's or peer's block selection and layout | layout validation, `check_shape`, `Plan::build`, segment lookups |
//! | `session` | a sequence of peer control messages and slice headers | the session state machine as a receiver and as a sender |

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvrail_core::handshake::{check_hello, check_hello_sizes, transcript, Signer};
use kvrail_core::wire::{
    self, pb, Body, FrameHeader, SliceHeader, FRAME_HEADER_LEN, SLICE_HEADER_LEN,
};
use kvrail_core::{
    Access, BlockSelection, LocalTransfer, Plan, RegionAccess, RegionDirectory, RegionLayout,
    Session, SessionConfig,
};
use prost::Message;

pub mod mutate;

/// The targets, by name.
pub const TARGETS: [&str; 5] = ["frame", "handshake", "trailer", "plan", "session"];

/// Runs target `name` on `data`. `false` for an unknown name.
pub fn run(name: &str, data: &[u8]) -> bool {
    match name {
        "frame" => frame(data),
        "handshake" => handshake(data),
        "trailer" => trailer(data),
        "plan" => plan(data),
        "session" => session(data),
        _ => return false,
    }
    true
}

/// A peer's byte stream: frames one after the other, as the reader takes them.
pub fn frame(data: &[u8]) {
    let mut rest = data;
    while rest.len() >= FRAME_HEADER_LEN {
        let (hdr, tail) = rest.split_at(FRAME_HEADER_LEN);
        let Ok(hdr) = <&[u8; FRAME_HEADER_LEN]>::try_from(hdr) else {
            return;
        };
        match wire::decode_frame_header(hdr) {
            Ok(FrameHeader::Control { len }) => {
                // The reader allocates `len` only below its limit.
                assert!(len <= wire::MAX_CONTROL_BYTES);
                let take = (len as usize).min(tail.len());
                if let Ok(body) = wire::decode_control(&tail[..take]) {
                    // Whatever decodes re-encodes.
                    let again = wire::encode_control(&wire::message(body));
                    assert!(again.len() >= FRAME_HEADER_LEN);
                }
                rest = &tail[take..];
            }
            Ok(FrameHeader::Data { payload_len }) => {
                assert!(payload_len <= wire::MAX_SLICE_BYTES);
                if tail.len() < SLICE_HEADER_LEN {
                    return;
                }
                let (sh, tail) = tail.split_at(SLICE_HEADER_LEN);
                if let Ok(sh) = <&[u8; SLICE_HEADER_LEN]>::try_from(sh) {
                    let _ = wire::decode_slice_header(sh);
                }
                rest = &tail[(payload_len as usize).min(tail.len())..];
            }
            Err(_) => return,
        }
    }
}

/// A hello from an unauthenticated peer.
pub fn handshake(data: &[u8]) {
    let Ok(hello) = pb::Hello::decode(data) else {
        return;
    };
    if check_hello_sizes(&hello).is_err() {
        return;
    }
    let known = |n: &str| n == "prefill" || n == "decode";
    if let Err(e) = check_hello(&hello, "decode", known, &["tcp", "quic"]) {
        // A refusal stays short whatever the hello held.
        assert!(e.to_string().len() < 1024, "{e}");
    }
    for signer in [Signer::Dialer, Signer::Acceptor] {
        let t = transcript(signer, &hello, "decode", &hello.nonce);
        assert!(t.len() < 64 << 10);
    }
}

/// An RDMA receive slot's contents.
pub fn trailer(data: &[u8]) {
    if let Some((h, len)) = wire::decode_slice_trailer(data) {
        assert_eq!(wire::encode_slice_trailer(h, len).as_slice(), data);
    }
}

/// Reads little-endian integers off the input, zero once it runs out.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
    /// A value from a small range most of the time, anything now and then.
    fn small(&mut self, max: u64) -> u64 {
        let v = self.u64();
        if self.u8() < 230 {
            v % max.saturating_add(1)
        } else {
            v
        }
    }
}

fn layout(c: &mut Cursor<'_>) -> RegionLayout {
    let num_layers = c.small(8) as u32;
    let planes = c.small(2) as u32;
    let num_blocks = c.small(64) as u32;
    let block_bytes = c.small(4096);
    let mut l = RegionLayout::dense(
        num_layers.max(1),
        planes.max(1),
        num_blocks.max(1),
        block_bytes.max(1),
    );
    if c.u8() > 200 {
        l.layer_stride = c.u64();
        l.plane_stride = c.u64();
        l.block_stride = c.u64();
        l.base_offset = c.small(1 << 20);
    }
    l
}

fn selection(c: &mut Cursor<'_>) -> BlockSelection {
    let n = c.small(32).min(4096);
    BlockSelection {
        region_id: 1,
        layer_start: c.small(8) as u32,
        layer_count: c.small(8) as u32,
        block_ids: (0..n).map(|_| c.small(70) as u32).collect(),
        // Mostly none, sometimes one per block, now and then a wrong count.
        generations: (0..c.small(n + 1).min(4096)).map(|_| c.small(3)).collect(),
        slice: None,
        // Now and then an offset a whole-block selection must refuse.
        first_token: c.small(2) as u32,
    }
}

/// A block selection and a layout, from a worker or a peer.
pub fn plan(data: &[u8]) {
    let mut c = Cursor(data);
    let l = layout(&mut c);
    let region_len = c.small(1 << 24);
    if l.validate(region_len).is_err() {
        return;
    }
    let sel = selection(&mut c);
    let access = if c.u8() & 1 == 0 {
        Access::Read
    } else {
        Access::Write
    };
    let Ok(p) = Plan::build(&l, &sel, access) else {
        return;
    };
    // Every segment lies inside the region the layout was validated against.
    for s in p.segments() {
        assert!(s.offset + s.len <= region_len, "{s:?} outside {region_len}");
        assert!(s.logical + s.len <= p.total_bytes());
    }
    let off = c.small(p.total_bytes());
    let len = c.small(p.total_bytes());
    if let Ok(pieces) = p.pieces(off, len) {
        let mut total = 0;
        for (o, n) in pieces {
            assert!(o + n <= region_len);
            total += n;
        }
        assert_eq!(total, len);
    }
}

struct Regions(HashMap<u64, RegionAccess>);

impl RegionDirectory for Regions {
    fn lookup(&self, region_id: u64) -> Option<RegionAccess> {
        self.0.get(&region_id).cloned()
    }
}

/// A session fed whatever a hostile peer might send, in any order: control
/// messages, slice headers (placed or not), connection losses and timeouts.
pub fn session(data: &[u8]) {
    let mut c = Cursor(data);
    let now0 = Instant::now();
    let mut now = now0;
    let mut s = Session::new(SessionConfig {
        slice_bytes: 4096,
        window_bytes: 1 << 16,
        progress_timeout: Duration::from_millis(500),
        rails: kvrail_core::RailConfig::default(),
        probes_rails: c.u8() & 1 == 0,
        eager_max_bytes: u64::from(c.u8()) << 10,
        // Off, or slices of 1-3 KiB and more over the connections.
        spread_min_slice_bytes: u64::from(c.u8() & 3) << 10,
        staged_slice_bytes: 8192,
        // Small enough that a hostile sequence of opens reaches the cap.
        peer_budget: std::sync::Arc::new(kvrail_core::budget::MemoryBudget::new(1 << 20)),
        node_budget: std::sync::Arc::new(kvrail_core::budget::MemoryBudget::new(1 << 21)),
    });
    let regions = Regions(
        [
            (
                1,
                RegionAccess {
                    layout: RegionLayout::dense(2, 2, 16, 512),
                    exposed: true,
                    keys: Vec::new(),
                    staged: true,
                    geometry: None,
                },
            ),
            (
                2,
                RegionAccess {
                    layout: RegionLayout::dense(1, 1, 8, 1000),
                    exposed: false,
                    keys: Vec::new(),
                    staged: false,
                    geometry: None,
                },
            ),
        ]
        .into_iter()
        .collect(),
    );
    let mut conns = Vec::new();
    for rail in 0..2 {
        if let Some(id) = s.add_connection(rail, now) {
            conns.push(id);
        }
    }
    let mut next_id = 1u64;
    let mut steps = 0;
    while !c.0.is_empty() && steps < 256 {
        steps += 1;
        let conn = conns[c.u8() as usize % conns.len().max(1)];
        match c.u8() % 8 {
            0 | 1 => {
                // A control message: protobuf bytes of the input's choosing.
                let len = c.small(256) as usize;
                let take = len.min(c.0.len());
                let (msg, rest) = c.0.split_at(take);
                c.0 = rest;
                if let Ok(body) = wire::decode_control(msg) {
                    s.handle_control(conn, body, now, &regions);
                }
            }
            2 => {
                let header = SliceHeader {
                    transfer_id: c.small(8),
                    offset: c.small(1 << 16),
                };
                let len = c.small(8192) as u32;
                if let kvrail_core::SliceDisposition::Place { .. } =
                    s.accept_slice(conn, header, len, now)
                {
                    if c.u8() & 1 == 0 {
                        s.slice_placed(conn, header, len, now);
                    } else {
                        s.slice_abandoned(conn, header);
                    }
                }
            }
            3 => {
                // A local push or pull, as the API would start it.
                let l = RegionLayout::dense(2, 2, 16, 512);
                let local = BlockSelection {
                    region_id: 1,
                    layer_start: 0,
                    layer_count: 1,
                    block_ids: (0..(c.u8() % 5 + 1) as u32).collect(),
                    generations: Vec::new(),
                    slice: None,
                    first_token: 0,
                };
                let req = LocalTransfer {
                    transfer_id: next_id,
                    request_id: format!("r{next_id}"),
                    local: local.clone(),
                    local_layout: l,
                    remote: BlockSelection {
                        region_id: c.small(3),
                        ..local
                    },
                    staged: c.u8() & 1 == 0,
                    local_geometry: None,
                    receiver_group: None,
                };
                next_id += 1;
                let _ = if c.u8() & 1 == 0 {
                    s.start_push(req, now)
                } else {
                    s.start_pull(req, now)
                };
            }
            4 => {
                now += Duration::from_millis(c.small(2000));
                s.handle_timeout(now);
            }
            5 => s.connection_lost(conn, "fuzz", now),
            6 => {
                let _ = s.cancel(c.small(8), now);
            }
            _ => {
                while s.poll_transmit(now).is_some() {}
                while s.poll_event().is_some() {}
                while s.poll_probe().is_some() {}
            }
        }
        // Whatever happened, the session's bookkeeping stays bounded.
        assert!(s.active_transfers() <= next_id as usize + 64);
    }
    let _ = s.poll_timeout();
}

/// A deterministic corpus to start from: one well-formed input per target.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let hello = pb::Hello {
        protocol_version: 1,
        node_name: "prefill".into(),
        expected_peer: "decode".into(),
        transports: vec!["tcp".into()],
        nonce: vec![7; 32],
        ..Default::default()
    };
    let open = wire::message(Body::PushOpen(pb::PushOpen {
        transfer_id: 1,
        request_id: "r".into(),
        destination: Some(pb::BlockSet {
            region_id: 1,
            layer_start: 0,
            layer_count: 1,
            block_ids: vec![0, 1],
            generations: Vec::new(),
            slice: None,
            first_token: 0,
        }),
        block_bytes: 512,
        total_bytes: 2048,
        one_sided: false,
        geometry: None,
        receiver_group: None,
    }));
    match target {
        "frame" => {
            let mut v = wire::encode_control(&open);
            v.extend_from_slice(&wire::encode_data_header(
                SliceHeader {
                    transfer_id: 1,
                    offset: 0,
                },
                4,
            ));
            v.extend_from_slice(&[1, 2, 3, 4]);
            vec![v]
        }
        "handshake" => vec![hello.encode_to_vec()],
        "trailer" => vec![wire::encode_slice_trailer(
            SliceHeader {
                transfer_id: 3,
                offset: 4096,
            },
            4096,
        )
        .to_vec()],
        "plan" => vec![vec![2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 16, 0, 0, 0]],
        "session" => {
            let body = open.encode_to_vec();
            let mut v = vec![0, 0, 0, body.len() as u8, 0, 0, 0, 0, 0, 0, 0, 0];
            v.extend_from_slice(&body);
            v.extend_from_slice(&[0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            vec![v]
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_run_clean_and_unknown_targets_are_refused() {
        for t in TARGETS {
            for s in seeds(t) {
                assert!(run(t, &s));
            }
        }
        assert!(!run("nope", b""));
    }
}
