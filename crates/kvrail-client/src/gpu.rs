//! A worker's paged KV cache in GPU memory: allocate it with a vLLM layout,
//! export it to the sidecar by CUDA IPC, and fill or verify blocks on the GPU.

use std::sync::Arc;

use kvrail_cuda::{CudaError, DeviceBuffer, DeviceMemory};
use kvrail_proto::RegionLayout;

use crate::{block_offset, layout_extent, Client, ClientError};

pub use kvrail_cuda::{self as cuda, Gpu, IPC_HANDLE_BYTES};

/// Paged KV blocks in one `cuMemAlloc` allocation (exportable by IPC).
#[derive(Debug)]
pub struct GpuKvRegion {
    pub buffer: DeviceBuffer,
    pub layout: RegionLayout,
}

impl GpuKvRegion {
    /// Allocates the layout's extent on `gpu`, zeroed.
    pub fn create(gpu: &Arc<Gpu>, layout: RegionLayout) -> Result<Self, CudaError> {
        let buffer = DeviceBuffer::zeroed(gpu, layout_extent(&layout))?;
        Ok(Self { buffer, layout })
    }

    pub fn bytes(&self) -> u64 {
        self.buffer.len()
    }

    /// Registers the allocation with the local sidecar.
    pub async fn register(
        &self,
        client: &mut Client,
        worker_id: &str,
        expose_to_peers: bool,
    ) -> Result<u64, GpuClientError> {
        let handle = self.buffer.ipc_handle()?;
        let device = self.buffer.gpu().ordinal();
        Ok(client
            .register_gpu(worker_id, &handle, device, self.layout, expose_to_peers)
            .await?)
    }

    /// Fills every block with the pattern of `seed`, on the GPU: word `i` of the
    /// allocation holds `kvrail_cuda::pattern_word(seed, i)`.
    pub fn fill(&self, seed: u32) -> Result<(), CudaError> {
        self.buffer.fill(0, self.buffer.len() & !3, seed, 0)
    }

    /// Zeroes every block.
    pub fn zero(&self) -> Result<(), CudaError> {
        self.buffer.zero()
    }

    /// Counts, on the GPU, the words of destination blocks that differ from their
    /// source blocks: for each `(source_block, block)` pair and every layer and
    /// plane, block `(layer, plane, block)` here against `(layer, plane,
    /// source_block)` of a region of `source` layout filled with `seed`.
    pub fn mismatches(
        &self,
        source: &RegionLayout,
        seed: u32,
        pairs: &[(u32, u32)],
    ) -> Result<u64, CudaError> {
        let mut ranges = Vec::with_capacity(
            pairs.len() * (self.layout.num_layers * self.layout.planes_per_layer) as usize,
        );
        for layer in 0..self.layout.num_layers.min(source.num_layers) {
            for plane in 0..self.layout.planes_per_layer.min(source.planes_per_layer) {
                for &(from, to) in pairs {
                    let at = block_offset(&self.layout, layer, plane, to);
                    let first = block_offset(source, layer, plane, from) / 4;
                    ranges.push((at, self.layout.block_bytes, first));
                }
            }
        }
        self.buffer.count_mismatches(&ranges, seed)
    }
}

/// A GPU step or a sidecar call failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuClientError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Client(#[from] ClientError),
}
