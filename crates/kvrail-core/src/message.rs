//! Worker-to-worker messages carried between sidecars (`WorkerMessage`): what
//! a message may hold, checked on the sending side and again on receipt, since
//! a peer's frames are untrusted.

use crate::wire::pb;

/// Longest worker id a message may name (as a gRPC worker id).
pub const MAX_WORKER_ID_BYTES: usize = 256;
/// Longest topic.
pub const MAX_TOPIC_BYTES: usize = 256;
/// Largest payload: a grant of a long prompt's blocks fits; every message a
/// peer sends may be retained per worker until read, so it stays small.
pub const MAX_PAYLOAD_BYTES: usize = 16 << 10;

/// Why a message cannot be sent or is dropped on receipt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    #[error("message {field} is {len} bytes, at most {max} allowed")]
    TooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("message {0} is empty")]
    Empty(&'static str),
    /// The link to the peer already holds this many frames waiting to go out:
    /// the sender is told to back off instead of queueing without bound.
    #[error("{0} control frames already wait to be sent to this peer; try again later")]
    Busy(usize),
}

/// Control frames queued to one peer beyond which a message is refused.
pub const MAX_QUEUED_CONTROL: usize = 4096;

/// Checks a message's fields (sender side and on receipt alike).
pub fn check(m: &pb::WorkerMessage) -> Result<(), MessageError> {
    let long = |field, len: usize, max| {
        if len > max {
            Err(MessageError::TooLong { field, len, max })
        } else {
            Ok(())
        }
    };
    long("from_worker", m.from_worker.len(), MAX_WORKER_ID_BYTES)?;
    long("to_worker", m.to_worker.len(), MAX_WORKER_ID_BYTES)?;
    long("topic", m.topic.len(), MAX_TOPIC_BYTES)?;
    long("payload", m.payload.len(), MAX_PAYLOAD_BYTES)?;
    if m.to_worker.is_empty() {
        return Err(MessageError::Empty("to_worker"));
    }
    if m.from_worker.is_empty() {
        return Err(MessageError::Empty("from_worker"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(payload: usize) -> pb::WorkerMessage {
        pb::WorkerMessage {
            from_worker: "decode-0".into(),
            to_worker: "prefill-0".into(),
            topic: "grant".into(),
            payload: vec![7; payload],
        }
    }

    #[test]
    fn sizes_are_bounded_and_names_required() {
        assert_eq!(check(&msg(MAX_PAYLOAD_BYTES)), Ok(()));
        assert_eq!(
            check(&msg(MAX_PAYLOAD_BYTES + 1)),
            Err(MessageError::TooLong {
                field: "payload",
                len: MAX_PAYLOAD_BYTES + 1,
                max: MAX_PAYLOAD_BYTES
            })
        );
        let mut m = msg(1);
        m.topic = "t".repeat(MAX_TOPIC_BYTES + 1);
        assert!(matches!(
            check(&m),
            Err(MessageError::TooLong { field: "topic", .. })
        ));
        let mut m = msg(1);
        m.to_worker.clear();
        assert_eq!(check(&m), Err(MessageError::Empty("to_worker")));
        let mut m = msg(1);
        m.from_worker = "w".repeat(MAX_WORKER_ID_BYTES + 1);
        assert!(matches!(
            check(&m),
            Err(MessageError::TooLong {
                field: "from_worker",
                ..
            })
        ));
    }
}
