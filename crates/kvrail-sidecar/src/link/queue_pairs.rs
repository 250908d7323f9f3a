//! RDMA queue pairs of a link: setting them up over a stream connection
//! (RdmaConnect / RdmaAccept), rebuilding a rail's after they failed, and the
//! task that drives each one (posts, completions, trailers).

use std::collections::VecDeque;

use kvrail_core::wire::SliceHeader;
use kvrail_core::OneSidedOp;
use kvrail_verbs::{gather, Completion, Opcode, QueuePair, Sge, WorkRequest};

use super::*;
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

impl PeerLink {
    /// Rebuilds `rail`'s queue pairs in the background (dialer side).
    pub fn spawn_rdma_rebuild(&self, rail: RailId) {
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(rebuild_queue_pairs(me, rail));
        }
    }

    /// The registration of a local region on a rail's RDMA device.
    pub fn rdma_mr(&self, region_id: u64, rail: RailId) -> Option<Arc<kvrail_verbs::MemoryRegion>> {
        self.env.upgrade()?.rdma().mr(region_id, rail)
    }

    /// Queues a driver-level control message on one connection. A peer that
    /// keeps asking (queue-pair requests are answered on the connection they
    /// came on) without reading the answers has that connection cut, by the
    /// same rule as what the session queues (`cut_unread_connections`).
    pub(super) fn send_control(&self, conn: ConnId, body: Body) -> bool {
        let mut st = self.lock();
        let queued = match st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
            Some(Sink::Stream(sink)) => {
                sink.queue(Outgoing::Control(encode_control(&wire::message(body))))
            }
            _ => false,
        };
        if self.cut_unread_connections(&mut st, conn_bit(conn), Instant::now()) {
            self.pump(&mut st);
            return false;
        }
        queued
    }

    /// Adds a connected queue pair on `rail` as a one-sided connection.
    pub fn attach_qp(
        self: &Arc<Self>,
        qp: kvrail_verbs::QueuePair,
        rail: RailId,
    ) -> Option<ConnId> {
        let busy_poll = self.env.upgrade()?.rdma().busy_poll;
        self.install(rail, true, |key| {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(qp_task(self.clone(), key, rail, qp, rx, busy_poll));
            (Sink::QueuePair(tx), None, task.abort_handle())
        })
    }

    /// Dialer: sets up `qps_per_rail` queue pairs on `rail` over its stream
    /// connection `conn`. Ok(n) with the number attached.
    pub async fn setup_rdma(
        self: &Arc<Self>,
        rail: RailId,
        conn: ConnId,
    ) -> Result<usize, RdmaSetupError> {
        let env = self.env.upgrade().ok_or("daemon is shutting down")?;
        {
            let mut st = self.lock();
            st.qp_setups.begin(rail)?;
        }
        let _claim = RailClaim {
            link: self,
            rail,
            give_back: |st, rail| st.qp_setups.end(rail),
        };
        let generation = self
            .live_generation(conn)
            .ok_or("the rail's connection closed before setup")?;
        let count = env.rdma().qps_per_rail;
        let mut qps = rdma::create_qps(env.rdma(), rail, count)?;
        let endpoints = qps
            .iter()
            .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let nonce: u64 = rand::random();
        let (tx, rx) = oneshot::channel();
        let request = {
            let mut st = self.lock();
            if st.closed {
                // Its timer is gone: nothing would end the wait.
                return Err("the link closed before setup".into());
            }
            st.qp_waiters.insert(nonce, tx);
            st.qp_setups.start(rail, nonce, endpoints, Instant::now())
        };
        if !self.send_control(conn, Body::RdmaConnect(request)) {
            let mut st = self.lock();
            st.qp_setups.abandon(nonce);
            st.qp_waiters.remove(&nonce);
            return Err("the rail's connection closed before setup".into());
        }
        // The link's timer ends the setup at its deadline (QpSetups), so this
        // always gets an outcome unless the link itself goes away.
        let outcome = rx
            .await
            .map_err(|_| "the link closed during setup".to_string())?;
        let accept_qps = outcome.result?;
        // A rail retired meanwhile took the acceptor's side of these queue
        // pairs with it: attaching ours would revive the rail with queue
        // pairs that reach nothing.
        if self.live_generation(conn) != Some(generation) {
            return Err("the rail's connection closed during setup".into());
        }
        for (qp, remote) in qps.iter_mut().zip(&accept_qps) {
            qp.connect(&rdma::endpoint_of(remote)?)
                .map_err(|e| e.to_string())?;
        }
        let mut attached = 0;
        for qp in qps {
            if self.attach_qp(qp, rail).is_some() {
                attached += 1;
            }
        }
        Ok(attached)
    }

    /// Acceptor: the dialer asks for queue pairs on the rail of connection `conn`.
    pub(super) fn on_rdma_connect(self: &Arc<Self>, conn: ConnId, req: pb::RdmaConnect) {
        let Some(env) = self.env.upgrade() else {
            return;
        };
        let checked = {
            let mut st = self.lock();
            let rail = st.session.connection_rail(conn);
            st.qp_acceptor.take(&req, rail).map_err(|e| e.to_string())
        };
        // The rail's request is answered however this ends.
        let _taken = checked.is_ok().then_some(RailClaim {
            link: self,
            rail: req.rail_index,
            give_back: |st, rail| st.qp_acceptor.done(rail),
        });
        if checked.is_ok() {
            // The dialer replaces its queue pairs on this rail: ours are stale.
            // (Only a request the check accepted, for the rail it came on.)
            let mut st = self.lock();
            let stale = st.session.retire_one_sided_connections(req.rail_index);
            self.stop_connections(&mut st, stale);
            self.pump(&mut st);
        }
        let result = checked.and_then(|()| rdma::accept_qps(env.rdma(), req.rail_index, &req));
        let outcome = result.and_then(|qps| {
            let endpoints = qps
                .iter()
                .map(|q| q.endpoint().map(|e| rdma::endpoint_msg(&e)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let asked = qps.len();
            let attached = qps
                .into_iter()
                .filter_map(|qp| self.attach_qp(qp, req.rail_index))
                .count();
            if attached < asked {
                // The dialer drops its side on our refusal: the ones we kept
                // would reach nothing.
                let mut st = self.lock();
                let kept = st.session.retire_one_sided_connections(req.rail_index);
                self.stop_connections(&mut st, kept);
                self.pump(&mut st);
                return Err(format!(
                    "only {attached} of {asked} queue pairs could be attached (session closed or full)"
                ));
            }
            info!(peer = %self.peer, rail = req.rail_index, qps = endpoints.len(), "RDMA queue pairs connected");
            Ok(endpoints)
        });
        if let Err(e) = &outcome {
            // The peer decides how often this happens: rate limited.
            if let Some(suppressed) = QP_DECLINE_LOG.admit() {
                info!(peer = %self.peer, rail = req.rail_index, suppressed, "declined RDMA queue pairs: {e}");
            }
        }
        let answer = kvrail_core::qp_setup::answer(req.nonce, outcome);
        self.send_control(conn, Body::RdmaAccept(answer));
    }

    /// Whether a queue-pair setup of `rail` is under way (dialer).
    pub fn rdma_setup_under_way(&self, rail: RailId) -> bool {
        self.lock().qp_setups.is_busy(rail)
    }

    pub(super) fn on_rdma_accept(&self, accept: pb::RdmaAccept) {
        let mut st = self.lock();
        // An answer to no setup of ours (late or made up) is ignored.
        if let Some(outcome) = st.qp_setups.on_accept(accept) {
            if let Some(tx) = st.qp_waiters.remove(&outcome.nonce) {
                let _ = tx.send(outcome);
            }
        }
    }

    /// Ends the setups whose answer did not come in time.
    pub(super) fn qp_setups_timed_out(&self) {
        let mut st = self.lock();
        for outcome in st.qp_setups.handle_timeout(Instant::now()) {
            if let Some(tx) = st.qp_waiters.remove(&outcome.nonce) {
                let _ = tx.send(outcome);
            }
        }
    }
}

/// Declined queue-pair requests logged, at most a few a second.
static QP_DECLINE_LOG: std::sync::LazyLock<kvrail_transport::ratelog::RateLimitedLog> =
    std::sync::LazyLock::new(|| kvrail_transport::ratelog::RateLimitedLog::new(5));

/// A rail's claim for one queue-pair setup, given back however the setup
/// ends: the dialer's (`QpSetups::begin`/`end`) or the acceptor's
/// (`QpAcceptor::take`/`done`).
struct RailClaim<'a> {
    link: &'a PeerLink,
    rail: RailId,
    give_back: fn(&mut LinkState, RailId),
}

impl Drop for RailClaim<'_> {
    fn drop(&mut self) {
        (self.give_back)(&mut self.link.lock(), self.rail);
    }
}

/// Dialer: rebuilds the queue pairs of `rail` after they failed, with backoff,
/// for as long as the rail's stream connections live and none is rebuilt.
pub(super) async fn rebuild_queue_pairs(link: Arc<PeerLink>, rail: RailId) {
    {
        let mut st = link.lock();
        if !st.rdma_building.insert(rail) {
            return;
        }
    }
    let mut backoff = rdma::QP_RETRY_INITIAL;
    loop {
        tokio::time::sleep(backoff).await;
        let (closed, qps, stream) = {
            let st = link.lock();
            let conns = st.session.rail_connections(rail);
            let stream = conns.into_iter().find(|&c| {
                matches!(
                    st.conns.get(c).and_then(|h| h.writer.as_ref()),
                    Some(Sink::Stream(_))
                )
            });
            (st.closed, st.session.one_sided_connections(rail), stream)
        };
        // Done: closed, rebuilt, or the rail itself is down (its rebuild redoes RDMA).
        let Some(stream) = stream.filter(|_| !closed && qps == 0) else {
            break;
        };
        match link.setup_rdma(rail, stream).await {
            Ok(n) if n > 0 => {
                info!(peer = %link.peer, rail, qps = n, "RDMA queue pairs rebuilt");
                break;
            }
            Ok(_) => break,
            Err(e) => debug!(peer = %link.peer, rail, "RDMA queue pairs not rebuilt yet: {e}"),
        }
        backoff = (backoff * 2).min(rdma::QP_RETRY_MAX);
    }
    link.lock().rdma_building.remove(&rail);
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
pub async fn qp_task(
    link: Arc<PeerLink>,
    key: ConnKey,
    rail: RailId,
    mut qp: QueuePair,
    mut rx: mpsc::UnboundedReceiver<OneSidedWork>,
    rdma_busy_poll: Duration,
) {
    let reason = run_qp(&link, key, rail, &mut qp, &mut rx, rdma_busy_poll).await;
    link.connection_failed(key, &reason);
}

pub(super) async fn run_qp(
    link: &Arc<PeerLink>,
    key: ConnKey,
    rail: RailId,
    qp: &mut QueuePair,
    rx: &mut mpsc::UnboundedReceiver<OneSidedWork>,
    busy_poll: Duration,
) -> String {
    let conn = key.0;
    let counters = m::RdmaCounters::new(&link.peer, rail);
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
                    warn!(peer = %link.peer, rail, transfer = work.header.transfer_id, "{msg}");
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
pub(super) fn build(
    link: &Arc<PeerLink>,
    rail: RailId,
    work: &OneSidedWork,
    token: u64,
    max_sge: usize,
    wrs: &mut Vec<WorkRequest>,
) -> Result<(), PostError> {
    wrs.clear();
    let id = work.header.transfer_id;
    let mr = link.rdma_mr(work.region.id, rail).ok_or_else(|| {
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
