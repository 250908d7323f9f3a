//! TCP driver: one TCP connection per kvrail connection, `TCP_NODELAY`, vectored
//! writes that gather scattered blocks and vectored reads that scatter payload
//! straight into the destination blocks, with no intermediate buffer.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;

use async_trait::async_trait;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::{Connection, FrameReader, FrameWriter, Listener, Transport};

/// Linux's "bad address": a socket call touched memory it could not use.
const EFAULT: i32 = 14;

/// The TCP transport.
#[derive(Debug, Default, Clone)]
pub struct TcpTransport;

fn split(stream: TcpStream) -> io::Result<Connection> {
    stream.set_nodelay(true)?;
    let (r, w) = stream.into_split();
    Ok(Connection {
        reader: Box::new(TcpFrameReader { inner: r }),
        writer: Box::new(TcpFrameWriter { inner: w }),
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
    inner: OwnedWriteHalf,
}

#[async_trait]
impl FrameWriter for TcpFrameWriter {
    async fn write_all_vectored(&mut self, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
        // Skip empty leading slices so the loop ends exactly when everything is written.
        IoSlice::advance_slices(&mut bufs, 0);
        let mut touched_at = None;
        while !bufs.is_empty() {
            self.inner.writable().await?;
            match self.inner.try_write_vectored(bufs) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // Payload of a region whose file was truncated under its mapping:
                // the kernel copy failed where a user-space read would fault.
                // Reading it here lets the SIGBUS guard put zero pages there and
                // mark the region; the frame then goes out whole (the stream
                // stays in step) and the region's transfer fails on the mark.
                Err(e) if e.raw_os_error() == Some(EFAULT) => {
                    let here = bufs.len();
                    if touched_at == Some(here) || !kvrail_shm::guard::installed() {
                        return Err(e);
                    }
                    touched_at = Some(here);
                    kvrail_shm::guard::touch(&bufs[0]);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

struct TcpFrameReader {
    inner: OwnedReadHalf,
}

#[async_trait]
impl FrameReader for TcpFrameReader {
    async fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_exact(buf).await.map(|_| ())
    }

    async fn read_payload(&mut self, mut dst: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        IoSliceMut::advance_slices(&mut dst, 0);
        let mut touched_at = None;
        while !dst.is_empty() {
            self.inner.readable().await?;
            match self.inner.try_read_vectored(dst) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => IoSliceMut::advance_slices(&mut dst, n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                // Into a truncated region: as in the writer, a user-space touch
                // lets the guard map zero pages, and the read completes in step.
                Err(e) if e.raw_os_error() == Some(EFAULT) => {
                    let here = dst.len();
                    if touched_at == Some(here) || !kvrail_shm::guard::installed() {
                        return Err(e);
                    }
                    touched_at = Some(here);
                    kvrail_shm::guard::touch(&dst[0]);
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
    use crate::{read_frame, Frame};
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
}
