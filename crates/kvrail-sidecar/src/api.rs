//! The local worker API (gRPC over a Unix socket). Every request is validated
//! before it touches memory or a peer; each problem has its own status code.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kvrail_core::{BlockSelection, RegionLayout};
use kvrail_proto::sidecar_server::{Sidecar, SidecarServer};
use kvrail_proto::*;
use kvrail_shm::ShmError;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::info;

use crate::daemon::Shared;
use crate::daemon::{ReleaseError, UnregisterError};
use crate::metrics as m;
use crate::regions::{RegionSource, RegisterError};
use crate::transfers::TransferRecord;

/// The API socket file this daemon bound (device and inode): it removes the
/// path on exit only while the path is still that file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundSocket {
    dev: u64,
    ino: u64,
}

impl BoundSocket {
    fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path).ok()?;
        Some(Self {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Removes `path` if it is still the socket this daemon bound (another
    /// daemon may have taken the path over since, after this one stopped
    /// answering).
    pub fn remove_if_ours(self, path: &Path) {
        if Self::of(path) == Some(self) {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Binds the API socket (mode 0600) and serves it in the background.
pub async fn serve(
    shared: Arc<Shared>,
    socket: &Path,
) -> anyhow::Result<(JoinHandle<()>, Option<BoundSocket>)> {
    if let Ok(meta) = std::fs::symlink_metadata(socket) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket", socket.display());
        }
        // A live daemon answers on it: taking the path would cut its workers
        // off. Only a socket nobody listens on (left by a run that died) goes.
        match std::os::unix::net::UnixStream::connect(socket) {
            Ok(_) => anyhow::bail!(
                "{} is in use: another sidecar is serving it (stop it, or give this one another --socket)",
                socket.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(socket)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => anyhow::bail!(
                "{} belongs to another user ({e}): give this sidecar a --socket of its own",
                socket.display()
            ),
            Err(e) => anyhow::bail!(
                "{} exists and cannot be checked for a running sidecar: {e}",
                socket.display()
            ),
        }
    }
    let listener = bind_private(socket).map_err(|e| {
        let dir = socket
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        match e.kind() {
            std::io::ErrorKind::NotFound => anyhow::anyhow!(
                "cannot bind {}: the directory {} does not exist (create it, e.g. `install -d -m 0755 {}`, or systemd's RuntimeDirectory=)",
                socket.display(),
                dir.display(),
                dir.display()
            ),
            std::io::ErrorKind::PermissionDenied => anyhow::anyhow!(
                "cannot bind {}: no permission to create it in {} ({e}); choose a --socket in a directory this user may write",
                socket.display(),
                dir.display()
            ),
            _ => anyhow::anyhow!("cannot bind {}: {e}", socket.display()),
        }
    })?;
    let bound = BoundSocket::of(socket);
    let service = SidecarServer::new(Api { shared }).max_decoding_message_size(64 << 20);
    let incoming = UnixListenerStream::new(listener);
    let task = tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::error!("API server stopped: {e}");
        }
    });
    Ok((task, bound))
}

/// Binds a Unix socket that only this user can ever connect to, whatever the
/// umask: it is bound inside a fresh directory of mode 0700, made 0600 there,
/// and only then linked to `socket` (a link is atomic, so no other user can
/// reach the socket while its mode is still the umask's).
fn bind_private(socket: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::DirBuilderExt;
    let parent = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "kvrail.sock".into());
    let private = parent.join(format!(
        ".{name}.{}.{:x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::DirBuilder::new().mode(0o700).create(&private)?;
    let staged = private.join("socket");
    let bound = UnixListener::bind(&staged).and_then(|listener| {
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))?;
        // A link, not a rename: it never replaces a socket another sidecar
        // put at the path since the check (a rename would, silently).
        std::fs::hard_link(&staged, socket).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                std::io::Error::new(
                    e.kind(),
                    "another sidecar took the path while this one was starting",
                )
            } else {
                e
            }
        })?;
        Ok(listener)
    });
    let _ = std::fs::remove_file(&staged);
    let _ = std::fs::remove_dir(&private);
    bound
}

struct Api {
    shared: Arc<Shared>,
}

fn selection_of(b: &BlockRange) -> BlockSelection {
    BlockSelection {
        region_id: b.region_id,
        layer_start: b.layer_start,
        layer_count: b.layer_count,
        block_ids: b.block_ids.clone(),
        generations: b.generations.clone(),
        slice: b.slice.as_ref().map(kvrail_core::HeadSlice::from),
        first_token: b.first_token,
    }
}

fn require<'a, T>(field: &'a Option<T>, name: &str) -> Result<&'a T, Status> {
    field
        .as_ref()
        .ok_or_else(|| Status::invalid_argument(format!("{name} is required")))
}

use crate::submit::require_text;

fn check_block_count(blocks: &[u32]) -> Result<(), Status> {
    if blocks.is_empty() || blocks.len() > kvrail_core::MAX_BLOCKS_PER_TRANSFER {
        return Err(Status::invalid_argument(format!(
            "list 1..={} block ids (got {})",
            kvrail_core::MAX_BLOCKS_PER_TRANSFER,
            blocks.len()
        )));
    }
    Ok(())
}

fn shm_status(e: &ShmError) -> Status {
    match e {
        ShmError::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Status::not_found(e.to_string())
        }
        ShmError::Open { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            Status::permission_denied(e.to_string())
        }
        ShmError::OutOfBounds { .. }
        | ShmError::NotSharedMemory { .. }
        | ShmError::Symlink(_)
        | ShmError::Relative(_)
        | ShmError::NotAFile(_) => Status::invalid_argument(e.to_string()),
        ShmError::NotOwner { .. } => Status::permission_denied(e.to_string()),
        ShmError::GuardFull(_) => Status::resource_exhausted(e.to_string()),
        _ => Status::failed_precondition(e.to_string()),
    }
}

fn gpu_status(e: &kvrail_cuda::CudaError) -> Status {
    use kvrail_cuda::CudaError as E;
    match e {
        E::NoDriver | E::NoDevice { .. } => Status::failed_precondition(e.to_string()),
        E::BadHandle(_) | E::TooLarge { .. } | E::OutOfBounds(_) => {
            Status::invalid_argument(e.to_string())
        }
        E::Driver { .. } | E::QueueStopped => Status::internal(e.to_string()),
    }
}

impl Api {
    /// Common path of Push and Pull.
    #[allow(clippy::too_many_arguments)]
    async fn start(
        &self,
        push: bool,
        request_id: &str,
        worker_id: &str,
        peer: &str,
        source: &BlockRange,
        destination: &BlockRange,
        group: Option<&kvrail_proto::TransferGroup>,
        receiver_group: Option<&kvrail_proto::TransferGroup>,
    ) -> Result<TransferAccepted, Status> {
        let (local, remote) = if push {
            (source, destination)
        } else {
            (destination, source)
        };
        crate::submit::start_transfer(
            &self.shared,
            crate::submit::Start {
                push,
                request_id,
                worker_id,
                peer,
                local: selection_of(local),
                remote: selection_of(remote),
                group,
                receiver_group,
            },
        )
        .await
        .map_err(|r| r.status)
    }

    fn record(&self, id: u64) -> Result<Arc<TransferRecord>, Status> {
        self.shared
            .transfers
            .get(id)
            .ok_or_else(|| Status::not_found(format!("unknown transfer {id}")))
    }

    fn live_status(&self, rec: &TransferRecord) -> TransferStatus {
        let mut s = rec.current();
        if !crate::transfers::is_final(&s) {
            if let Some(link) = rec.link.upgrade() {
                if let Some((state, done, _)) = link.inspect(|sess| sess.progress(rec.id)) {
                    s.bytes_done = done;
                    // Waiting for the peer's grant, nothing has moved yet.
                    if !matches!(
                        state,
                        kvrail_core::TransferState::Queued
                            | kvrail_core::TransferState::AwaitingGrant
                    ) {
                        s.state = TransferState::InFlight as i32;
                    }
                }
            }
            s.elapsed_us = rec.started.elapsed().as_micros() as u64;
        }
        s
    }
}

type NotificationStream = Pin<Box<dyn Stream<Item = Result<Notification, Status>> + Send>>;

#[tonic::async_trait]
impl Sidecar for Api {
    async fn register_region(
        &self,
        req: Request<RegisterRegionRequest>,
    ) -> Result<Response<RegisterRegionResponse>, Status> {
        let cred = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred);
        let owner_pid = cred.and_then(|c| c.pid());
        let caller = kvrail_shm::Caller {
            uid: cred.map(|c| c.uid()),
        };
        let req = req.into_inner();
        require_text(&req.worker_id, "worker_id")?;
        let layout = RegionLayout::from(require(&req.layout, "layout")?);
        let geometry = req
            .geometry
            .as_ref()
            .map(kvrail_core::KvGeometry::try_from)
            .transpose()
            .map_err(Status::invalid_argument)?;
        if let Some(g) = &geometry {
            layout
                .validate(u64::MAX)
                .map_err(|e| Status::invalid_argument(format!("invalid layout: {e}")))?;
            g.validate(&layout)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
        }
        // Opening the file (path lookups a hung filesystem can stall), CUDA
        // set-up, the generations and RDMA pinning all block: on the blocking
        // pool, not on the runtime's few workers that serve everyone else.
        let shared = self.shared.clone();
        let (worker_id, shm_path, cuda_ipc, exposed) = (
            req.worker_id.clone(),
            req.shm_path.clone(),
            req.cuda_ipc.clone(),
            req.expose_to_peers,
        );
        let registering = tokio::task::spawn_blocking(move || {
            let source = match (&cuda_ipc, shm_path.is_empty()) {
                (Some(_), false) => {
                    return Err(Status::invalid_argument(
                        "give either shm_path or cuda_ipc, not both",
                    ))
                }
                (None, true) => {
                    return Err(Status::invalid_argument(
                        "shm_path (host memory) or cuda_ipc (GPU memory) is required",
                    ))
                }
                (None, false) => RegionSource::Shm(Path::new(&shm_path), caller),
                (Some(ipc), true) => {
                    let device = shared.gpus.device(ipc.device).map_err(|e| gpu_status(&e))?;
                    RegionSource::Gpu {
                        device,
                        handle: &ipc.handle,
                    }
                }
            };
            let region = shared
                .registry
                .register(&worker_id, owner_pid, source, layout, geometry, exposed)
                .map_err(|e| match e {
                    RegisterError::Shm(s) => shm_status(&s),
                    RegisterError::Layout(l) => {
                        Status::invalid_argument(format!("invalid layout: {l}"))
                    }
                    RegisterError::Gpu(g) => gpu_status(&g),
                    e @ RegisterError::TooManyBlocks { .. } => {
                        Status::resource_exhausted(e.to_string())
                    }
                })?;
            shared.rdma.register_region(&region);
            Ok(region)
        });
        let region = registering
            .await
            .map_err(|e| Status::internal(format!("registration did not finish: {e}")))??;
        m::regions_registered().set(self.shared.registry.len() as f64);
        if let Some(pid) = owner_pid {
            crate::daemon::watch_worker(&self.shared, pid);
        }
        info!(region = region.id, worker = %req.worker_id, pid = ?owner_pid, memory = region.memory.kind(), path = %req.shm_path, bytes = region.memory.len(), "region registered");
        Ok(Response::new(RegisterRegionResponse {
            region_id: region.id,
            mapped_bytes: region.memory.len(),
        }))
    }

    async fn unregister_region(
        &self,
        req: Request<UnregisterRegionRequest>,
    ) -> Result<Response<UnregisterRegionResponse>, Status> {
        let id = req.into_inner().region_id;
        match self.shared.unregister_region(id) {
            Ok(()) => {
                info!(region = id, "region unregistered");
                Ok(Response::new(UnregisterRegionResponse {}))
            }
            Err(UnregisterError::Unknown) => Err(Status::not_found(format!("unknown region {id}"))),
            Err(UnregisterError::InUse) => Err(Status::failed_precondition(format!(
                "region {id} has transfers in flight; cancel or wait for them first"
            ))),
            Err(UnregisterError::Held) => Err(Status::failed_precondition(format!(
                "region {id}: a sender still holds bytes of it that the peer has not acknowledged (a failed transfer); try again shortly"
            ))),
        }
    }

    async fn block_generations(
        &self,
        req: Request<BlockGenerationsRequest>,
    ) -> Result<Response<BlockGenerationsResponse>, Status> {
        let req = req.into_inner();
        let region = self
            .shared
            .registry
            .get(req.region_id)
            .ok_or_else(|| Status::not_found(format!("unknown region {}", req.region_id)))?;
        check_block_count(&req.block_ids)?;
        let generations = region.generations(&req.block_ids).map_err(|block| {
            Status::invalid_argument(format!(
                "block {block} out of range (region has {})",
                region.layout.num_blocks
            ))
        })?;
        Ok(Response::new(BlockGenerationsResponse { generations }))
    }

    async fn release_blocks(
        &self,
        req: Request<ReleaseBlocksRequest>,
    ) -> Result<Response<ReleaseBlocksResponse>, Status> {
        let req = req.into_inner();
        check_block_count(&req.block_ids)?;
        match self
            .shared
            .release_blocks(req.region_id, &req.block_ids)
            .await
        {
            Ok((generations, failed)) => {
                if failed > 0 {
                    info!(
                        region = req.region_id,
                        blocks = req.block_ids.len(),
                        transfers = failed,
                        "blocks released under running transfers; those transfers failed"
                    );
                }
                Ok(Response::new(ReleaseBlocksResponse {
                    generations,
                    transfers_failed: failed as u32,
                }))
            }
            Err(e @ ReleaseError::UnknownRegion(_)) => Err(Status::not_found(e.to_string())),
            Err(e @ ReleaseError::BlockOutOfRange { .. }) => {
                Err(Status::invalid_argument(e.to_string()))
            }
            Err(e @ ReleaseError::StillMoving { .. }) => Err(Status::unavailable(e.to_string())),
        }
    }

    async fn push(&self, req: Request<PushRequest>) -> Result<Response<TransferAccepted>, Status> {
        let r = req.into_inner();
        let src = require(&r.source, "source")?;
        let dst = require(&r.destination, "destination")?;
        self.start(
            true,
            &r.request_id,
            &r.worker_id,
            &r.peer,
            src,
            dst,
            r.group.as_ref(),
            r.receiver_group.as_ref(),
        )
        .await
        .map(Response::new)
    }

    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<TransferAccepted>, Status> {
        let r = req.into_inner();
        let src = require(&r.source, "source")?;
        let dst = require(&r.destination, "destination")?;
        self.start(
            false,
            &r.request_id,
            &r.worker_id,
            &r.peer,
            src,
            dst,
            r.group.as_ref(),
            None,
        )
        .await
        .map(Response::new)
    }

    async fn wait(&self, req: Request<WaitRequest>) -> Result<Response<TransferStatus>, Status> {
        let req = req.into_inner();
        let rec = self.record(req.transfer_id)?;
        let wait = rec.ended();
        if req.timeout_ms == 0 {
            let _ = wait.await;
        } else {
            let _ =
                tokio::time::timeout(Duration::from_millis(u64::from(req.timeout_ms)), wait).await;
        }
        Ok(Response::new(self.live_status(&rec)))
    }

    async fn get_transfer(
        &self,
        req: Request<GetTransferRequest>,
    ) -> Result<Response<TransferStatus>, Status> {
        let rec = self.record(req.into_inner().transfer_id)?;
        Ok(Response::new(self.live_status(&rec)))
    }

    async fn cancel(
        &self,
        req: Request<CancelRequest>,
    ) -> Result<Response<TransferStatus>, Status> {
        let rec = self.record(req.into_inner().transfer_id)?;
        if let Some(link) = rec.link.upgrade() {
            link.with_session(|s, now| s.cancel(rec.id, now));
        }
        Ok(Response::new(self.live_status(&rec)))
    }

    type SubscribeStream = NotificationStream;

    async fn subscribe(
        &self,
        req: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let pid = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred)
            .and_then(|c| c.pid());
        let req = req.into_inner();
        require_text(&req.worker_id, "worker_id")?;
        let rx = self
            .shared
            .hub
            .subscribe(
                &req.worker_id,
                req.after_sequence,
                req.incarnation,
                req.take_over,
                pid,
            )
            .map_err(|e| Status::already_exists(e.to_string()))?;
        Ok(Response::new(Box::pin(rx)))
    }

    type OpenRingStream = crate::worker_ring::RingStream;

    async fn open_ring(
        &self,
        req: Request<OpenRingRequest>,
    ) -> Result<Response<Self::OpenRingStream>, Status> {
        let cred = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred);
        let caller = kvrail_shm::Caller {
            uid: cred.map(|c| c.uid()),
        };
        let pid = cred.and_then(|c| c.pid());
        let r = req.into_inner();
        crate::worker_ring::open(
            &self.shared,
            &r.worker_id,
            &r.shm_path,
            crate::worker_ring::Notifications {
                wanted: r.notifications,
                take_over: r.take_over,
                pid,
            },
            caller,
        )
        .map(Response::new)
    }

    async fn remove_on_exit(
        &self,
        req: Request<RemoveOnExitRequest>,
    ) -> Result<Response<RemoveOnExitResponse>, Status> {
        let cred = req
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|info| info.peer_cred);
        let Some(pid) = cred.and_then(|c| c.pid()) else {
            return Err(Status::failed_precondition(
                "the calling process is not known (no peer credentials on this socket)",
            ));
        };
        let uid = cred.map(|c| c.uid());
        let paths = req.into_inner().paths;
        let shared = self.shared.clone();
        // Path lookups can stall on a hung filesystem: off the runtime's workers.
        let pinned = tokio::task::spawn_blocking(move || shared.exit_files.pin(pid, uid, &paths))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        pinned.map_err(|e| match e {
            crate::exit_files::PinError::TooMany => Status::resource_exhausted(e.to_string()),
            crate::exit_files::PinError::NotOwner { .. } => {
                Status::permission_denied(e.to_string())
            }
            crate::exit_files::PinError::Stat { ref source, .. }
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Status::not_found(e.to_string())
            }
            _ => Status::invalid_argument(e.to_string()),
        })?;
        crate::daemon::watch_worker(&self.shared, pid);
        Ok(Response::new(RemoveOnExitResponse {}))
    }

    async fn send_message(
        &self,
        req: Request<SendMessageRequest>,
    ) -> Result<Response<SendMessageResponse>, Status> {
        let r = req.into_inner();
        require_text(&r.worker_id, "worker_id")?;
        require_text(&r.to_worker, "to_worker")?;
        let message = kvrail_core::wire::pb::WorkerMessage {
            from_worker: r.worker_id,
            to_worker: r.to_worker,
            topic: r.topic,
            payload: r.payload,
        };
        kvrail_core::message::check(&message)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let link = match self.shared.outbound_link(&r.peer).await {
            Ok(Some(link)) => link,
            Ok(None) => return Err(Status::not_found(format!("unknown peer {:?}", r.peer))),
            Err(e) => return Err(Status::unavailable(e.to_string())),
        };
        link.with_session(|s, _| s.send_message(message))
            .map_err(|e| match e {
                kvrail_core::message::MessageError::Busy(_) => {
                    Status::resource_exhausted(e.to_string())
                }
                e => Status::invalid_argument(e.to_string()),
            })?;
        m::messages_sent().increment(1);
        Ok(Response::new(SendMessageResponse {}))
    }

    async fn list_peers(
        &self,
        _req: Request<ListPeersRequest>,
    ) -> Result<Response<ListPeersResponse>, Status> {
        let mut peers = Vec::new();
        for (name, slot) in self.shared.peers.entries() {
            let outbound = slot.link_now().link().filter(|l| l.is_alive());
            let mut links: Vec<_> = outbound.into_iter().collect();
            links.extend(
                self.shared
                    .inbound
                    .iter()
                    .filter(|e| e.key().0 == name && e.value().is_alive())
                    .map(|e| e.value().clone()),
            );
            let rail_status: Vec<RailStatus> = links
                .iter()
                .flat_map(|l| {
                    l.rail_stats().into_iter().map(|r| RailStatus {
                        rail: r.rail,
                        direction: l.direction.to_string(),
                        state: r.health.as_str().to_string(),
                        connections: r.connections as u32,
                        bytes_sent: r.bytes_sent,
                        bytes_received: r.bytes_received,
                        slices_sent: r.slices_sent,
                        slices_retransmitted: r.slices_retransmitted,
                        transitions: r.transitions,
                        rate_bytes_per_sec: r.rate_bytes_per_sec.unwrap_or(0.0),
                        last_failure: r.last_failure.unwrap_or_default(),
                    })
                })
                .collect();
            peers.push(PeerInfo {
                name: name.clone(),
                rails: slot.config.rails.iter().map(|a| a.to_string()).collect(),
                connected: rail_status.iter().any(|r| r.connections > 0),
                // The stream transport of the live session (RDMA rides on it).
                transport: links
                    .first()
                    .map(|l| l.transport.to_string())
                    .unwrap_or_default(),
                rail_status,
            });
        }
        peers.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(ListPeersResponse {
            node_name: self.shared.config.node.clone(),
            peers,
            incarnation: self.shared.incarnation,
        }))
    }
}
