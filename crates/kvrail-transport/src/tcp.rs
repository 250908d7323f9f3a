//! TCP driver: one TCP connection per kvrail connection, `TCP_NODELAY`, vectored
//! writes that gather scattered blocks and vectored reads that scatter payload
//! straight into the destination blocks. A small read-ahead lets one `recv`
//! bring a small frame whole (header, body, slice header, a few KiB of
//! payload: five system calls otherwise); past it, payload is read straight
//! into its blocks.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::{Connection, FrameReader, FrameWriter, InlineWrite, Listener, Transport};

/// Linux's "bad address": a socket call touched memory it could not use.
const EFAULT: i32 = 14;

/// The TCP transport.
#[derive(Debug, Default, Clone)]
pub struct TcpTransport;

fn split(stream: TcpStream) -> io::Result<Connection> {
    stream.set_nodelay(true)?;
    let (r, w) = stream.into_split();
    Ok(Connection {
        reader: Box::new(TcpFrameReader::new(r)),
        writer: Box::new(TcpFrameWriter { inner: Arc::new(w) }),
        peer_certificate: None,
    })
}

#[async_trait]
impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    async fn listen(&self, addr: SocketAddr) -> io::Result<Box<dyn Listener>> {
        Ok(Box::new(TcpRailListener(TcpListener::bind(addr).await?)))
    }

    async fn connect(
        &self,
        local: Option<SocketAddr>,
        remote: SocketAddr,
        _peer: &str,
    ) -> io::Result<Connection> {
        let socket = if remote.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        if let Some(local) = local {
            socket.bind(local)?;
        }
        split(socket.connect(remote).await?)
    }
}

struct TcpRailListener(TcpListener);

#[async_trait]
impl Listener for TcpRailListener {
    async fn accept(&mut self) -> io::Result<(Connection, SocketAddr)> {
        let (stream, addr) = self.0.accept().await?;
        Ok((split(stream)?, addr))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

struct TcpFrameWriter {
    /// Shared with the inline writer handle; the write half shuts down when
    /// the last of them goes.
    inner: Arc<OwnedWriteHalf>,
}

struct TcpInlineWriter(Arc<OwnedWriteHalf>);

impl InlineWrite for TcpInlineWriter {
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }
}

#[async_trait]
impl FrameWriter for TcpFrameWriter {
    fn inline_writer(&self) -> Option<Arc<dyn InlineWrite>> {
        Some(Arc::new(TcpInlineWriter(self.inner.clone())))
    }

    fn tcp_write_half(&mut self) -> Option<&mut Arc<OwnedWriteHalf>> {
        Some(&mut self.inner)
    }

    async fn write_all_vectored(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        // Skip empty leading slices so the loop ends exactly when everything is written.
        IoSlice::advance_slices(&mut bufs, 0);
        let mut touched = false;
        while !bufs.is_empty() {
            self.inner.writable().await?;
            match self.inner.try_write_vectored(bufs) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    touched = false;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // Payload of a region whose file was truncated under its mapping:
                // the kernel copy failed where a user-space read would fault.
                // Reading it here lets the SIGBUS guard put zero pages there and
                // mark the region; the frame then goes out whole (the stream
                // stays in step) and the region's transfer fails on the mark.
                Err(e) if e.raw_os_error() == Some(EFAULT) => {
                    // A second EFAULT with no progress since the touch: give up.
                    if touched || !touch_guarded(bufs.iter().map(|b| &b[..])) {
                        return Err(e);
                    }
                    touched = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// After a socket call's EFAULT: reads every page of each buffer the SIGBUS
/// guard covers, so the guard puts zero pages where a truncated file left
/// none. All of the call's buffers, not only the first: the kernel copies a
/// received segment (up to 64 KiB) or a send chunk as one piece and fails it
/// whole, so the page at fault can lie in any buffer that piece spans.
/// Memory the guard does not cover is never touched (over a truncated
/// mapping that would kill the process); false when no buffer was covered.
fn touch_guarded<'a>(bufs: impl Iterator<Item = &'a [u8]>) -> bool {
    let mut any = false;
    for b in bufs {
        if kvrail_shm::guard::covers(b) {
            kvrail_shm::guard::touch(b);
            any = true;
        }
    }
    any
}

/// Most buffers one `readv` is handed (see `read_payload`).
const READV_MAX_BUFFERS: usize = 64;

/// Bytes read ahead of what the frame parser asked for. Small, so that a large
/// payload has at most this much copied before the rest is read straight into
/// its blocks.
const READ_AHEAD_BYTES: usize = 8 << 10;

struct TcpFrameReader {
    inner: OwnedReadHalf,
    /// Read-ahead buffer; `ahead[start..end]` is not consumed yet. Empty (no
    /// read-ahead) without the SIGBUS guard: payload copied out of it is
    /// written into region memory from user space, which only the guard makes
    /// safe against a file truncated under its mapping.
    ahead: Box<[u8]>,
    start: usize,
    end: usize,
    /// What a spin for input met instead of bytes (the connection's end or
    /// an error), for the next read to return.
    met: Option<io::Error>,
}

impl TcpFrameReader {
    fn new(inner: OwnedReadHalf) -> Self {
        let len = if kvrail_shm::guard::installed() {
            READ_AHEAD_BYTES
        } else {
            0
        };
        Self::with_read_ahead(inner, len)
    }

    fn with_read_ahead(inner: OwnedReadHalf, len: usize) -> Self {
        Self {
            inner,
            ahead: vec![0; len].into_boxed_slice(),
            start: 0,
            end: 0,
            met: None,
        }
    }

    /// Moves read-ahead bytes into `dst`; returns how many.
    fn take_ahead(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.end - self.start);
        dst[..n].copy_from_slice(&self.ahead[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// What a spin met, once the bytes before it are consumed: the socket is
    /// not read again after it.
    fn take_met(&mut self) -> io::Result<()> {
        match self.met.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Reads what the socket has, up to the read-ahead's size, into it (which
    /// must be empty).
    async fn fill_ahead(&mut self) -> io::Result<()> {
        debug_assert_eq!(self.start, self.end);
        self.take_met()?;
        let n = self.inner.read(&mut self.ahead).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        (self.start, self.end) = (0, n);
        Ok(())
    }
}

/// Whether a read of `socket` would not wait (bytes, its end or an error),
/// asked with `poll`, which reads the socket's state without taking its lock:
/// a spin of `recv` calls takes the lock each round, and the sender's
/// `writev` on the same socket (which on loopback runs the receiving stack
/// too) then sleeps for it, or the reader does and must be woken (a traced
/// 4 KiB push paid a wake-up in every `writev`; docs/benchmarks.md).
fn readable_now(socket: &socket2::SockRef<'_>) -> bool {
    use rustix::event::{PollFd, PollFlags};
    let wanted = PollFlags::IN | PollFlags::RDHUP;
    let mut fds = [PollFd::new(&**socket, wanted)];
    match rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default())) {
        // Readable, or an error or hang-up the read will report.
        Ok(n) => n > 0,
        // Let the read find out.
        Err(_) => true,
    }
}

#[async_trait]
impl FrameReader for TcpFrameReader {
    fn input_pending(&mut self) -> bool {
        if self.start < self.end || self.met.is_some() {
            return true;
        }
        // A peek without waiting: Pending when the socket is (known) empty.
        let mut byte = [0u8; 1];
        let mut buf = tokio::io::ReadBuf::new(&mut byte);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match self.inner.poll_peek(&mut cx, &mut buf) {
            std::task::Poll::Ready(Ok(n)) => n > 0,
            std::task::Poll::Ready(Err(_)) => true,
            std::task::Poll::Pending => false,
        }
    }

    fn can_spin(&self) -> bool {
        // Bytes go into the read-ahead, which only the SIGBUS guard provides.
        !self.ahead.is_empty()
    }

    fn spin_for_input(&mut self, until: std::time::Instant, stop: &dyn Fn() -> bool) -> bool {
        if self.start < self.end || self.met.is_some() || !self.can_spin() {
            return false;
        }
        // A `recv` of our own: tokio's reads skip the system call until its
        // driver has seen the socket readable, which is the wake-up this
        // spin is for. The socket is non-blocking (tokio made it so).
        let socket = socket2::SockRef::from(self.inner.as_ref());
        let mut waited = false;
        loop {
            if waited && !readable_now(&socket) {
                if std::time::Instant::now() >= until || stop() {
                    return false;
                }
                // The CPU goes to any other runnable thread first: on a
                // small machine the one that sends the next frame.
                std::thread::yield_now();
                continue;
            }
            match (&*socket).read(&mut self.ahead) {
                Ok(0) => {
                    self.met = Some(io::ErrorKind::UnexpectedEof.into());
                    return waited;
                }
                Ok(n) => {
                    (self.start, self.end) = (0, n);
                    return waited;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() >= until || stop() {
                        return false;
                    }
                    waited = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.met = Some(e);
                    return waited;
                }
            }
        }
    }

    fn move_to_current_runtime(&mut self, writer: &mut dyn FrameWriter) -> io::Result<bool> {
        let Some(write_half) = writer.tcp_write_half() else {
            return Ok(false);
        };
        // An inline writer would keep writing through the old registration.
        if Arc::strong_count(write_half) != 1 {
            return Ok(false);
        }
        // A second descriptor of the same socket, registered here; the old
        // one closes without touching the connection (no shutdown: the write
        // half is forgotten, not dropped).
        let copy = socket2::SockRef::from(self.inner.as_ref()).try_clone()?;
        let stream = TcpStream::from_std(std::net::TcpStream::from(copy))?;
        let (read_half, new_write_half) = stream.into_split();
        let old_read = std::mem::replace(&mut self.inner, read_half);
        let old_write = std::mem::replace(write_half, Arc::new(new_write_half));
        if let Ok(old_write) = Arc::try_unwrap(old_write) {
            old_write.forget();
        }
        drop(old_read);
        Ok(true)
    }

    async fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut done = self.take_ahead(buf);
        while done < buf.len() {
            if buf.len() - done >= self.ahead.len() {
                self.take_met()?;
                return self.inner.read_exact(&mut buf[done..]).await.map(|_| ());
            }
            self.fill_ahead().await?;
            done += self.take_ahead(&mut buf[done..]);
        }
        Ok(())
    }

    async fn read_payload(&mut self, mut dst: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        IoSliceMut::advance_slices(&mut dst, 0);
        // What was read ahead first (a user-space copy into the blocks: the
        // guard covers a truncated file, as for the kernel's copies below).
        while !dst.is_empty() && self.start < self.end {
            let n = self.take_ahead(&mut dst[0]);
            IoSliceMut::advance_slices(&mut dst, n);
        }
        if !dst.is_empty() {
            self.take_met()?;
        }
        let mut touched = false;
        while !dst.is_empty() {
            self.inner.readable().await?;
            // The kernel copies in and checks every buffer passed, however
            // few a call fills: a scattered slice's hundreds go a bounded
            // number at a time.
            let at_once = dst.len().min(READV_MAX_BUFFERS);
            match self.inner.try_read_vectored(&mut dst[..at_once]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    IoSliceMut::advance_slices(&mut dst, n);
                    touched = false;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // Into a truncated region: as in the writer, a user-space touch
                // lets the guard map zero pages, and the read completes in step.
                Err(e) if e.raw_os_error() == Some(EFAULT) => {
                    if touched || !touch_guarded(dst[..at_once].iter().map(|b| &b[..])) {
                        return Err(e);
                    }
                    touched = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{read_frame, Frame, TransportError};
    use kvrail_core::wire::{self, Body, SliceHeader};

    #[tokio::test]
    async fn frames_cross_a_real_socket_scattered_and_gathered() {
        let t = TcpTransport;
        let mut listener = t.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let mut client = t.connect(None, addr, "peer").await.unwrap();
        let mut server = accept.await.unwrap();

        let msg = wire::message(Body::Complete(wire::pb::Complete { transfer_id: 5 }));
        client
            .writer
            .write_control(&wire::encode_control(&msg))
            .await
            .unwrap();
        let src: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        let hdr = wire::encode_data_header(
            SliceHeader {
                transfer_id: 5,
                offset: 64,
            },
            300_000,
        );
        let writer = tokio::spawn(async move {
            let parts = [
                IoSlice::new(&src[..1000]),
                IoSlice::new(&[]),
                IoSlice::new(&src[1000..]),
            ];
            client.writer.write_slice(&hdr, &parts).await.unwrap();
            client
        });

        assert!(matches!(
            read_frame(server.reader.as_mut()).await.unwrap(),
            Frame::Control(Body::Complete(_))
        ));
        let Frame::Data {
            header,
            payload_len,
        } = read_frame(server.reader.as_mut()).await.unwrap()
        else {
            panic!()
        };
        assert_eq!(
            header,
            SliceHeader {
                transfer_id: 5,
                offset: 64
            }
        );
        let mut a = vec![0u8; 7];
        let mut b = vec![0u8; payload_len as usize - 7];
        server
            .reader
            .read_payload(&mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)])
            .await
            .unwrap();
        writer.await.unwrap();
        let expect: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        assert_eq!(&a[..], &expect[..7]);
        assert_eq!(&b[..], &expect[7..]);
    }

    /// A frame reader with `ahead` bytes of read-ahead on one end of a
    /// loopback connection, the server's write half (kept open), and the
    /// client's stream.
    async fn loopback_reader(ahead: usize) -> (TcpFrameReader, OwnedWriteHalf, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let (r, keep) = server.into_split();
        (TcpFrameReader::with_read_ahead(r, ahead), keep, client)
    }

    /// A payload scattered over more buffers than one `readv` is handed
    /// lands whole and in order.
    #[tokio::test]
    async fn a_payload_over_hundreds_of_buffers_lands_in_order() {
        for ahead in [0, READ_AHEAD_BYTES] {
            let (mut reader, _keep, client) = loopback_reader(ahead).await;
            let mut client = split(client).unwrap();
            let len = 5 * READV_MAX_BUFFERS * 1000 + 123;
            let payload: Vec<u8> = (0..len).map(|b| (b % 249) as u8).collect();
            let expect = payload.clone();
            let hdr = wire::encode_data_header(
                SliceHeader {
                    transfer_id: 1,
                    offset: 0,
                },
                len as u32,
            );
            let writer = tokio::spawn(async move {
                client
                    .writer
                    .write_slice(&hdr, &[IoSlice::new(&payload)])
                    .await
                    .unwrap();
                client
            });
            let Frame::Data { payload_len, .. } = read_frame(&mut reader).await.unwrap() else {
                panic!("not a slice")
            };
            assert_eq!(payload_len as usize, len);
            let mut bufs: Vec<Vec<u8>> = (0..len.div_ceil(1000))
                .map(|i| vec![0u8; 1000.min(len - i * 1000)])
                .collect();
            let mut slices: Vec<IoSliceMut<'_>> =
                bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
            assert!(slices.len() > 4 * READV_MAX_BUFFERS);
            reader.read_payload(&mut slices).await.unwrap();
            drop(slices);
            assert_eq!(bufs.concat(), expect, "read-ahead {ahead}");
            writer.await.unwrap();
        }
    }

    /// Payload read into a mapping whose file was truncated, into buffers that
    /// do not start on a page boundary (each spans one page more than its
    /// length): the read completes over the guard's zero pages, in step with
    /// the stream, and the mapping says it was truncated. Before every page of
    /// a buffer was touched, the retry faulted again inside the same buffer
    /// and the connection ended.
    #[tokio::test]
    async fn a_read_into_a_truncated_mapping_completes_over_zero_pages() {
        let region = kvrail_shm::guard::truncated_region("tcp-trunc", 8 * 4096).unwrap();
        assert!(region.is_guarded());
        let (mut reader, _keep, mut client) = loopback_reader(0).await;
        let payload: Vec<u8> = (0..3 * 4096 + 5).map(|b| (b % 251) as u8 + 1).collect();
        let trailer = b"next frame".to_vec();
        let sent = [payload.clone(), trailer.clone()].concat();
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            client.write_all(&sent).await.unwrap();
            client
        });
        let pieces = [(100, 4096), (100 + 4096, 4096), (100 + 8192, 4096 + 5)];
        let mut bufs = region.io_slices_mut(&pieces).unwrap();
        reader.read_payload(&mut bufs).await.unwrap();
        drop(bufs);
        assert!(region.is_poisoned());
        // The stream is still in step: what follows the payload reads whole.
        let mut next = vec![0u8; trailer.len()];
        reader.read_exact(&mut next).await.unwrap();
        assert_eq!(next, trailer);
        writer.await.unwrap();
    }

    /// `input_pending` sees a frame that waits behind the one just read, in
    /// the read-ahead or in the socket, and nothing once it is read too.
    #[tokio::test]
    async fn input_pending_sees_a_waiting_frame_and_then_none() {
        for ahead in [0, READ_AHEAD_BYTES] {
            let (mut reader, _keep, client) = loopback_reader(ahead).await;
            // Both frames in one write: one segment on loopback, so the
            // second has arrived once the first can be read.
            let mut bytes = Vec::new();
            for id in [1u64, 2] {
                let msg = wire::message(Body::Complete(wire::pb::Complete { transfer_id: id }));
                bytes.extend_from_slice(&wire::encode_control(&msg));
            }
            let mut client = client.into_std().unwrap();
            client.set_nonblocking(false).unwrap();
            std::io::Write::write_all(&mut client, &bytes).unwrap();
            for (id, pending_after) in [(1u64, true), (2, false)] {
                match read_frame(&mut reader).await.unwrap() {
                    Frame::Control(Body::Complete(c)) => assert_eq!(c.transfer_id, id),
                    other => panic!("{other:?}"),
                }
                assert_eq!(
                    reader.input_pending(),
                    pending_after,
                    "read-ahead {ahead}, after frame {id}"
                );
            }
        }
    }

    /// A spin for input gives up at its deadline when nothing comes; takes a
    /// frame written while it spins (by its own `recv`: this test's runtime
    /// never polls its I/O driver during the spin), which then reads whole;
    /// does not spin with input at hand; and returns when the peer closes,
    /// the next read reporting the end. Without read-ahead there is nowhere
    /// to put bytes: it never spins.
    #[tokio::test]
    async fn a_spin_for_input_takes_a_frame_or_the_end_and_gives_up_in_time() {
        use std::time::{Duration, Instant};
        let far_off = || Instant::now() + Duration::from_secs(60);
        let (mut reader, _keep, client) = loopback_reader(READ_AHEAD_BYTES).await;
        assert!(reader.can_spin());
        let started = Instant::now();
        assert!(!reader.spin_for_input(started + Duration::from_millis(2), &|| false));
        assert!(started.elapsed() >= Duration::from_millis(2));
        // Told to stop: it gives up long before its time.
        let stopped = Instant::now();
        assert!(!reader.spin_for_input(far_off(), &|| true));
        assert!(stopped.elapsed() < Duration::from_secs(30));
        let mut client = client.into_std().unwrap();
        client.set_nonblocking(false).unwrap();
        let msg = wire::message(Body::Complete(wire::pb::Complete { transfer_id: 7 }));
        let bytes = wire::encode_control(&msg);
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn(move || {
            wait.recv().unwrap();
            std::io::Write::write_all(&mut client, &bytes).unwrap();
            client
        });
        let far = || Instant::now() + Duration::from_secs(60);
        go.send(()).unwrap();
        // True when the frame came after the spin began (almost always:
        // the writer thread must wake first); in either case it is taken.
        let _ = reader.spin_for_input(far(), &|| false);
        assert!(reader.start < reader.end, "the spin did not take the frame");
        // Input at hand: no spin.
        assert!(!reader.spin_for_input(far(), &|| false));
        let client = writer.join().unwrap();
        match read_frame(&mut reader).await.unwrap() {
            Frame::Control(Body::Complete(c)) => assert_eq!(c.transfer_id, 7),
            other => panic!("{other:?}"),
        }
        assert!(!reader.input_pending());
        drop(client);
        let _ = reader.spin_for_input(far(), &|| false);
        assert!(reader.input_pending(), "the close was not seen");
        match read_frame(&mut reader).await {
            Err(TransportError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof),
            other => panic!("{other:?}"),
        }
        let (mut bare, _keep, _client) = loopback_reader(0).await;
        assert!(!bare.can_spin());
        assert!(!bare.spin_for_input(far(), &|| false));
    }

    /// Small and large frames written back to back come out whole and in
    /// order, with and without read-ahead, payload scattered over uneven
    /// buffers (one spanning the read-ahead's end) and a discarded payload.
    #[tokio::test]
    async fn back_to_back_frames_parse_the_same_with_and_without_read_ahead() {
        for ahead in [0, READ_AHEAD_BYTES, 13] {
            let (mut reader, _keep, client) = loopback_reader(ahead).await;
            let mut client = split(client).unwrap();
            let sizes = [4096usize, 1, 3000, 300_000, 9000, 17];
            let writer = tokio::spawn(async move {
                for (i, &len) in sizes.iter().enumerate() {
                    let msg = wire::message(Body::Complete(wire::pb::Complete {
                        transfer_id: i as u64,
                    }));
                    client
                        .writer
                        .write_control(&wire::encode_control(&msg))
                        .await
                        .unwrap();
                    let payload: Vec<u8> = (0..len).map(|b| ((b + i) % 251) as u8).collect();
                    let hdr = wire::encode_data_header(
                        SliceHeader {
                            transfer_id: i as u64,
                            offset: 0,
                        },
                        len as u32,
                    );
                    client
                        .writer
                        .write_slice(&hdr, &[IoSlice::new(&payload)])
                        .await
                        .unwrap();
                }
                client
            });
            for (i, &len) in sizes.iter().enumerate() {
                match read_frame(&mut reader).await.unwrap() {
                    Frame::Control(Body::Complete(c)) => assert_eq!(c.transfer_id, i as u64),
                    other => panic!("frame {i}: {other:?}"),
                }
                let Frame::Data {
                    header,
                    payload_len,
                } = read_frame(&mut reader).await.unwrap()
                else {
                    panic!("frame {i} is not a slice")
                };
                assert_eq!((header.transfer_id, payload_len as usize), (i as u64, len));
                if i == 4 {
                    reader.discard(len as u64).await.unwrap();
                    continue;
                }
                let split_at = (len / 3).max(1).min(len);
                let mut a = vec![0u8; split_at];
                let mut b = vec![0u8; len - split_at];
                reader
                    .read_payload(&mut [
                        IoSliceMut::new(&mut a),
                        IoSliceMut::new(&mut []),
                        IoSliceMut::new(&mut b),
                    ])
                    .await
                    .unwrap();
                let expect: Vec<u8> = (0..len).map(|x| ((x + i) % 251) as u8).collect();
                assert_eq!(
                    [a, b].concat(),
                    expect,
                    "payload {i} with read-ahead {ahead}"
                );
            }
            drop(writer.await.unwrap());
            let mut eof = [0u8; 8];
            assert_eq!(
                reader.read_exact(&mut eof).await.unwrap_err().kind(),
                io::ErrorKind::UnexpectedEof
            );
        }
    }

    /// A connection moved to another runtime keeps what it read ahead,
    /// reads and writes there after its first runtime is gone, and its peer
    /// sees neither a shutdown nor an end until it is dropped; one whose
    /// writer handed out an inline writer stays where it is.
    #[test]
    fn a_connection_moved_to_another_runtime_keeps_its_bytes_and_its_peer() {
        use std::io::Write;
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let sent: Vec<u8> = (0..100u8).collect();
        let (mut conn, mut peer) = first.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let mut peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, _) = listener.accept().await.unwrap();
            let (r, w) = server.into_split();
            let mut conn = Connection {
                reader: Box::new(TcpFrameReader::with_read_ahead(r, 64)),
                writer: Box::new(TcpFrameWriter { inner: Arc::new(w) }),
                peer_certificate: None,
            };
            peer.write_all(&sent).unwrap();
            let mut head = [0u8; 10];
            conn.reader.read_exact(&mut head).await.unwrap();
            assert_eq!(head[..], sent[..10]);
            (conn, peer)
        });
        let inline = conn.writer.inline_writer();
        {
            let _in_second = second.enter();
            assert!(
                !conn.move_to_current_runtime().unwrap(),
                "an inline writer is out"
            );
            drop(inline);
            assert!(conn.move_to_current_runtime().unwrap());
        }
        drop(first);
        second.block_on(async {
            let mut rest = [0u8; 90];
            conn.reader.read_exact(&mut rest).await.unwrap();
            assert_eq!(rest[..], sent[10..]);
            conn.writer
                .write_all_vectored(&mut [IoSlice::new(b"reply")])
                .await
                .unwrap();
        });
        let mut reply = [0u8; 5];
        peer.read_exact(&mut reply).unwrap();
        assert_eq!(&reply, b"reply");
        drop(conn);
        assert_eq!(peer.read(&mut reply).unwrap(), 0, "the end, once dropped");
    }
}
