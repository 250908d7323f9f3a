//! Rust client for a local kvrail sidecar.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvrail_client::ClientError> {
//! use kvrail_client::{Client, KvRegion, dense_layout};
//! let mut client = Client::connect("/tmp/kvrail-prefill.sock").await?;
//! let layout = dense_layout(32, 2, 1024, 16 * 8 * 128 * 2);
//! let kv = KvRegion::create("/dev/shm/kvrail-prefill-kv", layout)?;
//! let region = client.register_region("prefill-0", &kv, true).await?;
//! # let _ = region; Ok(()) }
//! ```

pub mod gpu;
pub mod ring;
mod ring_submit;

pub use ring_submit::SubmitPath;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
pub use kvrail_proto as proto;
use kvrail_proto::sidecar_client::SidecarClient;
use kvrail_proto::*;
pub use kvrail_shm::{SharedRegion, ShmError};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::Streaming;

/// What went wrong talking to the sidecar.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The sidecar's socket could not be reached.
    #[error("cannot reach the sidecar at {path}: {source}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    /// The sidecar refused the call; the status says why.
    #[error("sidecar refused the call: {0}")]
    Rejected(#[from] tonic::Status),
    /// The local shared-memory file could not be prepared.
    #[error(transparent)]
    Shm(#[from] ShmError),
    #[error("ring: {0}")]
    Ring(String),
}

impl ClientError {
    /// The gRPC code, when the sidecar answered.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Rejected(s) => Some(s.code()),
            _ => None,
        }
    }
}

/// A dense vLLM-style layout: each layer is `[planes, num_blocks, block_bytes]`, layers back to back.
pub fn dense_layout(
    num_layers: u32,
    planes_per_layer: u32,
    num_blocks: u32,
    block_bytes: u64,
) -> RegionLayout {
    kvrail_core::RegionLayout::dense(num_layers, planes_per_layer, num_blocks, block_bytes).into()
}

/// Bytes a layout spans.
pub fn layout_extent(l: &RegionLayout) -> u64 {
    kvrail_core::RegionLayout::from(l).extent()
}

/// Byte offset of block `(layer, plane, block)` under `l`.
pub fn block_offset(l: &RegionLayout, layer: u32, plane: u32, block: u32) -> u64 {
    kvrail_core::RegionLayout::from(l).block_offset(layer, plane, block)
}

/// Where shared KV files belong: `/dev/shm` (a tmpfs, as in production) when it
/// exists, else the system temporary directory.
pub fn shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A worker's paged KV cache in shared memory, with the layout that describes it.
#[derive(Debug)]
pub struct KvRegion {
    pub memory: SharedRegion,
    pub layout: RegionLayout,
}

impl KvRegion {
    /// Creates the shared file (usually under `/dev/shm`) sized for `layout`.
    pub fn create(path: impl AsRef<Path>, layout: RegionLayout) -> Result<Self, ShmError> {
        let memory = SharedRegion::create(path, layout_extent(&layout))?;
        Ok(Self { memory, layout })
    }

    /// Byte offset of one block.
    pub fn block_offset(&self, layer: u32, plane: u32, block: u32) -> u64 {
        block_offset(&self.layout, layer, plane, block)
    }

    pub fn write_block(
        &self,
        layer: u32,
        plane: u32,
        block: u32,
        data: &[u8],
    ) -> Result<(), ShmError> {
        self.memory
            .write_at(self.block_offset(layer, plane, block), data)
    }

    pub fn read_block(&self, layer: u32, plane: u32, block: u32) -> Result<Vec<u8>, ShmError> {
        let mut out = vec![0u8; self.layout.block_bytes as usize];
        self.memory
            .read_at(self.block_offset(layer, plane, block), &mut out)?;
        Ok(out)
    }

    /// Removes the backing file (the mapping stays valid until dropped).
    pub fn unlink(&self) {
        let _ = std::fs::remove_file(self.memory.path());
    }
}

/// Blocks of a region: every plane of `layers` for each id in `block_ids`.
pub fn blocks(region_id: u64, layers: std::ops::Range<u32>, block_ids: Vec<u32>) -> BlockRange {
    BlockRange {
        region_id,
        layer_start: layers.start,
        layer_count: layers.end.saturating_sub(layers.start),
        block_ids,
        generations: Vec::new(),
        slice: None,
        first_token: 0,
    }
}

/// A connection to the local sidecar.
#[derive(Debug, Clone)]
pub struct Client {
    inner: SidecarClient<Channel>,
    submit_path: SubmitPath,
    /// Shared by clones: one ring per worker id.
    rings: std::sync::Arc<ring_submit::RingSubmitters>,
}

/// Refuses a socket served by a process of another user than ours or root:
/// in a shared directory such as /tmp, another user could bind the sidecar's
/// path first and pose as it (shared-memory paths and block ids would go to
/// them, and their answers would be trusted).
fn check_server_user(stream: &UnixStream, path: &Path) -> std::io::Result<()> {
    let server = stream.peer_cred()?;
    let me = effective_uid();
    if server.uid() == me || server.uid() == 0 {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!(
            "{} is served by uid {} (pid {:?}), neither this user ({me}) nor root: refusing it (another user may pose as the sidecar; give the sidecar a --socket in a directory only its user may write)",
            path.display(),
            server.uid(),
            server.pid()
        ),
    ))
}

/// This process's effective uid, from the owner of a file it creates, with
/// no unsafe code: `/proc/self` belongs to the effective uid.
fn effective_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

impl Client {
    /// Connects over the sidecar's Unix socket.
    pub async fn connect(socket: impl AsRef<Path>) -> Result<Self, ClientError> {
        let path = socket.as_ref().to_path_buf();
        let p = path.clone();
        // The URI is required by the API but unused: every connection goes to the socket.
        let channel = Endpoint::from_static("http://kvrail.local")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move {
                    let stream = UnixStream::connect(&p).await?;
                    check_server_user(&stream, &p)?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|source| ClientError::Connect { path, source })?;
        Ok(Self {
            inner: SidecarClient::new(channel)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
            submit_path: SubmitPath::default(),
            rings: Default::default(),
        })
    }

    /// Picks how [`Client::push`] and [`Client::pull`] reach the sidecar
    /// (default: the worker's ring where the sidecar serves one).
    pub fn with_submit_path(mut self, path: SubmitPath) -> Self {
        self.submit_path = path;
        self
    }

    /// Starts a transfer through the ring when that is the path and it can
    /// take it, else through gRPC.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        &mut self,
        op: ring_submit::Op,
        worker_id: &str,
        request_id: &str,
        peer: &str,
        source: BlockRange,
        destination: BlockRange,
        group: Option<TransferGroup>,
        receiver_group: Option<TransferGroup>,
    ) -> Result<TransferAccepted, ClientError> {
        // Ring slots carry whole-block selections and no group; head slices
        // and grouped transfers go by gRPC.
        let sliced = [&source, &destination]
            .iter()
            .any(|b| b.slice.is_some() || b.first_token != 0);
        let grouped = group.is_some() || receiver_group.is_some();
        if self.submit_path == SubmitPath::Ring && !sliced && !grouped {
            let rings = self.rings.clone();
            let call = ring_submit::TransferCall {
                op,
                worker_id,
                request_id,
                peer,
                source: &source,
                destination: &destination,
            };
            if let Some(answer) = rings.start(self, &call).await {
                return answer;
            }
        }
        let r = match op {
            ring_submit::Op::Push => {
                self.inner
                    .push(PushRequest {
                        request_id: request_id.into(),
                        worker_id: worker_id.into(),
                        peer: peer.into(),
                        source: Some(source),
                        destination: Some(destination),
                        group,
                        receiver_group,
                    })
                    .await?
            }
            ring_submit::Op::Pull => {
                self.inner
                    .pull(PullRequest {
                        request_id: request_id.into(),
                        worker_id: worker_id.into(),
                        peer: peer.into(),
                        source: Some(source),
                        destination: Some(destination),
                        group,
                    })
                    .await?
            }
        };
        Ok(r.into_inner())
    }

    /// Pushes `source` into `peer`'s `destination` as a member of the
    /// receiving worker's `receiver_group`: that worker hears of the group's
    /// pushes once, whoever sent them (see `PushRequest.receiver_group` in
    /// sidecar.proto). By gRPC.
    pub async fn push_to_receiver_group(
        &mut self,
        worker_id: &str,
        request_id: &str,
        peer: &str,
        source: BlockRange,
        destination: BlockRange,
        receiver_group: TransferGroup,
    ) -> Result<TransferAccepted, ClientError> {
        self.start(
            ring_submit::Op::Push,
            worker_id,
            request_id,
            peer,
            source,
            destination,
            None,
            Some(receiver_group),
        )
        .await
    }

    /// Registers a region; returns its id on this sidecar.
    pub async fn register_region(
        &mut self,
        worker_id: &str,
        kv: &KvRegion,
        expose_to_peers: bool,
    ) -> Result<u64, ClientError> {
        self.register_path(worker_id, kv.memory.path(), kv.layout, expose_to_peers)
            .await
    }

    /// Registers a shared file by path with an explicit layout.
    pub async fn register_path(
        &mut self,
        worker_id: &str,
        path: &Path,
        layout: RegionLayout,
        expose_to_peers: bool,
    ) -> Result<u64, ClientError> {
        self.register_with_geometry(worker_id, path, layout, None, expose_to_peers)
            .await
    }

    /// Registers a shared file whose blocks hold one rank's shard of a
    /// model's KV cache as `geometry` says (head-sliced transfers need it).
    pub async fn register_with_geometry(
        &mut self,
        worker_id: &str,
        path: &Path,
        layout: RegionLayout,
        geometry: Option<kvrail_proto::KvGeometry>,
        expose_to_peers: bool,
    ) -> Result<u64, ClientError> {
        let r = self
            .inner
            .register_region(RegisterRegionRequest {
                worker_id: worker_id.into(),
                shm_path: path.to_string_lossy().into_owned(),
                layout: Some(layout),
                expose_to_peers,
                cuda_ipc: None,
                geometry,
            })
            .await?;
        Ok(r.into_inner().region_id)
    }

    /// Registers GPU memory: `ipc_handle` is the 64-byte CUDA IPC handle of a
    /// `cuMemAlloc`/`cudaMalloc` allocation on `device`, laid out as `layout` from
    /// the handle's address. The sidecar opens it for the region's lifetime.
    pub async fn register_gpu(
        &mut self,
        worker_id: &str,
        ipc_handle: &[u8],
        device: u32,
        layout: RegionLayout,
        expose_to_peers: bool,
    ) -> Result<u64, ClientError> {
        let r = self
            .inner
            .register_region(RegisterRegionRequest {
                worker_id: worker_id.into(),
                shm_path: String::new(),
                layout: Some(layout),
                expose_to_peers,
                cuda_ipc: Some(CudaIpcMemory {
                    handle: ipc_handle.to_vec(),
                    device,
                }),
                geometry: None,
            })
            .await?;
        Ok(r.into_inner().region_id)
    }

    pub async fn unregister_region(&mut self, region_id: u64) -> Result<(), ClientError> {
        self.inner
            .unregister_region(UnregisterRegionRequest { region_id })
            .await?;
        Ok(())
    }

    /// The current generation of each listed block of a local region: hand them
    /// to the other side with the block ids (`BlockRange::generations`), so a
    /// transfer can never move these blocks once they are released.
    pub async fn block_generations(
        &mut self,
        region_id: u64,
        block_ids: Vec<u32>,
    ) -> Result<Vec<u64>, ClientError> {
        let r = self
            .inner
            .block_generations(BlockGenerationsRequest {
                region_id,
                block_ids,
            })
            .await?;
        Ok(r.into_inner().generations)
    }

    /// Releases blocks of a local region (the worker freed them or will reuse
    /// them): their generations move on and every transfer naming them fails
    /// (`blocks_released`) before this returns. The new generations, and how
    /// many transfers failed.
    pub async fn release_blocks(
        &mut self,
        region_id: u64,
        block_ids: Vec<u32>,
    ) -> Result<(Vec<u64>, u32), ClientError> {
        let r = self
            .inner
            .release_blocks(ReleaseBlocksRequest {
                region_id,
                block_ids,
            })
            .await?
            .into_inner();
        Ok((r.generations, r.transfers_failed))
    }

    /// Writes local `source` blocks into `destination` blocks of a region on
    /// `peer` (through the worker's ring by default: see [`SubmitPath`]).
    pub async fn push(
        &mut self,
        worker_id: &str,
        request_id: &str,
        peer: &str,
        source: BlockRange,
        destination: BlockRange,
    ) -> Result<TransferAccepted, ClientError> {
        self.start(
            ring_submit::Op::Push,
            worker_id,
            request_id,
            peer,
            source,
            destination,
            None,
            None,
        )
        .await
    }

    /// Reads `source` blocks of an exposed region on `peer` into local
    /// `destination` blocks (through the worker's ring by default).
    pub async fn pull(
        &mut self,
        worker_id: &str,
        request_id: &str,
        peer: &str,
        source: BlockRange,
        destination: BlockRange,
    ) -> Result<TransferAccepted, ClientError> {
        self.start(
            ring_submit::Op::Pull,
            worker_id,
            request_id,
            peer,
            source,
            destination,
            None,
            None,
        )
        .await
    }

    /// Starts a push or pull (`push`) that completes as one with the other
    /// members of `group`: the worker is notified once for the group
    /// (`request_id` = the group id), when all are done or at the first
    /// failure (see `TransferGroup` in sidecar.proto). By gRPC.
    #[allow(clippy::too_many_arguments)]
    pub async fn start_in_group(
        &mut self,
        push: bool,
        worker_id: &str,
        request_id: &str,
        peer: &str,
        source: BlockRange,
        destination: BlockRange,
        group: TransferGroup,
    ) -> Result<TransferAccepted, ClientError> {
        let op = if push {
            ring_submit::Op::Push
        } else {
            ring_submit::Op::Pull
        };
        self.start(
            op,
            worker_id,
            request_id,
            peer,
            source,
            destination,
            Some(group),
            None,
        )
        .await
    }

    /// Waits for a transfer to finish; `None` waits without limit.
    pub async fn wait(
        &mut self,
        transfer_id: u64,
        timeout: Option<Duration>,
    ) -> Result<TransferStatus, ClientError> {
        let timeout_ms = timeout
            .map(|t| t.as_millis().clamp(1, u128::from(u32::MAX)) as u32)
            .unwrap_or(0);
        Ok(self
            .inner
            .wait(WaitRequest {
                transfer_id,
                timeout_ms,
            })
            .await?
            .into_inner())
    }

    pub async fn get_transfer(&mut self, transfer_id: u64) -> Result<TransferStatus, ClientError> {
        Ok(self
            .inner
            .get_transfer(GetTransferRequest { transfer_id })
            .await?
            .into_inner())
    }

    pub async fn cancel(&mut self, transfer_id: u64) -> Result<TransferStatus, ClientError> {
        Ok(self
            .inner
            .cancel(CancelRequest { transfer_id })
            .await?
            .into_inner())
    }

    /// Every notification for `worker_id`, including any queued before subscribing.
    pub async fn subscribe(
        &mut self,
        worker_id: &str,
    ) -> Result<Streaming<Notification>, ClientError> {
        self.subscribe_after(worker_id, 0, false).await
    }

    /// Subscribes from a resume point: notifications numbered above
    /// `after_sequence` first (the last `sequence` this worker saw, in the
    /// sidecar incarnation it saw it: pass both from that notification, or 0
    /// for the incarnation), and with `take_over` replaces a live subscription
    /// of the same worker. A stream left unread until the sidecar holds 128
    /// MiB of notifications for it ends `RESOURCE_EXHAUSTED`: resume it so.
    pub async fn subscribe_after(
        &mut self,
        worker_id: &str,
        after_sequence: u64,
        take_over: bool,
    ) -> Result<Streaming<Notification>, ClientError> {
        self.resume(worker_id, after_sequence, 0, take_over).await
    }

    /// As [`Client::subscribe_after`], with the incarnation the resume point
    /// belongs to: after a sidecar restart everything it retained is delivered.
    pub async fn resume(
        &mut self,
        worker_id: &str,
        after_sequence: u64,
        incarnation: u64,
        take_over: bool,
    ) -> Result<Streaming<Notification>, ClientError> {
        Ok(self
            .inner
            .subscribe(SubscribeRequest {
                worker_id: worker_id.into(),
                after_sequence,
                take_over,
                incarnation,
            })
            .await?
            .into_inner())
    }

    pub async fn list_peers(&mut self) -> Result<ListPeersResponse, ClientError> {
        Ok(self
            .inner
            .list_peers(ListPeersRequest {})
            .await?
            .into_inner())
    }

    /// Sends a small message from `from_worker` to `to_worker` on `peer`
    /// (topic at most 256 bytes, payload at most 16 KiB); it arrives there as
    /// a MESSAGE notification if that worker has subscribed to its sidecar.
    pub async fn send_message(
        &mut self,
        from_worker: &str,
        peer: &str,
        to_worker: &str,
        topic: &str,
        payload: Vec<u8>,
    ) -> Result<(), ClientError> {
        self.inner
            .send_message(SendMessageRequest {
                worker_id: from_worker.to_string(),
                peer: peer.to_string(),
                to_worker: to_worker.to_string(),
                topic: topic.to_string(),
                payload,
            })
            .await?;
        Ok(())
    }
}

/// Whether a status is final.
pub fn is_final(s: &TransferStatus) -> bool {
    s.state == TransferState::Done as i32 || s.state == TransferState::Failed as i32
}
