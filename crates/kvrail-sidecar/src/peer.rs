//! The I/O shell around one core [`Session`]: a reader and a writer task per
//! connection, a timer task, and the pump that turns the session's transmits into
//! socket writes and its events into worker notifications.

use std::io::IoSlice;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use kvrail_core::wire::{
    self, encode_control, encode_data_header, ErrorCode, FRAME_HEADER_LEN, SLICE_HEADER_LEN,
};
use kvrail_core::{ConnId, Session, SliceDisposition, Transmit};
use kvrail_transport::{read_frame, Connection, Frame, FrameReader, FrameWriter, TransportError};
use tokio::sync::{mpsc, Notify};
use tokio::task::AbortHandle;
use tracing::{debug, warn};

use crate::daemon::Shared;
use crate::metrics as m;
use crate::regions::Region;

/// What a writer task puts on its connection.
enum Outgoing {
    Control(Vec<u8>),
    Slice {
        header: [u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        region: Arc<Region>,
        pieces: Vec<(u64, u64)>,
        len: u64,
    },
}

struct ConnHandle {
    writer: Option<mpsc::UnboundedSender<Outgoing>>,
    reader: Option<AbortHandle>,
    rail: u32,
}

struct LinkState {
    session: Session,
    conns: Vec<ConnHandle>,
    closed: bool,
}

/// One session with a peer: the connections we dialed (outbound) or accepted (inbound).
pub struct PeerLink {
    pub peer: String,
    pub transport: &'static str,
    state: Mutex<LinkState>,
    timer: Notify,
    shared: Weak<Shared>,
}

impl PeerLink {
    pub fn new(peer: &str, transport: &'static str, shared: &Arc<Shared>) -> Arc<Self> {
        let link = Arc::new(Self {
            peer: peer.to_string(),
            transport,
            state: Mutex::new(LinkState {
                session: Session::new(shared.session_config()),
                conns: Vec::new(),
                closed: false,
            }),
            timer: Notify::new(),
            shared: Arc::downgrade(shared),
        });
        tokio::spawn(timer_task(Arc::downgrade(&link)));
        link
    }

    fn lock(&self) -> MutexGuard<'_, LinkState> {
        // A panic while holding the lock is a bug; keep serving with the state as is.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the link still has a live connection.
    pub fn is_alive(&self) -> bool {
        let st = self.lock();
        !st.closed && st.session.alive_connections() > 0
    }

    pub fn alive_connections(&self) -> usize {
        self.lock().session.alive_connections()
    }

    /// Reads the session without changing it (nothing to send or report afterwards).
    pub fn inspect<R>(&self, f: impl FnOnce(&Session) -> R) -> R {
        f(&self.lock().session)
    }

    /// Runs `f` on the session, then sends what it queued and reports its events.
    pub fn with_session<R>(&self, f: impl FnOnce(&mut Session, Instant) -> R) -> R {
        let mut st = self.lock();
        let r = f(&mut st.session, Instant::now());
        self.pump(&mut st);
        r
    }

    /// Wakes the timer after a change that may move the next deadline.
    pub fn rearm_timer(&self) {
        self.timer.notify_one();
    }

    fn pump(&self, st: &mut LinkState) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let now = Instant::now();
        while let Some(t) = st.session.poll_transmit(now) {
            let (conn, out) = match t {
                Transmit::Control { conn, msg } => (conn, Outgoing::Control(encode_control(&msg))),
                Transmit::Slice {
                    conn,
                    header,
                    len,
                    region_id,
                    pieces,
                } => {
                    let Some(region) = shared.registry.get(region_id) else {
                        st.session.fail(
                            header.transfer_id,
                            ErrorCode::RegionGone,
                            "source region was unregistered",
                            now,
                        );
                        continue;
                    };
                    (
                        conn,
                        Outgoing::Slice {
                            header: encode_data_header(header, len),
                            region,
                            pieces,
                            len: u64::from(len),
                        },
                    )
                }
            };
            if let Some(tx) = st.conns.get(conn).and_then(|c| c.writer.as_ref()) {
                // A closed channel means the writer died; its reader reports the loss.
                let _ = tx.send(out);
            }
        }
        while let Some(ev) = st.session.poll_event() {
            shared.on_event(&self.peer, ev);
        }
    }

    /// Adds a handshaken connection on `rail` and starts its tasks.
    pub fn attach(self: &Arc<Self>, conn: Connection, rail: u32) -> Option<ConnId> {
        let mut st = self.lock();
        let id = st.session.add_connection(rail)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(reader_task(self.clone(), id, rail, conn.reader)).abort_handle();
        tokio::spawn(writer_task(self.clone(), id, rail, conn.writer, rx));
        st.conns.push(ConnHandle {
            writer: Some(tx),
            reader: Some(reader),
            rail,
        });
        metrics::gauge!(m::PEER_CONNECTIONS, "peer" => self.peer.clone()).increment(1.0);
        Some(id)
    }

    /// A connection broke: stop its tasks and let the session re-plan.
    pub fn connection_failed(&self, conn: ConnId, reason: &str) {
        let mut st = self.lock();
        let Some(handle) = st.conns.get_mut(conn) else {
            return;
        };
        if handle.writer.is_none() {
            return;
        }
        handle.writer = None;
        if let Some(r) = handle.reader.take() {
            r.abort();
        }
        let rail = handle.rail;
        warn!(peer = %self.peer, conn, rail, "peer connection lost: {reason}");
        metrics::gauge!(m::PEER_CONNECTIONS, "peer" => self.peer.clone()).decrement(1.0);
        metrics::counter!(m::CONNECTIONS_LOST, "peer" => self.peer.clone(), "rail" => rail.to_string()).increment(1);
        st.session.connection_lost(conn, reason, Instant::now());
        if st.session.alive_connections() == 0 {
            st.closed = true;
        }
        self.pump(&mut st);
        drop(st);
        self.timer.notify_one();
    }

    /// Closes every connection (daemon shutdown or peer gone).
    pub fn close(&self, reason: &str) {
        let n = self.lock().conns.len();
        for conn in 0..n {
            self.connection_failed(conn, reason);
        }
    }
}

/// Most frames, and payload bytes, one vectored write gathers from the queue.
const WRITE_BATCH_FRAMES: usize = 64;
const WRITE_BATCH_BYTES: u64 = 4 << 20;

async fn writer_task(
    link: Arc<PeerLink>,
    conn: ConnId,
    rail: u32,
    mut writer: Box<dyn FrameWriter>,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let rail_label = rail.to_string();
    let mut batch: Vec<Outgoing> = Vec::with_capacity(WRITE_BATCH_FRAMES);
    while let Some(first) = rx.recv().await {
        // Whatever else is already queued goes out in the same system call.
        batch.push(first);
        let mut payload: u64 = batch.iter().map(Outgoing::payload_len).sum();
        while batch.len() < WRITE_BATCH_FRAMES && payload < WRITE_BATCH_BYTES {
            match rx.try_recv() {
                Ok(o) => {
                    payload += o.payload_len();
                    batch.push(o);
                }
                Err(_) => break,
            }
        }
        let result = write_batch(writer.as_mut(), &batch).await;
        if let Err(e) = result {
            link.connection_failed(conn, &format!("write failed: {e}"));
            return;
        }
        let slices = batch
            .iter()
            .filter(|o| matches!(o, Outgoing::Slice { .. }))
            .count() as u64;
        if slices > 0 {
            let labels = [
                ("peer", link.peer.clone()),
                ("rail", rail_label.clone()),
                ("transport", link.transport.to_string()),
            ];
            metrics::counter!(m::BYTES_SENT, &labels).increment(payload);
            metrics::counter!(m::SLICES_SENT, &labels).increment(slices);
        }
        batch.clear();
    }
}

impl Outgoing {
    fn payload_len(&self) -> u64 {
        match self {
            Outgoing::Control(_) => 0,
            Outgoing::Slice { len, .. } => *len,
        }
    }
}

async fn write_batch(writer: &mut dyn FrameWriter, batch: &[Outgoing]) -> std::io::Result<()> {
    let mut bufs = Vec::with_capacity(batch.len() * 2);
    for out in batch {
        match out {
            Outgoing::Control(bytes) => bufs.push(IoSlice::new(bytes)),
            Outgoing::Slice {
                header,
                region,
                pieces,
                ..
            } => {
                bufs.push(IoSlice::new(header));
                bufs.extend(
                    region
                        .memory
                        .io_slices(pieces)
                        .map_err(std::io::Error::other)?,
                );
            }
        }
    }
    writer.write_all_vectored(&mut bufs).await
}

async fn reader_task(
    link: Arc<PeerLink>,
    conn: ConnId,
    rail: u32,
    mut reader: Box<dyn FrameReader>,
) {
    let reason = match read_loop(&link, conn, rail, reader.as_mut()).await {
        Ok(()) => "link closed".to_string(),
        Err(TransportError::Wire(e)) => {
            metrics::counter!(m::FRAMES_REJECTED, "reason" => wire_reason(&e)).increment(1);
            format!("malformed frame: {e}")
        }
        Err(e) => e.to_string(),
    };
    link.connection_failed(conn, &reason);
}

fn wire_reason(e: &wire::WireError) -> &'static str {
    match e {
        wire::WireError::BadMagic(_) => "bad_magic",
        wire::WireError::Version(_) => "version",
        wire::WireError::UnknownKind(_) => "unknown_kind",
        wire::WireError::TooLong { .. } => "too_long",
        wire::WireError::ShortData => "short_data",
        wire::WireError::Decode(_) | wire::WireError::EmptyMessage => "decode",
    }
}

async fn read_loop(
    link: &Arc<PeerLink>,
    conn: ConnId,
    rail: u32,
    reader: &mut dyn FrameReader,
) -> Result<(), TransportError> {
    let rail_label = rail.to_string();
    loop {
        let Some(shared) = link.shared.upgrade() else {
            return Ok(());
        };
        match read_frame(reader).await? {
            Frame::Control(body) => {
                link.with_session(|s, now| s.handle_control(conn, body, now, &shared.registry));
                link.rearm_timer();
            }
            Frame::Data {
                header,
                payload_len,
            } => match link.with_session(|s, now| s.accept_slice(header, payload_len, now)) {
                SliceDisposition::Place { region_id, pieces } => {
                    let Some(region) = shared.registry.get(region_id) else {
                        reader.discard(u64::from(payload_len)).await?;
                        link.with_session(|s, _| s.slice_abandoned(header));
                        continue;
                    };
                    let read = match region.memory.io_slices_mut(&pieces) {
                        Ok(mut bufs) => reader.read_payload(&mut bufs).await,
                        Err(e) => Err(std::io::Error::other(e)),
                    };
                    if let Err(e) = read {
                        link.with_session(|s, _| s.slice_abandoned(header));
                        return Err(e.into());
                    }
                    let labels = [
                        ("peer", link.peer.clone()),
                        ("rail", rail_label.clone()),
                        ("transport", link.transport.to_string()),
                    ];
                    metrics::counter!(m::BYTES_RECEIVED, &labels).increment(u64::from(payload_len));
                    metrics::counter!(m::SLICES_RECEIVED, &labels).increment(1);
                    link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now));
                }
                SliceDisposition::Discard => {
                    debug!(peer = %link.peer, transfer = header.transfer_id, "discarding slice of an unknown or finished transfer");
                    reader.discard(u64::from(payload_len)).await?;
                }
            },
        }
    }
}

async fn timer_task(link: Weak<PeerLink>) {
    loop {
        let Some(l) = link.upgrade() else { return };
        let (deadline, closed) = {
            let st = l.lock();
            (st.session.poll_timeout(), st.closed)
        };
        if closed {
            return;
        }
        match deadline {
            Some(d) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(d)) => {
                        l.with_session(|s, now| s.handle_timeout(now));
                    }
                    _ = l.timer.notified() => {}
                }
            }
            None => l.timer.notified().await,
        }
    }
}
