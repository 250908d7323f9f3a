//! GPU regions: devices opened on first use, each with its staging pool and a
//! copy queue per direction (of `gpu_copy_streams` CUDA streams).
//!
//! Payload of a GPU region moves through pinned host buffers: a connection's
//! writer gathers slice i+1 from the device while slice i is on the wire (up to
//! `gpu_stage_depth` slices in flight), and a reader hands each received slice to
//! the host-to-device queue and goes on reading the next one; a slice counts as
//! placed only when its device copy has finished.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvrail_cuda::{Capabilities, CopyQueue, CudaError, Gpu, ImportedMemory, StagingPool};
use tracing::info;

/// One device as the sidecar uses it.
pub struct GpuDevice {
    pub gpu: Arc<Gpu>,
    pub pool: StagingPool,
    pub to_host: CopyQueue,
    pub to_device: CopyQueue,
    /// Received slices waiting for their device copy hold staging buffers:
    /// at most [`RECEIVE_STAGING_MIB`] MiB of them at once (permits of 1
    /// MiB), so a peer that sends faster than the device copies, windows or
    /// not, waits on its connection instead of pinning host memory without
    /// end.
    pub receive_staging: Arc<tokio::sync::Semaphore>,
}

/// Pinned MiB that received slices may hold per device while their copies
/// to the device are pending (a real peer's windows keep far fewer in
/// flight: 16 connections of 8 MiB windows are 128 MiB).
pub const RECEIVE_STAGING_MIB: u32 = 1024;

/// The permits a received staged slice of `len` bytes takes: its MiB,
/// rounded up, at least one and at most all.
pub fn receive_staging_permits(len: usize) -> u32 {
    let mib = len.div_ceil(1 << 20).max(1);
    u32::try_from(mib).map_or(RECEIVE_STAGING_MIB, |m| m.min(RECEIVE_STAGING_MIB))
}

/// Devices, opened when a worker first registers memory on them.
pub struct GpuDevices {
    staging_bytes: usize,
    copy_streams: usize,
    batch_copies: bool,
    devices: Mutex<HashMap<u32, Arc<GpuDevice>>>,
}

impl GpuDevices {
    /// Staging buffers hold one slice each; each direction copies on
    /// `copy_streams` streams, a slice's pieces in one batched call where the
    /// driver can and `batch_copies` allows.
    pub fn new(staging_bytes: usize, copy_streams: usize, batch_copies: bool) -> Self {
        GpuDevices {
            staging_bytes,
            copy_streams,
            batch_copies,
            devices: Mutex::new(HashMap::new()),
        }
    }

    pub fn device(&self, ordinal: u32) -> Result<Arc<GpuDevice>, CudaError> {
        let mut devices = self.devices.lock().map_err(|_| CudaError::QueueStopped)?;
        if let Some(d) = devices.get(&ordinal) {
            return Ok(d.clone());
        }
        let gpu = Gpu::open(ordinal)?;
        log_capabilities(&gpu);
        let device = Arc::new(GpuDevice {
            pool: StagingPool::new(&gpu, self.staging_bytes),
            to_host: CopyQueue::with_options(
                &gpu,
                &format!("d2h{ordinal}"),
                self.copy_streams,
                self.batch_copies,
            )?,
            to_device: CopyQueue::with_options(
                &gpu,
                &format!("h2d{ordinal}"),
                self.copy_streams,
                self.batch_copies,
            )?,
            gpu,
            receive_staging: Arc::new(tokio::sync::Semaphore::new(RECEIVE_STAGING_MIB as usize)),
        });
        info!(
            device = ordinal,
            batched = device.to_host.batches(),
            "GPU staging copies: {}",
            if device.to_host.batches() {
                "a slice's pieces in one cuMemcpyBatchAsync"
            } else {
                "one copy call per piece"
            }
        );
        devices.insert(ordinal, device.clone());
        Ok(device)
    }
}

/// Said once per device: how its memory will move.
fn log_capabilities(gpu: &Gpu) {
    let Capabilities {
        gpudirect_rdma,
        dma_buf,
        integrated,
    } = gpu.capabilities();
    let how = if gpudirect_rdma && dma_buf {
        "the device reports GPUDirect RDMA and dma-buf, but kvrail does not yet register GPU memory with verbs; payload is staged through pinned host buffers"
    } else {
        "the device does not support GPUDirect RDMA; payload is staged through pinned host buffers"
    };
    info!(
        device = gpu.ordinal(),
        name = gpu.name(),
        gpudirect_rdma,
        dma_buf,
        integrated,
        "GPU opened: {how}{}",
        if integrated {
            " (integrated GPU: register KV kept in pinned shared memory as a host region instead, no staging needed)"
        } else {
            ""
        }
    );
}

/// A region's device memory, with the device that moves it.
pub struct GpuMemory {
    pub device: Arc<GpuDevice>,
    pub memory: Arc<ImportedMemory>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_slice_takes_its_mib_of_the_staging_share_and_never_more_than_all() {
        assert_eq!(receive_staging_permits(0), 1);
        assert_eq!(receive_staging_permits(4096), 1);
        assert_eq!(receive_staging_permits(1 << 20), 1);
        assert_eq!(receive_staging_permits((1 << 20) + 1), 2);
        assert_eq!(receive_staging_permits(64 << 20), 64);
        assert_eq!(receive_staging_permits(usize::MAX), RECEIVE_STAGING_MIB);
    }
}
