//! Starting a push or pull: the one path the gRPC API and the worker rings
//! share, so a transfer is validated and recorded the same way whichever way
//! the worker asked for it.

use std::sync::Arc;
use std::time::Instant;

use kvrail_core::{Access, BlockSelection, LocalTransfer, PlanError};
use kvrail_proto::{Failure, FailureSide, TransferAccepted, TransferState, TransferStatus};
use tonic::Status;

use crate::daemon::Shared;
use crate::metrics as m;
use crate::transfers::TransferRecord;

/// A push or pull as the worker asked for it.
pub struct Start<'a> {
    pub push: bool,
    pub request_id: &'a str,
    pub worker_id: &'a str,
    pub peer: &'a str,
    /// The blocks on this node (the source of a push, the destination of a pull).
    pub local: BlockSelection,
    /// The blocks on the peer.
    pub remote: BlockSelection,
    /// Completes as one with the other transfers of this group.
    pub group: Option<&'a kvrail_proto::TransferGroup>,
    /// A push's: the receiving worker hears of it with this group's other
    /// members.
    pub receiver_group: Option<&'a kvrail_proto::TransferGroup>,
}

/// Text fields of the API: 1 to 256 bytes.
pub fn require_text(value: &str, name: &str) -> Result<(), Status> {
    const MAX: usize = kvrail_core::wire::REQUEST_ID_MAX;
    if value.is_empty() || value.len() > MAX {
        return Err(Status::invalid_argument(format!(
            "{name} must be 1..={MAX} bytes"
        )));
    }
    Ok(())
}

/// Checks the peer-side selection as far as this side can: shape and duplicates.
/// A head slice describes the one stream both sides map: given on either
/// selection it applies to both; given on both it must be the same.
fn share_slice(
    mut local: BlockSelection,
    mut remote: BlockSelection,
) -> Result<(BlockSelection, BlockSelection), Status> {
    match (local.slice, remote.slice) {
        (Some(a), Some(b)) if a != b => {
            return Err(Status::invalid_argument(format!(
                "the source and destination name different head slices ({a:?} and {b:?})"
            )))
        }
        (Some(a), None) => remote.slice = Some(a),
        (None, Some(b)) => local.slice = Some(b),
        _ => {}
    }
    Ok((local, remote))
}

fn check_remote(
    sel: &BlockSelection,
    write: bool,
    local_blocks: usize,
    local_layers: u32,
) -> Result<(), Status> {
    let access = if write { Access::Write } else { Access::Read };
    sel.check_shape(access)
        .map_err(|e| Status::invalid_argument(format!("peer-side selection: {e}")))?;
    if sel.block_ids.len() as u64 * u64::from(sel.layer_count)
        != local_blocks as u64 * u64::from(local_layers)
    {
        return Err(Status::invalid_argument(format!(
            "size mismatch: source and destination must name the same number of layer-blocks ({} x {} vs {} x {})",
            local_layers,
            local_blocks,
            sel.layer_count,
            sel.block_ids.len()
        )));
    }
    Ok(())
}

/// A transfer the sidecar would not start: the gRPC status, and the stable
/// code the submission ring answers with (the gRPC code's name in snake case,
/// or a failure code of its own such as `blocks_released`).
#[derive(Debug)]
pub struct Refusal {
    pub code: &'static str,
    pub status: Status,
}

impl From<Status> for Refusal {
    fn from(status: Status) -> Self {
        use tonic::Code as C;
        let code = match status.code() {
            C::InvalidArgument => "invalid_argument",
            C::NotFound => "not_found",
            C::AlreadyExists => "already_exists",
            C::Unavailable => "unavailable",
            C::FailedPrecondition => "failed_precondition",
            C::ResourceExhausted => "resource_exhausted",
            C::PermissionDenied => "permission_denied",
            _ => "internal",
        };
        Self { code, status }
    }
}

/// Validates, records and starts a transfer on the peer's outbound link.
pub async fn start_transfer(
    shared: &Arc<Shared>,
    start: Start<'_>,
) -> Result<TransferAccepted, Refusal> {
    require_text(start.request_id, "request_id")?;
    require_text(start.worker_id, "worker_id")?;
    if !shared.peers.contains_key(start.peer) && !shared.resolve_peer(start.peer).await {
        let known = if shared.membership.get().is_some() {
            "not configured and not registered in etcd"
        } else {
            "not configured (and no etcd membership)"
        };
        return Err(Status::not_found(format!("unknown peer {:?}: {known}", start.peer)).into());
    }
    let Start {
        push,
        request_id,
        worker_id,
        peer,
        local: local_sel,
        remote: remote_sel,
        group,
        receiver_group,
    } = start;
    if let Some(g) = group {
        require_text(&g.id, "group.id")?;
    }
    let receiver_group = receiver_group.map(|g| kvrail_core::wire::pb::ReceiverGroup {
        id: g.id.clone(),
        members: g.members,
    });
    if let Some(g) = &receiver_group {
        if !push {
            return Err(Status::invalid_argument(
                "receiver_group is for pushes: a pull's worker is its receiver (use group)",
            )
            .into());
        }
        kvrail_core::session::check_receiver_group(g).map_err(Status::invalid_argument)?;
    }
    let region = shared.registry.get(local_sel.region_id).ok_or_else(|| {
        Status::not_found(format!("unknown local region {}", local_sel.region_id))
    })?;
    let access = if push { Access::Read } else { Access::Write };
    let (local_sel, remote_sel) = share_slice(local_sel, remote_sel)?;
    let req = LocalTransfer {
        transfer_id: 0, // numbered once the request is recorded
        request_id: request_id.to_string(),
        local: local_sel,
        local_layout: region.layout,
        remote: remote_sel,
        staged: region.memory.is_staged(),
        local_geometry: region.geometry.clone(),
        receiver_group,
    };
    // Built once: checked here, then handed to the session.
    let plan = req.plan(access).map_err(|e| match e {
        PlanError::NoGeometry | PlanError::Slice(_) | PlanError::Incompatible(_) => {
            Status::failed_precondition(e.to_string())
        }
        e => Status::invalid_argument(e.to_string()),
    })?;
    if req.local.slice.is_some() {
        // The stream's length is compared by the peer when it plans its side.
        let remote_access = if push { Access::Write } else { Access::Read };
        req.remote
            .check_shape(remote_access)
            .map_err(|e| Status::invalid_argument(format!("peer-side selection: {e}")))?;
    } else {
        check_remote(
            &req.remote,
            push,
            req.local.block_ids.len(),
            req.local.layer_count,
        )?;
    }

    crate::trace_points::mark(crate::trace_points::START_CHECKED);
    let id = shared.next_transfer_id();
    shared
        .transfers
        .reserve(worker_id, request_id, id)
        .map_err(|_| {
            Status::already_exists(format!(
                "request {request_id:?} is already in flight for worker {worker_id:?}"
            ))
        })?;
    let link = match shared.outbound_link(peer).await {
        Ok(Some(link)) => link,
        Ok(None) => {
            shared.transfers.release(worker_id, request_id);
            return Err(Status::not_found(format!("unknown peer {peer:?}")).into());
        }
        Err(e) => {
            shared.transfers.release(worker_id, request_id);
            return Err(Status::unavailable(e.to_string()).into());
        }
    };
    if let Some(g) = group {
        // Joined before the transfer can end, so that its end finds the group.
        let now = Instant::now();
        shared.expire_groups(now);
        if let Err(e) = shared
            .groups
            .join(worker_id, &g.id, g.members, push, id, now)
        {
            shared.transfers.release(worker_id, request_id);
            return Err(Status::failed_precondition(e.to_string()).into());
        }
    }
    crate::trace_points::mark(crate::trace_points::START_LINK_FOUND);
    let total = plan.total_bytes();
    let segments = plan.segments().len() as u64;
    let status = TransferStatus {
        transfer_id: id,
        request_id: request_id.to_string(),
        state: TransferState::Queued as i32,
        total_bytes: total,
        ..Default::default()
    };
    shared.transfers.insert(Arc::new(TransferRecord::new(
        id,
        request_id.to_string(),
        worker_id.to_string(),
        group.map(|g| g.id.clone()),
        status,
        Arc::downgrade(&link),
    )));
    crate::trace_points::mark(crate::trace_points::START_RECORDED);
    let req = LocalTransfer {
        transfer_id: id,
        ..req
    };
    let kind = if push {
        kvrail_core::TransferKind::Push
    } else {
        kvrail_core::TransferKind::Pull
    };
    m::transfers_started(kind).increment(1);
    let started = link.with_session(|s, now| {
        crate::trace_points::mark(crate::trace_points::START_LOCKED);
        // Checked under the session lock, so a concurrent ReleaseBlocks
        // either is seen here or finds the transfer (Shared::release_blocks).
        region.check_generations(&req.local).map_err(|why| {
            (
                "blocks_released",
                Status::failed_precondition(format!("blocks_released: {why}")),
            )
        })?;
        let r = if push {
            s.start_push_planned(req, plan, now)
        } else {
            s.start_pull_planned(req, plan, now)
        };
        crate::trace_points::mark(crate::trace_points::START_SESSION_DONE);
        r.map_err(|e| match e {
            kvrail_core::PlanError::SessionFull { .. }
            | kvrail_core::PlanError::MemoryFull { .. } => (
                "resource_exhausted",
                Status::resource_exhausted(format!("peer {}: {e}", start.peer)),
            ),
            e => (
                "internal",
                Status::internal(format!("plan rejected after validation: {e}")),
            ),
        })
    });
    if let Err((code, status)) = started {
        let failure = Failure {
            side: FailureSide::Local as i32,
            code: code.into(),
            message: status.message().to_string(),
        };
        let f = failure.clone();
        shared.transfers.finish(id, |s| {
            s.state = TransferState::Failed as i32;
            s.failure = Some(f);
        });
        if let Some(g) = group {
            // The caller hears of this member; the group's other members
            // are told as one.
            shared.group_member_failed(worker_id, &g.id, id, peer, failure);
        }
        return Err(Refusal { code, status });
    }
    Ok(TransferAccepted {
        transfer_id: id,
        total_bytes: total,
        segments,
    })
}
