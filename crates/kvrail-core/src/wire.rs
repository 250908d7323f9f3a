//! Peer wire framing (see docs/wire-format.md).
//!
//! Every frame begins with an 8-byte header: magic `KR`, version, kind, body length.
//! Control frames carry one protobuf [`PeerMessage`]; data frames carry a 16-byte
//! slice header (transfer id, logical offset) and then the raw payload, so payload
//! bytes can be gathered from and scattered into mapped regions without copies.

use prost::Message;

/// Generated peer messages (`proto/kvrail/v1/peer.proto`), checked in so that
/// binaries carry no build-machine paths (`tests/generated_code.rs` keeps the
/// file current).
#[allow(missing_docs, clippy::all)]
pub mod pb {
    include!("generated/kvrail.v1.peer.rs");
}

pub use pb::peer_message::Body;
pub use pb::{ErrorCode, PeerMessage};

pub const MAGIC: [u8; 2] = *b"KR";
pub const PROTOCOL_VERSION: u8 = 1;
pub const FRAME_HEADER_LEN: usize = 8;
pub const SLICE_HEADER_LEN: usize = 16;
/// Largest control message body accepted (a block list of a million ids fits).
pub const MAX_CONTROL_BYTES: u32 = 16 << 20;
/// Largest slice payload accepted.
pub const MAX_SLICE_BYTES: u32 = 64 << 20;

/// Longest request id a transfer may carry (the worker API refuses longer
/// ones too; a peer's open with a longer one is refused).
pub const REQUEST_ID_MAX: usize = 256;
/// Longest peer-supplied text (an abort's message, a rail's down reason)
/// kept: it reaches worker notifications and logs, so a peer cannot make
/// either grow by megabytes per message.
pub const PEER_TEXT_MAX: usize = 1024;

/// Checks a request id that arrived from a peer.
pub fn check_request_id(request_id: &str) -> Result<(), String> {
    if request_id.is_empty() || request_id.len() > REQUEST_ID_MAX {
        return Err(format!(
            "request id of {} bytes (must be 1..={REQUEST_ID_MAX})",
            request_id.len()
        ));
    }
    Ok(())
}

/// A peer's free text, cut to [`PEER_TEXT_MAX`] bytes (at a character
/// boundary) and marked when cut.
pub fn peer_text(mut text: String) -> String {
    if text.len() <= PEER_TEXT_MAX {
        return text;
    }
    let mut end = PEER_TEXT_MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let cut = text.len() - end;
    text.truncate(end);
    text.push_str(&format!("... ({cut} more bytes cut)"));
    text
}

const KIND_CONTROL: u8 = 1;
const KIND_DATA: u8 = 2;

/// A frame that cannot be parsed: the connection is unusable after it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad frame magic {0:02x?} (not a kvrail peer, or the stream is out of sync)")]
    BadMagic([u8; 2]),
    #[error("peer speaks wire version {0}, this sidecar speaks {PROTOCOL_VERSION}")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("frame body of {len} bytes exceeds the {max}-byte limit")]
    TooLong { len: u32, max: u32 },
    #[error("data frame shorter than its slice header")]
    ShortData,
    #[error("control message does not decode: {0}")]
    Decode(String),
    #[error("control message has no body")]
    EmptyMessage,
    /// One message of a control frame is larger than its kind ever needs
    /// (decoding it could take many times its size in memory).
    #[error("a control message of field {field} has {len} bytes (at most {max} for its kind)")]
    MessageTooLong { field: u32, len: u64, max: u32 },
    /// An open names more block ids or generations than a transfer may have
    /// (counted before decoding: one-byte generations decode to eight).
    #[error("an open names {count} {what} (at most {max})")]
    TooManyEntries {
        what: &'static str,
        count: u64,
        max: u64,
    },
}

/// What follows a frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameHeader {
    /// A protobuf control message of `len` bytes.
    Control { len: u32 },
    /// A slice header (16 bytes) and `payload_len` payload bytes.
    Data { payload_len: u32 },
}

/// Parses the fixed 8-byte frame header.
pub fn decode_frame_header(buf: &[u8; FRAME_HEADER_LEN]) -> Result<FrameHeader, WireError> {
    let magic = [buf[0], buf[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    if buf[2] != PROTOCOL_VERSION {
        return Err(WireError::Version(buf[2]));
    }
    let len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    match buf[3] {
        KIND_CONTROL if len > MAX_CONTROL_BYTES => Err(WireError::TooLong {
            len,
            max: MAX_CONTROL_BYTES,
        }),
        KIND_CONTROL => Ok(FrameHeader::Control { len }),
        KIND_DATA => {
            let payload_len = len
                .checked_sub(SLICE_HEADER_LEN as u32)
                .ok_or(WireError::ShortData)?;
            if payload_len > MAX_SLICE_BYTES {
                return Err(WireError::TooLong {
                    len: payload_len,
                    max: MAX_SLICE_BYTES,
                });
            }
            Ok(FrameHeader::Data { payload_len })
        }
        other => Err(WireError::UnknownKind(other)),
    }
}

/// Identifies the bytes a data frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceHeader {
    pub transfer_id: u64,
    pub offset: u64,
}

pub fn decode_slice_header(buf: &[u8; SLICE_HEADER_LEN]) -> SliceHeader {
    let mut t = [0u8; 8];
    let mut o = [0u8; 8];
    t.copy_from_slice(&buf[..8]);
    o.copy_from_slice(&buf[8..]);
    SliceHeader {
        transfer_id: u64::from_le_bytes(t),
        offset: u64::from_le_bytes(o),
    }
}

/// Frame header plus slice header for a data frame of `payload_len` bytes.
pub fn encode_data_header(
    slice: SliceHeader,
    payload_len: u32,
) -> [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN] {
    let mut out = [0u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN];
    out[..2].copy_from_slice(&MAGIC);
    out[2] = PROTOCOL_VERSION;
    out[3] = KIND_DATA;
    out[4..8].copy_from_slice(&(payload_len + SLICE_HEADER_LEN as u32).to_le_bytes());
    out[8..16].copy_from_slice(&slice.transfer_id.to_le_bytes());
    out[16..24].copy_from_slice(&slice.offset.to_le_bytes());
    out
}

/// A whole control frame, header included.
pub fn encode_control(msg: &PeerMessage) -> Vec<u8> {
    let len = msg.encoded_len();
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + len);
    out.extend_from_slice(&MAGIC);
    out.push(PROTOCOL_VERSION);
    out.push(KIND_CONTROL);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    msg.encode(&mut out).expect("Vec grows as needed");
    out
}

/// Bytes of an RDMA slice trailer (the SEND that follows a slice's WRITEs):
/// transfer id, logical offset, length, little-endian u64 each.
pub const SLICE_TRAILER_LEN: usize = 24;

/// The trailer that tells an RDMA receiver a slice is in place.
pub fn encode_slice_trailer(h: SliceHeader, len: u32) -> [u8; SLICE_TRAILER_LEN] {
    let mut t = [0u8; SLICE_TRAILER_LEN];
    t[..8].copy_from_slice(&h.transfer_id.to_le_bytes());
    t[8..16].copy_from_slice(&h.offset.to_le_bytes());
    t[16..].copy_from_slice(&u64::from(len).to_le_bytes());
    t
}

/// Decodes a trailer; `None` unless it is exactly one, with a length that fits.
pub fn decode_slice_trailer(b: &[u8]) -> Option<(SliceHeader, u32)> {
    let b: &[u8; SLICE_TRAILER_LEN] = b.try_into().ok()?;
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    let len = u32::try_from(word(2)).ok()?;
    Some((
        SliceHeader {
            transfer_id: word(0),
            offset: word(1),
        },
        len,
    ))
}

/// Decodes a control body into its message.
pub fn decode_control(body: &[u8]) -> Result<Body, WireError> {
    check_message_sizes(body)?;
    let msg = PeerMessage::decode(body).map_err(|e| WireError::Decode(e.to_string()))?;
    msg.body.ok_or(WireError::EmptyMessage)
}

/// Most bytes of a control message other than an open: every other kind is
/// a few fields (a certificate in a `HelloAck`, a worker message's 16 KiB
/// payload), and a frame of 16 MiB of empty repeated entries (an
/// `RdmaConnect` of millions of queue pairs) decodes to 20-40 times its
/// size before any count is checked.
pub const MAX_SMALL_CONTROL_BYTES: u32 = 64 << 10;

/// The limit on one message of the `PeerMessage` field `field`: opens name
/// up to [`crate::plan::MAX_BLOCKS_PER_TRANSFER`] blocks with their
/// generations, so they may fill a frame; nothing else comes close.
fn max_message_bytes(field: u32) -> u32 {
    match field {
        3 | 4 => MAX_CONTROL_BYTES, // PushOpen, PullOpen
        _ => MAX_SMALL_CONTROL_BYTES,
    }
}

/// Calls `field(number, wire type, payload)` for each field of a protobuf
/// message, without decoding any (`payload`: a length-delimited field's
/// bytes, empty for the others); refuses malformed framing.
fn walk_fields(
    mut body: &[u8],
    mut field: impl FnMut(u32, prost::encoding::WireType, &[u8]) -> Result<(), WireError>,
) -> Result<(), WireError> {
    use prost::encoding::{decode_varint, WireType};
    let bad = |e: prost::DecodeError| WireError::Decode(e.to_string());
    while !body.is_empty() {
        let key = decode_varint(&mut body).map_err(bad)?;
        let number = u32::try_from(key >> 3).unwrap_or(u32::MAX);
        let wire_type = WireType::try_from(key & 7).map_err(bad)?;
        let len = match wire_type {
            WireType::LengthDelimited => decode_varint(&mut body).map_err(bad)?,
            WireType::Varint => {
                decode_varint(&mut body).map_err(bad)?;
                0
            }
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            WireType::StartGroup | WireType::EndGroup => {
                return Err(WireError::Decode("groups are not used".into()))
            }
        };
        let Some(len) = usize::try_from(len).ok().filter(|&l| l <= body.len()) else {
            return Err(WireError::Decode(format!(
                "field {number} claims {len} bytes, {} remain",
                body.len()
            )));
        };
        let (payload, rest) = body.split_at(len);
        body = rest;
        let payload = if wire_type == WireType::LengthDelimited {
            payload
        } else {
            &[]
        };
        field(number, wire_type, payload)?;
    }
    Ok(())
}

/// Walks the top-level fields of a `PeerMessage` and refuses a kind whose
/// bytes pass its limit, before anything is decoded. A field may come many
/// times (prost merges the copies into one message, appending their repeated
/// entries), so what counts is the sum of its copies. In opens, the block
/// ids and generations of their block sets are counted too (summed over
/// every copy, each packed varint one entry): at most
/// [`crate::plan::MAX_BLOCKS_PER_TRANSFER`] of each.
fn check_message_sizes(body: &[u8]) -> Result<(), WireError> {
    use prost::encoding::WireType;
    // Bytes per field number; numbers past the last known share the last slot.
    let mut seen = [0u64; 17];
    // Block ids and generations named by the opens.
    let mut entries = [0u64; 2];
    walk_fields(body, |field, wire_type, payload| {
        let len = match wire_type {
            WireType::LengthDelimited => payload.len() as u64,
            WireType::SixtyFourBit => 8,
            WireType::ThirtyTwoBit => 4,
            _ => 0,
        };
        let max = max_message_bytes(field);
        let total = &mut seen[(field as usize).min(16)];
        *total = total.saturating_add(len);
        if *total > u64::from(max) {
            return Err(WireError::MessageTooLong {
                field,
                len: *total,
                max,
            });
        }
        if matches!(field, 3 | 4) && wire_type == WireType::LengthDelimited {
            count_open_entries(payload, &mut entries)?;
        }
        Ok(())
    })
}

/// Adds the block ids and generations a `PushOpen`/`PullOpen` (its field 3,
/// the block set) names to `entries`, refusing past the per-transfer limit.
fn count_open_entries(open: &[u8], entries: &mut [u64; 2]) -> Result<(), WireError> {
    use prost::encoding::WireType;
    let max = crate::plan::MAX_BLOCKS_PER_TRANSFER as u64;
    walk_fields(open, |field, wire_type, block_set| {
        if field != 3 || wire_type != WireType::LengthDelimited {
            return Ok(());
        }
        walk_fields(block_set, |field, wire_type, packed| {
            let (slot, what) = match field {
                4 => (0, "block ids"),
                5 => (1, "generations"),
                _ => return Ok(()),
            };
            let count = match wire_type {
                // One varint ends at each byte without the continuation bit.
                WireType::LengthDelimited => packed.iter().filter(|&&b| b < 0x80).count() as u64,
                _ => 1,
            };
            entries[slot] += count;
            if entries[slot] > max {
                return Err(WireError::TooManyEntries {
                    what,
                    count: entries[slot],
                    max,
                });
            }
            Ok(())
        })
    })
}

/// Wraps a body into a message.
pub fn message(body: Body) -> PeerMessage {
    PeerMessage { body: Some(body) }
}

impl ErrorCode {
    /// Stable snake_case reason used in metrics, logs and the worker API.
    pub fn reason(self) -> &'static str {
        match self {
            ErrorCode::Unspecified => "unspecified",
            ErrorCode::UnknownRegion => "unknown_region",
            ErrorCode::OutOfRange => "out_of_range",
            ErrorCode::OverlappingBlocks => "overlapping_blocks",
            ErrorCode::SizeMismatch => "size_mismatch",
            ErrorCode::NotExposed => "not_exposed",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::Protocol => "protocol",
            ErrorCode::DuplicateTransfer => "duplicate_transfer",
            ErrorCode::RegionGone => "region_gone",
            ErrorCode::Internal => "internal",
            ErrorCode::RegionTruncated => "region_truncated",
            ErrorCode::BlocksReleased => "blocks_released",
            ErrorCode::TooManySessions => "too_many_sessions",
            ErrorCode::IncompatibleLayout => "incompatible_layout",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailers_roundtrip_and_reject_bad_lengths() {
        let h = SliceHeader {
            transfer_id: 9,
            offset: 1 << 40,
        };
        let t = encode_slice_trailer(h, 4096);
        assert_eq!(decode_slice_trailer(&t), Some((h, 4096)));
        assert_eq!(decode_slice_trailer(&t[..23]), None);
        let mut big = t;
        big[20] = 1; // a length past u32
        assert_eq!(decode_slice_trailer(&big), None);
    }

    #[test]
    fn control_roundtrip() {
        let msg = message(Body::Complete(pb::Complete { transfer_id: 42 }));
        let frame = encode_control(&msg);
        let hdr: [u8; 8] = frame[..8].try_into().unwrap();
        let FrameHeader::Control { len } = decode_frame_header(&hdr).unwrap() else {
            panic!("not control")
        };
        assert_eq!(len as usize, frame.len() - 8);
        assert_eq!(
            decode_control(&frame[8..]).unwrap(),
            Body::Complete(pb::Complete { transfer_id: 42 })
        );
    }

    #[test]
    fn data_header_roundtrip() {
        let h = encode_data_header(
            SliceHeader {
                transfer_id: 7,
                offset: 1 << 33,
            },
            4096,
        );
        let fh: [u8; 8] = h[..8].try_into().unwrap();
        assert_eq!(
            decode_frame_header(&fh).unwrap(),
            FrameHeader::Data { payload_len: 4096 }
        );
        let sh: [u8; 16] = h[8..].try_into().unwrap();
        assert_eq!(
            decode_slice_header(&sh),
            SliceHeader {
                transfer_id: 7,
                offset: 1 << 33
            }
        );
    }

    #[test]
    fn garbled_frames_are_rejected() {
        assert_eq!(
            decode_frame_header(b"XX\x01\x01\0\0\0\0"),
            Err(WireError::BadMagic(*b"XX"))
        );
        assert_eq!(
            decode_frame_header(b"KR\x09\x01\0\0\0\0"),
            Err(WireError::Version(9))
        );
        assert_eq!(
            decode_frame_header(b"KR\x01\x07\0\0\0\0"),
            Err(WireError::UnknownKind(7))
        );
        assert_eq!(
            decode_frame_header(b"KR\x01\x02\x04\0\0\0"),
            Err(WireError::ShortData)
        );
        assert!(matches!(
            decode_frame_header(b"KR\x01\x01\xff\xff\xff\xff"),
            Err(WireError::TooLong { .. })
        ));
        assert!(decode_control(&[0xff, 0xff, 0xff]).is_err());
        assert_eq!(decode_control(&[]), Err(WireError::EmptyMessage));
    }

    /// A 16 MiB open of one-byte generations decoded to 128 MiB before its
    /// count was checked: the ids and generations of an open are counted
    /// before decoding, over every copy of the open and of its block set.
    #[test]
    fn opens_naming_too_many_blocks_are_refused_before_decoding() {
        let max = crate::plan::MAX_BLOCKS_PER_TRANSFER;
        let open = |ids: Vec<u32>, generations: Vec<u64>| {
            message(Body::PushOpen(pb::PushOpen {
                transfer_id: 1,
                request_id: "r".into(),
                destination: Some(pb::BlockSet {
                    block_ids: ids,
                    generations,
                    ..Default::default()
                }),
                ..Default::default()
            }))
            .encode_to_vec()
        };
        let one_byte_generations = open(vec![0], vec![1; 16_000_000]);
        assert!(one_byte_generations.len() < MAX_CONTROL_BYTES as usize);
        assert!(matches!(
            decode_control(&one_byte_generations),
            Err(WireError::TooManyEntries {
                what: "generations",
                ..
            })
        ));
        // Two copies of an open, each at the limit, merge past it.
        let at_limit = open((0..max as u32).collect(), Vec::new());
        assert!(decode_control(&at_limit).is_ok());
        let mut twice = at_limit.clone();
        twice.extend_from_slice(&open(vec![0; 2], Vec::new()));
        assert!(matches!(
            decode_control(&twice),
            Err(WireError::TooManyEntries {
                what: "block ids",
                ..
            })
        ));
        // A pull's source counts the same.
        let pull = message(Body::PullOpen(pb::PullOpen {
            transfer_id: 1,
            source: Some(pb::BlockSet {
                block_ids: vec![3; max + 1],
                ..Default::default()
            }),
            ..Default::default()
        }))
        .encode_to_vec();
        assert!(matches!(
            decode_control(&pull),
            Err(WireError::TooManyEntries { .. })
        ));
    }

    /// A frame of millions of empty queue-pair entries is refused from its
    /// length, before prost builds them (320 MiB for a 16 MiB frame); so is
    /// one behind a small first message, and one cut into copies of the
    /// field that prost would merge.
    /// Opens may be large, and real messages of every kind pass.
    #[test]
    fn oversized_messages_are_refused_by_kind_before_decoding() {
        let huge = message(Body::RdmaConnect(pb::RdmaConnect {
            rail_index: 0,
            nonce: 1,
            qps: vec![pb::RdmaEndpoint::default(); 100_000],
            attempt: 1,
        }))
        .encode_to_vec();
        assert!(matches!(
            decode_control(&huge),
            Err(WireError::MessageTooLong { field: 12, max, .. }) if max == MAX_SMALL_CONTROL_BYTES
        ));
        let mut hidden = message(Body::Ping(pb::Ping { nonce: 1 })).encode_to_vec();
        hidden.extend_from_slice(&huge);
        assert!(matches!(
            decode_control(&hidden),
            Err(WireError::MessageTooLong { field: 12, .. })
        ));
        // Copies of one field, each under the limit, are merged by prost
        // into one message: their sum counts.
        let part = message(Body::RdmaConnect(pb::RdmaConnect {
            qps: vec![pb::RdmaEndpoint::default(); 30_000],
            ..Default::default()
        }))
        .encode_to_vec();
        assert!(part.len() < MAX_SMALL_CONTROL_BYTES as usize);
        assert!(decode_control(&part).is_ok());
        let copies = part.repeat(256);
        assert!(matches!(
            decode_control(&copies),
            Err(WireError::MessageTooLong { field: 12, .. })
        ));
        let open = message(Body::PushOpen(pb::PushOpen {
            transfer_id: 1,
            request_id: "r".into(),
            destination: Some(pb::BlockSet {
                block_ids: (0..1_000_000).collect(),
                generations: vec![u64::MAX; 1_000_000],
                ..Default::default()
            }),
            ..Default::default()
        }))
        .encode_to_vec();
        assert!(open.len() > MAX_SMALL_CONTROL_BYTES as usize);
        assert!(open.len() < MAX_CONTROL_BYTES as usize);
        assert!(matches!(decode_control(&open), Ok(Body::PushOpen(_))));
        let small = message(Body::RdmaConnect(pb::RdmaConnect {
            rail_index: 1,
            nonce: 2,
            qps: vec![
                pb::RdmaEndpoint {
                    qp_num: 7,
                    psn: 9,
                    gid: vec![0xfe; 16],
                    mtu: 4096
                };
                16
            ],
            attempt: 3,
        }));
        assert_eq!(
            decode_control(&small.encode_to_vec()),
            Ok(small.body.unwrap())
        );
        let note = message(Body::WorkerMessage(pb::WorkerMessage {
            from_worker: "w".repeat(256),
            to_worker: "v".repeat(256),
            topic: "t".repeat(256),
            payload: vec![1; crate::message::MAX_PAYLOAD_BYTES],
        }));
        assert_eq!(
            decode_control(&note.encode_to_vec()),
            Ok(note.body.unwrap())
        );
        // A length past the body's end is a decode error, not a panic.
        assert!(matches!(
            decode_control(&[0x62, 0x10, 0x08]),
            Err(WireError::Decode(_))
        ));
    }
}
