//! A connection's reader task: frames off the wire, payload straight into the
//! destination blocks, control messages into the session.

use super::gpu_staging::receive_staged;
use super::*;

pub(super) async fn reader_task(
    link: Arc<PeerLink>,
    key: ConnKey,
    counters: m::ConnCounters,
    mut reader: Box<dyn FrameReader>,
) {
    let reason = match read_loop(&link, key.0, &counters, reader.as_mut()).await {
        Ok(()) => "link closed".to_string(),
        Err(TransportError::Wire(e)) => {
            metrics::counter!(m::FRAMES_REJECTED, "reason" => wire_reason(&e)).increment(1);
            format!("malformed frame: {e}")
        }
        Err(e) => e.to_string(),
    };
    link.connection_failed(key, &reason);
}

pub(super) fn wire_reason(e: &wire::WireError) -> &'static str {
    match e {
        wire::WireError::BadMagic(_) => "bad_magic",
        wire::WireError::Version(_) => "version",
        wire::WireError::UnknownKind(_) => "unknown_kind",
        wire::WireError::TooLong { .. } => "too_long",
        wire::WireError::ShortData => "short_data",
        wire::WireError::Decode(_) | wire::WireError::EmptyMessage => "decode",
    }
}

pub(super) async fn read_loop(
    link: &Arc<PeerLink>,
    conn: ConnId,
    counters: &m::ConnCounters,
    reader: &mut dyn FrameReader,
) -> Result<(), TransportError> {
    loop {
        let Some(env) = link.env.upgrade() else {
            return Ok(());
        };
        match read_frame(reader).await? {
            Frame::Control(Body::RdmaConnect(req)) => link.on_rdma_connect(conn, req),
            Frame::Control(Body::RdmaAccept(a)) => link.on_rdma_accept(a),
            Frame::Control(body) => {
                let dir = env.directory();
                let last = !reader.input_pending();
                inline::with_inline_control(last, || {
                    link.with_session(|s, now| s.handle_control(conn, body, now, &dir))
                });
                link.rearm_timer();
            }
            Frame::Data {
                header,
                payload_len,
            } => match link.with_session(|s, now| s.accept_slice(conn, header, payload_len, now)) {
                SliceDisposition::Place { region_id, pieces } => {
                    let Some(region) = env.registry().get(region_id) else {
                        reader.discard(u64::from(payload_len)).await?;
                        link.with_session(|s, _| s.slice_abandoned(conn, header));
                        continue;
                    };
                    let host = match &region.memory {
                        RegionMemory::Host(host) => host,
                        RegionMemory::Gpu(g) => {
                            receive_staged(link, conn, header, payload_len, pieces, g, reader)
                                .await?;
                            continue;
                        }
                    };
                    let read = match host.io_slices_mut(&pieces) {
                        Ok(mut bufs) => reader.read_payload(&mut bufs).await,
                        Err(e) => Err(std::io::Error::other(e)),
                    };
                    if let Err(e) = read {
                        link.with_session(|s, _| s.slice_abandoned(conn, header));
                        return Err(e.into());
                    }
                    let end = pieces.iter().map(|(o, l)| o + l).max().unwrap_or(0);
                    if let Err(e) = host.check_intact(0, end) {
                        // The worker shrank the file under us: the bytes went to
                        // zero pages; this transfer fails, the connection goes on.
                        let reason = e.to_string();
                        link.with_session(|s, now| {
                            s.placement_failed_with(
                                conn,
                                header,
                                ErrorCode::RegionTruncated,
                                &reason,
                                now,
                            )
                        });
                        continue;
                    }
                    counters.bytes_received.increment(u64::from(payload_len));
                    counters.slices_received.increment(1);
                    let last = !reader.input_pending();
                    inline::with_inline_control(last, || {
                        link.with_session(|s, now| s.slice_placed(conn, header, payload_len, now))
                    });
                }
                SliceDisposition::Discard => {
                    debug!(peer = %link.peer, transfer = header.transfer_id, "discarding slice of an unknown or finished transfer");
                    reader.discard(u64::from(payload_len)).await?;
                }
            },
        }
    }
}
