//! Transports move kvrail frames between two sidecars.
//!
//! Every driver exposes the same [`Transport`] trait: listen, connect, and a
//! connection split into a [`FrameReader`] and a [`FrameWriter`]. Payload is
//! written from, and read into, caller-provided I/O slices, so the daemon can
//! point them straight at mapped KV regions. The session logic above is the
//! same for every transport.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;

use async_trait::async_trait;
use bytes::Bytes;
use kvrail_core::wire::{self, FrameHeader, WireError, FRAME_HEADER_LEN, SLICE_HEADER_LEN};

pub mod admission;
pub mod ratelog;
pub mod tcp;

/// A transport failure, saying whether the bytes or the peer were at fault.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket failed or the peer closed it.
    #[error("connection failed: {0}")]
    Io(#[from] io::Error),
    /// The peer sent bytes that are not a kvrail frame.
    #[error("malformed frame from peer: {0}")]
    Wire(#[from] WireError),
}

/// A transport driver.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Name used in handshakes, logs and metric labels.
    fn name(&self) -> &'static str;
    /// Starts accepting connections on `addr`.
    async fn listen(&self, addr: SocketAddr) -> io::Result<Box<dyn Listener>>;
    /// Opens one connection to `remote`, from `local` when given (to pin a rail).
    /// `peer` is the node expected there; transports with TLS make it prove that name.
    async fn connect(
        &self,
        local: Option<SocketAddr>,
        remote: SocketAddr,
        peer: &str,
    ) -> io::Result<Connection>;
}

/// Accepting side of a transport.
/// How many connections each receiving socket of a listener carries now (a
/// QUIC listener's sockets share one port and the kernel spreads
/// connections over them by address hash); callable at any time.
pub type SocketLoads = std::sync::Arc<dyn Fn() -> Vec<usize> + Send + Sync>;

#[async_trait]
pub trait Listener: Send {
    async fn accept(&mut self) -> io::Result<(Connection, SocketAddr)>;
    fn local_addr(&self) -> io::Result<SocketAddr>;
    /// See [`SocketLoads`]; None where each connection has its own socket.
    fn socket_loads(&self) -> Option<SocketLoads> {
        None
    }
}

/// One connection, split so that reading and writing run concurrently.
pub struct Connection {
    pub reader: Box<dyn FrameReader>,
    pub writer: Box<dyn FrameWriter>,
    /// The peer's end-entity certificate (DER) when the transport authenticated it
    /// against the cluster CA (QUIC); the handshake checks it names the peer.
    pub peer_certificate: Option<Vec<u8>>,
}

impl Connection {
    /// Registers the connection's socket with the tokio runtime this is
    /// called in (the runtime of a thread of the connection's own), keeping
    /// whatever was read ahead: false, and nothing changed, where the
    /// transport cannot (QUIC's connections share their endpoint's task) or
    /// the writer has handed out an inline writer already.
    pub fn move_to_current_runtime(&mut self) -> io::Result<bool> {
        self.reader.move_to_current_runtime(self.writer.as_mut())
    }
}

/// Writes what the socket takes now, never waiting (see
/// [`FrameWriter::inline_writer`]).
pub trait InlineWrite: Send + Sync {
    /// Writes a prefix of `bufs` without blocking; how many bytes it took
    /// (`WouldBlock` when none fit now).
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
}

/// Writing half.
#[async_trait]
pub trait FrameWriter: Send {
    /// Writes every byte of `bufs`, in order, gathering them (frames already encoded).
    async fn write_all_vectored(&mut self, bufs: &mut [IoSlice<'_>]) -> io::Result<()>;

    /// Whether this writer keeps [`Bytes`] handed to [`Self::write_chunks`]
    /// instead of copying them (then callers should prefer that method).
    fn takes_owned_payload(&self) -> bool {
        false
    }

    /// Writes every byte of `chunks`, in order. A writer that sends from its own
    /// buffers (QUIC keeps data until the peer acknowledges it) holds the chunks
    /// rather than copying them; the default gathers them into one write.
    async fn write_chunks(&mut self, chunks: Vec<Bytes>) -> io::Result<()> {
        let mut bufs: Vec<IoSlice<'_>> = chunks.iter().map(|c| IoSlice::new(c)).collect();
        self.write_all_vectored(&mut bufs).await
    }

    /// Delivers what was written before the connection is dropped (a last
    /// message such as a refusal): dropping a writer may discard unsent bytes.
    async fn close(&mut self) -> io::Result<()> {
        Ok(())
    }

    /// Writes an encoded control frame (header included).
    async fn write_control(&mut self, frame: &[u8]) -> io::Result<()> {
        self.write_all_vectored(&mut [IoSlice::new(frame)]).await
    }

    /// A handle that writes without waiting, from any thread, for a caller
    /// that knows nothing else is being written on this connection (the
    /// sidecar writes a small transfer's frames from the submitting thread
    /// when the connection's writer is idle). `None` where the transport
    /// cannot (QUIC sends through its endpoint's task).
    fn inline_writer(&self) -> Option<std::sync::Arc<dyn InlineWrite>> {
        None
    }

    /// The TCP write half, for [`Connection::move_to_current_runtime`].
    #[doc(hidden)]
    fn tcp_write_half(&mut self) -> Option<&mut std::sync::Arc<tokio::net::tcp::OwnedWriteHalf>> {
        None
    }

    /// Writes a data frame: the 24-byte header, then the payload gathered from `payload`.
    async fn write_slice(
        &mut self,
        header: &[u8; FRAME_HEADER_LEN + SLICE_HEADER_LEN],
        payload: &[IoSlice<'_>],
    ) -> io::Result<()> {
        let mut bufs = Vec::with_capacity(payload.len() + 1);
        bufs.push(IoSlice::new(header));
        bufs.extend_from_slice(payload);
        self.write_all_vectored(&mut bufs).await
    }
}

/// Reading half.
#[async_trait]
pub trait FrameReader: Send {
    /// Reads exactly `buf.len()` bytes.
    async fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()>;
    /// Reads exactly the total length of `dst`, scattering into it.
    async fn read_payload(&mut self, dst: &mut [IoSliceMut<'_>]) -> io::Result<()>;
    /// Whether more input may already be waiting (read ahead, or in the
    /// socket). A hint that only steers batching: true when unsure.
    fn input_pending(&mut self) -> bool {
        true
    }
    /// Whether [`FrameReader::spin_for_input`] can poll this connection.
    fn can_spin(&self) -> bool {
        false
    }
    /// Polls the connection for input without sleeping until `until`, for a
    /// caller that has none at hand: true when input (or the connection's
    /// end or error, reported by the next read) arrived after the spin found
    /// the connection empty, false when it was not empty to begin with, the
    /// time passed, or the transport cannot (the caller then reads or waits
    /// as usual). It keeps a CPU busy, to spare a caller expecting a reply
    /// within microseconds its wake-up from `epoll`. It gives up as soon as
    /// `stop` says so (the thread has other work: a writer with frames).
    fn spin_for_input(&mut self, until: std::time::Instant, stop: &dyn Fn() -> bool) -> bool {
        let _ = (until, stop);
        false
    }
    /// See [`Connection::move_to_current_runtime`].
    fn move_to_current_runtime(&mut self, writer: &mut dyn FrameWriter) -> io::Result<bool> {
        let _ = writer;
        Ok(false)
    }
    /// Reads and drops `len` bytes.
    async fn discard(&mut self, len: u64) -> io::Result<()> {
        let mut scratch = vec![0u8; len.min(1 << 20) as usize];
        let mut left = len;
        while left > 0 {
            let n = left.min(scratch.len() as u64) as usize;
            self.read_exact(&mut scratch[..n]).await?;
            left -= n as u64;
        }
        Ok(())
    }
}

/// One parsed frame, minus any payload (which the caller reads where it belongs).
// A frame is returned by value once per read and consumed at once: boxing the
// control body would add an allocation to every control frame to save a copy
// of ~200 bytes on data frames.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Frame {
    Control(wire::Body),
    Data {
        header: wire::SliceHeader,
        payload_len: u32,
    },
}

/// Reads the next frame header (and control body or slice header).
pub async fn read_frame(reader: &mut dyn FrameReader) -> Result<Frame, TransportError> {
    read_frame_within(reader, wire::MAX_CONTROL_BYTES).await
}

/// Largest frame a peer may send before it is authenticated: a hello with a
/// certificate chain fits in a few KiB. Anything longer is refused from its
/// header, before its body is read (at most a transport's small read-ahead,
/// 8 KiB for TCP, may already be buffered).
pub const MAX_HANDSHAKE_FRAME_BYTES: u32 = 16 << 10;

/// Reads a handshake frame: a control frame of at most
/// [`MAX_HANDSHAKE_FRAME_BYTES`], or an error.
pub async fn read_handshake_frame(reader: &mut dyn FrameReader) -> Result<Frame, TransportError> {
    read_frame_within(reader, MAX_HANDSHAKE_FRAME_BYTES).await
}

/// As [`read_frame`], refusing control bodies over `max_control` bytes from the
/// header alone.
pub async fn read_frame_within(
    reader: &mut dyn FrameReader,
    max_control: u32,
) -> Result<Frame, TransportError> {
    let mut hdr = [0u8; FRAME_HEADER_LEN];
    reader.read_exact(&mut hdr).await?;
    match wire::decode_frame_header(&hdr)? {
        FrameHeader::Control { len } if len > max_control => {
            Err(TransportError::Wire(wire::WireError::TooLong {
                len,
                max: max_control,
            }))
        }
        FrameHeader::Control { len } => {
            let mut body = vec![0u8; len as usize];
            reader.read_exact(&mut body).await?;
            Ok(Frame::Control(wire::decode_control(&body)?))
        }
        FrameHeader::Data { payload_len } => {
            let mut sh = [0u8; SLICE_HEADER_LEN];
            reader.read_exact(&mut sh).await?;
            Ok(Frame::Data {
                header: wire::decode_slice_header(&sh),
                payload_len,
            })
        }
    }
}
