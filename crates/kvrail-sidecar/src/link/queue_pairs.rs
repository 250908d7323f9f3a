//! An RDMA queue pair of a link: the task that drives it (posts what the
//! session schedules on it, reaps completions, reports trailers), and why a
//! rail's queue pairs could not be set up. (Setting them up is the link's:
//! it takes the link's connections and state.)

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrail_core::wire::{self, ErrorCode, SliceHeader};
use kvrail_core::{OneSidedOp, RailId};
use kvrail_verbs::{gather, Completion, Opcode, QueuePair, Sge, WorkRequest};
use tokio::sync::mpsc;
use tracing::warn;

use super::conns::ConnKey;
use super::owner::ConnOwner;
use crate::metrics as m;
use crate::rdma::OneSidedWork;

/// Why a rail's queue pairs were not set up.
#[derive(Debug, thiserror::Error)]
pub enum RdmaSetupError {
    /// The exchange failed: the peer declined (it has no RDMA on that rail,
    /// or its own setup is under way), answered wrongly, or not in time.
    #[error(transparent)]
    Exchange(#[from] kvrail_core::qp_setup::QpSetupError),
    /// This side could not create, describe or connect its queue pairs, or
    /// the link or its connection went away.
    #[error("{0}")]
    Local(String),
}

impl RdmaSetupError {
    /// The peer said no: the rail carries streams only, nothing to rebuild.
    pub fn declined_by_peer(&self) -> bool {
        matches!(
            self,
            Self::Exchange(kvrail_core::qp_setup::QpSetupError::Declined(_))
        )
    }
}

impl From<String> for RdmaSetupError {
    fn from(why: String) -> Self {
        Self::Local(why)
    }
}

impl From<&str> for RdmaSetupError {
    fn from(why: &str) -> Self {
        Self::Local(why.to_string())
    }
}

/// A slice posted and not yet completed.
pub(super) struct Posted {
    header: SliceHeader,
    len: u32,
    work_requests: u32,
    op: OneSidedOp,
}

/// Why a slice could not be posted.
pub(super) enum PostError {
    /// The slice itself is bad (the transfer fails; the queue pair lives on).
    Slice(ErrorCode, String),
}

/// Drives one queue pair: posts what the session schedules on it, reaps its
/// completions, and reports trailers (receiver) and completions (initiator).
pub(super) async fn qp_task<L: ConnOwner>(
    link: Arc<L>,
    key: ConnKey,
    rail: RailId,
    mut qp: QueuePair,
    mut rx: mpsc::UnboundedReceiver<OneSidedWork>,
    rdma_busy_poll: Duration,
) {
    let reason = run_qp(&link, key, rail, &mut qp, &mut rx, rdma_busy_poll).await;
    link.connection_failed(key, &reason);
}

pub(super) async fn run_qp<L: ConnOwner>(
    link: &Arc<L>,
    key: ConnKey,
    rail: RailId,
    qp: &mut QueuePair,
    rx: &mut mpsc::UnboundedReceiver<OneSidedWork>,
    busy_poll: Duration,
) -> String {
    let conn = key.0;
    let counters = m::RdmaCounters::new(link.peer(), rail);
    let max_sge = qp.device().limits().max_sge.clamp(1, 30) as usize;
    let mut free_slots = qp.send_depth();
    let mut posted: HashMap<u64, Posted> = HashMap::new();
    let mut next_token: u64 = 1;
    let mut waiting: VecDeque<OneSidedWork> = VecDeque::new();
    let mut completions: Vec<Completion> = Vec::new();
    let mut wrs: Vec<WorkRequest> = Vec::new();
    let mut input_open = true;
    loop {
        // Post what fits in the send queue, oldest first.
        while let Some(work) = waiting.pop_front() {
            let token = next_token;
            let started = Instant::now();
            match build(link, rail, &work, token, max_sge, &mut wrs) {
                Ok(()) => {}
                Err(PostError::Slice(code, msg)) => {
                    warn!(peer = %link.peer(), rail, transfer = work.header.transfer_id, "{msg}");
                    link.with_session(|s, now| s.fail(work.header.transfer_id, code, &msg, now));
                    continue;
                }
            }
            let built = started.elapsed();
            let n = wrs.len() as u32;
            if n > qp.send_depth() {
                let msg = format!(
                    "slice needs {n} work requests, the send queue holds {}",
                    qp.send_depth()
                );
                link.with_session(|s, now| {
                    s.fail(work.header.transfer_id, ErrorCode::Internal, &msg, now)
                });
                continue;
            }
            if n > free_slots {
                waiting.push_front(work);
                break;
            }
            let posting = Instant::now();
            if let Err(e) = qp.post(&wrs) {
                return format!("posting to the queue pair failed: {e}");
            }
            counters.build_nanos.increment(built.as_nanos() as u64);
            counters
                .post_nanos
                .increment(posting.elapsed().as_nanos() as u64);
            counters.work_requests.increment(u64::from(n));
            counters.descriptors.increment(work.pieces.len() as u64);
            free_slots -= n;
            next_token += 1;
            posted.insert(
                token,
                Posted {
                    header: work.header,
                    len: work.len,
                    work_requests: n,
                    op: work.remote.op,
                },
            );
        }
        completions.clear();
        tokio::select! {
            r = qp.wait(&mut completions, busy_poll) => {
                if let Err(e) = r {
                    return format!("completion queue failed: {e}");
                }
            }
            w = rx.recv(), if input_open && waiting.is_empty() => {
                match w {
                    Some(w) => waiting.push_back(w),
                    None => input_open = false,
                }
                continue;
            }
        }
        for c in completions.drain(..) {
            if let Some(e) = c.error {
                if e.flushed {
                    continue;
                }
                let failed = posted.get(&c.wr_id).map(|p| p.header.transfer_id);
                if let (true, Some(id)) = (e.remote_access, failed) {
                    let msg = format!(
                        "peer refused our access to its memory on rail {rail} ({e}): a stale or foreign memory key, or an address outside its grant"
                    );
                    link.with_session(|s, now| s.fail(id, ErrorCode::Protocol, &msg, now));
                }
                return format!("queue pair failed: {e}");
            }
            if let Some(bytes) = c.received {
                match wire::decode_slice_trailer(&bytes) {
                    Some((header, len)) => {
                        link.with_session(|s, now| {
                            if let kvrail_core::SliceDisposition::Place { .. } =
                                s.accept_slice(conn, header, len, now)
                            {
                                s.slice_placed(conn, header, len, now);
                            }
                        });
                        counters.bytes_received.increment(u64::from(len));
                        counters.slices_received.increment(1);
                    }
                    None => return format!("malformed slice trailer of {} bytes", bytes.len()),
                }
                continue;
            }
            let Some(p) = posted.remove(&c.wr_id) else {
                continue;
            };
            free_slots += p.work_requests;
            link.with_session(|s, now| s.one_sided_done(conn, p.header, p.len, now));
            let (bytes, slices) = match p.op {
                OneSidedOp::Write => (&counters.bytes_sent, &counters.slices_sent),
                OneSidedOp::Read => (&counters.bytes_received, &counters.slices_received),
            };
            bytes.increment(u64::from(p.len));
            slices.increment(1);
        }
        if !input_open && posted.is_empty() && waiting.is_empty() {
            return "queue pair closed".into();
        }
    }
}

/// Builds the work requests of one slice into `wrs`, checking every local range
/// against our registration and every remote one against the peer's grant.
pub(super) fn build<L: ConnOwner>(
    link: &Arc<L>,
    rail: RailId,
    work: &OneSidedWork,
    token: u64,
    max_sge: usize,
    wrs: &mut Vec<WorkRequest>,
) -> Result<(), PostError> {
    wrs.clear();
    let id = work.header.transfer_id;
    let mr = link
        .env()
        .and_then(|env| env.rdma().mr(work.region.id, rail))
        .ok_or_else(|| {
            PostError::Slice(
                ErrorCode::RegionGone,
                format!(
                    "region {} is not registered for RDMA on rail {rail}",
                    work.region.id
                ),
            )
        })?;
    let key = &work.remote.key;
    let mut local = Vec::with_capacity(work.pieces.len());
    for &(off, len) in &work.pieces {
        let addr = mr.addr + off;
        if !mr.contains(addr, len) {
            return Err(PostError::Slice(
                ErrorCode::Internal,
                format!(
                    "local range {off}+{len} lies outside region {}",
                    work.region.id
                ),
            ));
        }
        local.push((addr, len));
    }
    let mut remote = Vec::with_capacity(work.remote.pieces.len());
    for &(off, len) in &work.remote.pieces {
        let inside = off.checked_add(len).is_some_and(|end| end <= key.length);
        if !inside {
            return Err(PostError::Slice(
                ErrorCode::OutOfRange,
                format!(
                    "transfer {id}: peer range {off}+{len} lies outside its grant of {} bytes; nothing posted",
                    key.length
                ),
            ));
        }
        remote.push((key.addr + off, len));
    }
    // The same plan serves both: each request covers one contiguous remote extent.
    let opcode = match work.remote.op {
        OneSidedOp::Write => Opcode::Write,
        OneSidedOp::Read => Opcode::Read,
    };
    let planned = gather(&local, &remote, max_sge)
        .map_err(|e| PostError::Slice(ErrorCode::Internal, format!("transfer {id}: {e}")))?;
    for (raddr, sges) in planned {
        wrs.push(WorkRequest {
            opcode,
            wr_id: 0,
            sges: sges
                .into_iter()
                .map(|(addr, len)| Sge {
                    addr,
                    len,
                    lkey: mr.lkey,
                })
                .collect(),
            remote_addr: raddr,
            rkey: key.rkey,
            inline: Vec::new(),
            signaled: false,
        });
    }
    match work.remote.op {
        OneSidedOp::Write => {
            // The trailer follows the writes on the same queue pair, so when the
            // receiver sees it every byte before it is in place.
            let trailer = wire::encode_slice_trailer(
                SliceHeader {
                    transfer_id: id,
                    offset: work.header.offset,
                },
                work.len,
            )
            .to_vec();
            wrs.push(WorkRequest {
                opcode: Opcode::Send,
                wr_id: token,
                sges: Vec::new(),
                remote_addr: 0,
                rkey: 0,
                inline: trailer,
                signaled: true,
            });
        }
        OneSidedOp::Read => {
            if let Some(last) = wrs.last_mut() {
                last.wr_id = token;
                last.signaled = true;
            }
        }
    }
    if wrs.is_empty() {
        return Err(PostError::Slice(
            ErrorCode::Internal,
            format!("transfer {id}: empty slice"),
        ));
    }
    Ok(())
}
