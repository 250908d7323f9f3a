//! [`Client::push`](crate::Client::push) and [`Client::pull`](crate::Client::pull)
//! through the worker's submission ring when the sidecar serves rings (the
//! default), else through gRPC.
//!
//! Each worker id gets one ring, opened on its first transfer without
//! notifications (those stay on [`Client::subscribe`](crate::Client::subscribe)),
//! and one thread that sleeps on its completion queue and hands each
//! ACCEPTED or REJECTED answer to the call that waits for it. A submission
//! that cannot go through the ring (queue full, too large for a slot, the
//! ring closed before it was written, a sidecar without rings) goes through
//! gRPC instead: it was never written, so it cannot start twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvrail_proto::{BlockRange, TransferAccepted};
use tokio::sync::oneshot;

use crate::ring::{Completion, CompletionKind, Ring, RingOptions, RingSubmitError};
use crate::{Client, ClientError};

/// How [`Client::push`](crate::Client::push) and [`Client::pull`](crate::Client::pull)
/// reach the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SubmitPath {
    /// The worker's shared-memory ring where the sidecar serves one, else gRPC.
    #[default]
    Ring,
    /// One gRPC call per transfer.
    Grpc,
}

/// How long the completion thread sleeps between looks at its stop flag.
const COMPLETION_POLL: Duration = Duration::from_millis(50);
/// After a ring could not be opened for a worker, its transfers use gRPC this
/// long before the next try (no failed `OpenRing` per transfer where rings
/// cannot work, e.g. a sidecar that cannot open this process's shared memory).
const REOPEN_AFTER: Duration = Duration::from_secs(10);

/// The rings of one client (and its clones), by worker id.
#[derive(Default)]
pub(crate) struct RingSubmitters {
    /// The sidecar answered `UNIMPLEMENTED` to `OpenRing`: gRPC from now on.
    unsupported: AtomicBool,
    by_worker: Mutex<HashMap<String, Arc<Submitter>>>,
    /// Workers whose last ring could not be opened, and when.
    refused: Mutex<HashMap<String, std::time::Instant>>,
    /// One ring opened at a time (two first pushes of a worker open one ring).
    opening: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for RingSubmitters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingSubmitters")
            .field("unsupported", &self.unsupported.load(Ordering::Relaxed))
            .field("workers", &lock(&self.by_worker).len())
            .finish()
    }
}

impl Drop for RingSubmitters {
    fn drop(&mut self) {
        for s in lock(&self.by_worker).values() {
            s.stop.store(true, Ordering::Release);
        }
    }
}

/// One worker's ring and the calls waiting for its answers.
struct Submitter {
    ring: Ring,
    /// Calls waiting, by user data; `None` once the ring stopped answering.
    waiting: Mutex<Option<HashMap<u64, oneshot::Sender<Completion>>>>,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the transfer is a push (else a pull).
#[derive(Clone, Copy)]
pub(crate) enum Op {
    Push,
    Pull,
}

/// One `push` or `pull` call's arguments.
#[derive(Clone, Copy)]
pub(crate) struct TransferCall<'a> {
    pub op: Op,
    pub worker_id: &'a str,
    pub request_id: &'a str,
    pub peer: &'a str,
    pub source: &'a BlockRange,
    pub destination: &'a BlockRange,
}

impl RingSubmitters {
    /// Starts a transfer through `worker_id`'s ring. `None`: it was not
    /// written there; use gRPC.
    pub(crate) async fn start(
        &self,
        client: &mut Client,
        call: &TransferCall<'_>,
    ) -> Option<Result<TransferAccepted, ClientError>> {
        let TransferCall {
            op,
            worker_id,
            request_id,
            peer,
            source,
            destination,
        } = *call;
        let submitter = self.submitter(client, worker_id).await?;
        let answer = {
            let mut waiting = lock(&submitter.waiting);
            let waiting = waiting.as_mut()?;
            let submitted = match op {
                Op::Push => submitter
                    .ring
                    .submit_push(request_id, peer, source, destination),
                Op::Pull => submitter
                    .ring
                    .submit_pull(request_id, peer, source, destination),
            };
            let user_data = match submitted {
                Ok(u) => u,
                Err(RingSubmitError::Closed(_)) => {
                    self.forget(worker_id, &submitter);
                    return None;
                }
                // Full, too large for a slot, or not encodable as a slot
                // (gRPC gives the exact validation error): not written.
                Err(_) => return None,
            };
            let (tx, rx) = oneshot::channel();
            waiting.insert(user_data, tx);
            rx
        };
        Some(match answer.await {
            Ok(c) => answer_of(c),
            Err(_) => Err(ClientError::Ring(format!(
                "the ring closed before the sidecar answered {request_id:?}: {}; \
                 the transfer may have started (see GetTransfer or its notification)",
                submitter
                    .ring
                    .closed()
                    .unwrap_or_else(|| "the client was dropped".into())
            ))),
        })
    }

    async fn submitter(&self, client: &mut Client, worker_id: &str) -> Option<Arc<Submitter>> {
        if self.unsupported.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(s) = lock(&self.by_worker).get(worker_id) {
            return Some(s.clone());
        }
        if lock(&self.refused)
            .get(worker_id)
            .is_some_and(|at| at.elapsed() < REOPEN_AFTER)
        {
            return None;
        }
        let _one_at_a_time = self.opening.lock().await;
        if let Some(s) = lock(&self.by_worker).get(worker_id) {
            return Some(s.clone());
        }
        let options = RingOptions {
            notifications: false,
            ..RingOptions::default()
        };
        let ring = match client.open_ring(worker_id, options).await {
            Ok(r) => r,
            Err(e) => {
                if e.code() == Some(tonic::Code::Unimplemented) {
                    self.unsupported.store(true, Ordering::Relaxed);
                }
                // Refused (this worker's rings are all taken, a bad worker id,
                // no shared memory): this call goes through gRPC, whose answer
                // is the one the caller needs; a later one tries again.
                let mut refused = lock(&self.refused);
                // Entries past their back-off mean nothing: dropped here, so
                // the map holds only the worker ids refused in the last 10 s.
                refused.retain(|_, at| at.elapsed() < REOPEN_AFTER);
                refused.insert(worker_id.to_string(), std::time::Instant::now());
                return None;
            }
        };
        lock(&self.refused).remove(worker_id);
        let submitter = Arc::new(Submitter {
            ring,
            waiting: Mutex::new(Some(HashMap::new())),
            stop: AtomicBool::new(false),
        });
        let answers = submitter.clone();
        std::thread::Builder::new()
            .name("kvrail-ring-answers".into())
            .spawn(move || hand_out_answers(&answers))
            .ok()?;
        lock(&self.by_worker).insert(worker_id.to_string(), submitter.clone());
        Some(submitter)
    }

    /// Drops a ring that stopped serving, so the next transfer opens a new one.
    fn forget(&self, worker_id: &str, submitter: &Arc<Submitter>) {
        submitter.stop.store(true, Ordering::Release);
        let mut by_worker = lock(&self.by_worker);
        if by_worker
            .get(worker_id)
            .is_some_and(|s| Arc::ptr_eq(s, submitter))
        {
            by_worker.remove(worker_id);
        }
    }
}

/// The completion thread: each answer to the call that waits for it, until
/// the ring closes or the client is dropped; then every waiting call is told.
fn hand_out_answers(s: &Submitter) {
    while !s.stop.load(Ordering::Acquire) {
        match s.ring.wait(COMPLETION_POLL) {
            Ok(Some(c)) => {
                if let Some(waiting) = lock(&s.waiting).as_mut() {
                    if let Some(tx) = waiting.remove(&c.user_data) {
                        let _ = tx.send(c);
                    }
                }
            }
            Ok(None) => {}
            Err(_) => break,
        }
    }
    // Dropping the senders wakes every waiting call with "closed".
    lock(&s.waiting).take();
}

/// The gRPC call's answer, from the ring's.
fn answer_of(c: Completion) -> Result<TransferAccepted, ClientError> {
    match c.kind {
        CompletionKind::Accepted => Ok(TransferAccepted {
            transfer_id: c.transfer_id,
            total_bytes: c.bytes,
            segments: c.sequence,
        }),
        CompletionKind::Rejected => Err(ClientError::Rejected(tonic::Status::new(
            grpc_code(&c.code),
            c.message,
        ))),
        other => Err(ClientError::Ring(format!(
            "the sidecar answered a submission with {other:?}"
        ))),
    }
}

/// The gRPC code the same refusal gets from the gRPC call.
fn grpc_code(ring_code: &str) -> tonic::Code {
    use tonic::Code as C;
    match ring_code {
        // A slot the sidecar could not decode: what gRPC calls a bad request.
        "invalid_argument" | "bad_descriptor" => C::InvalidArgument,
        "not_found" => C::NotFound,
        "already_exists" => C::AlreadyExists,
        "unavailable" => C::Unavailable,
        "failed_precondition" | "blocks_released" => C::FailedPrecondition,
        "resource_exhausted" => C::ResourceExhausted,
        "permission_denied" => C::PermissionDenied,
        _ => C::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_keep_their_grpc_codes() {
        for (ring, grpc) in [
            ("invalid_argument", tonic::Code::InvalidArgument),
            ("bad_descriptor", tonic::Code::InvalidArgument),
            ("not_found", tonic::Code::NotFound),
            ("already_exists", tonic::Code::AlreadyExists),
            ("unavailable", tonic::Code::Unavailable),
            ("blocks_released", tonic::Code::FailedPrecondition),
            ("resource_exhausted", tonic::Code::ResourceExhausted),
            ("something new", tonic::Code::Internal),
        ] {
            assert_eq!(grpc_code(ring), grpc, "{ring}");
        }
    }
}
