//! GPU-resident KV regions for kvrail, on the CUDA driver API through `cudarc`.
//!
//! `libcuda.so` is loaded at run time: the same binary runs on machines without
//! CUDA, where [`Gpu::open`] says so ([`CudaError::NoDriver`]) and the sidecar
//! refuses GPU regions with that reason.
//!
//! What the sidecar uses:
//! - [`Gpu`]: one device's primary context, and what the device can do
//!   ([`Capabilities`]: GPUDirect RDMA, dma-buf, integrated memory).
//! - [`ImportedMemory`]: a worker's `cudaMalloc` allocation opened from its CUDA IPC
//!   handle, checked against the allocation's real size, closed on drop.
//! - [`StagingPool`] of pinned host buffers (`cuMemHostAlloc`, not write-combined,
//!   since the CPU reads them to send) and a [`CopyQueue`]: stream-ordered copies
//!   between device pieces and one buffer, whose completion arrives as a future
//!   (a thread per queue waits on CUDA events, so no tokio thread ever blocks).
//!
//! What workers and tests use: [`DeviceBuffer`] (allocate, export an IPC handle,
//! fill and verify a pattern on the GPU) and [`HostRegistration`] (unified memory:
//! pin a shared-memory mapping for the GPU, so the sidecar moves it with no copy).
//!
//! All `unsafe` code of the GPU path lives in this crate.

mod kernels;

use std::ffi::c_void;
use std::fmt;
use std::sync::{mpsc, Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use tokio::sync::oneshot;

pub use kernels::pattern_word;

/// Size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// What failed, and where.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No CUDA driver library on this machine.
    #[error("no CUDA driver on this machine (libcuda.so not found); GPU regions are unavailable")]
    NoDriver,
    /// The driver is present but has no device with this ordinal.
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice { ordinal: u32, count: u32 },
    /// A driver call failed.
    #[error("{call} failed: {message}")]
    Driver { call: &'static str, message: String },
    /// The IPC handle is malformed or names no memory this process can open.
    #[error("bad CUDA IPC handle: {0}")]
    BadHandle(String),
    /// The region asked for runs past the end of the allocation behind the handle.
    #[error("region of {requested} bytes does not fit the GPU allocation ({available} bytes from the handle's address)")]
    TooLarge { requested: u64, available: u64 },
    /// A copy touched bytes outside its memory or buffer.
    #[error("copy out of bounds: {0}")]
    OutOfBounds(String),
    /// The completion thread of a copy queue is gone.
    #[error("the copy queue stopped")]
    QueueStopped,
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| CudaError::Driver {
        call,
        message: describe(e),
    })
}

fn describe(e: cu::DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        (Ok(n), Err(_)) => n,
        _ => format!("{:?}", e.0),
    }
}

/// A CUDA context handle. The driver API is thread-safe; a context may be made
/// current on any thread.
#[derive(Clone, Copy)]
struct Context(sys::CUcontext);
// SAFETY: CUDA contexts are process-wide objects usable from any thread
// (cuCtxSetCurrent binds them per thread); the pointer is never dereferenced here.
unsafe impl Send for Context {}
// SAFETY: as above; sharing the handle only lets threads bind the same context.
unsafe impl Sync for Context {}

/// What a device can do, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpudirect_rdma: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported as a
    /// dma-buf for `ibv_reg_dmabuf_mr`.
    pub dma_buf: bool,
    /// An integrated GPU sharing memory with the host (DGX Spark's GB10): pinned
    /// host memory is the KV cache itself, nothing needs staging.
    pub integrated: bool,
}

/// One device's primary context.
pub struct Gpu {
    ordinal: u32,
    device: sys::CUdevice,
    context: Context,
    name: String,
    capabilities: Capabilities,
    kernels: Mutex<Option<kernels::Kernels>>,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("capabilities", &self.capabilities)
            .finish()
    }
}

impl Gpu {
    /// Whether a CUDA driver library can be loaded here.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to dlopen libcuda; nothing is called through it.
        unsafe { sys::is_culib_present() }
    }

    /// How many devices the driver sees (0 without a driver).
    pub fn device_count() -> Result<u32, CudaError> {
        if !Self::driver_present() {
            return Err(CudaError::NoDriver);
        }
        check("cuInit", cu_init())?;
        let n = cu::device::get_count().map_err(|e| CudaError::Driver {
            call: "cuDeviceGetCount",
            message: describe(e),
        })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    /// Opens device `ordinal` (retaining its primary context, which workers share).
    pub fn open(ordinal: u32) -> Result<Arc<Gpu>, CudaError> {
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let device = cu::device::get(ordinal as i32).map_err(|e| CudaError::Driver {
            call: "cuDeviceGet",
            message: describe(e),
        })?;
        // SAFETY: `device` is a valid device handle from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(device) }.map_err(|e| CudaError::Driver {
            call: "cuDevicePrimaryCtxRetain",
            message: describe(e),
        })?;
        let name = cu::device::get_name(device).unwrap_or_else(|_| "unknown".into());
        let attr = |a: sys::CUdevice_attribute| -> bool {
            // SAFETY: valid device and attribute; the driver writes one int.
            unsafe { cu::device::get_attribute(device, a) }.is_ok_and(|v| v != 0)
        };
        let capabilities = Capabilities {
            gpudirect_rdma: attr(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
            ),
            dma_buf: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED),
            integrated: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED),
        };
        Ok(Arc::new(Gpu {
            ordinal,
            device,
            context: Context(ctx),
            name,
            capabilities,
            kernels: Mutex::new(None),
        }))
    }

    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    /// Makes this device's context current on the calling thread (cheap; every
    /// entry point calls it, since tokio moves tasks between threads).
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context was retained in `open` and is released only on drop.
        unsafe { cu::ctx::set_current(self.context.0) }.map_err(|e| CudaError::Driver {
            call: "cuCtxSetCurrent",
            message: describe(e),
        })
    }

    /// Opens a worker's allocation from its IPC handle as `len` bytes at the
    /// handle's address. Fails cleanly on a malformed handle, a handle whose
    /// exporter is gone, or a `len` past the end of the allocation.
    pub fn import(self: &Arc<Self>, handle: &[u8], len: u64) -> Result<ImportedMemory, CudaError> {
        let bytes: [u8; IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| {
            CudaError::BadHandle(format!(
                "{} bytes, expected {IPC_HANDLE_BYTES}",
                handle.len()
            ))
        })?;
        if len == 0 {
            return Err(CudaError::TooLarge {
                requested: 0,
                available: 0,
            });
        }
        self.bind()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (d, s) in raw.reserved.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is plain bytes, which
        // the driver validates (garbage yields an error, not a mapping).
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        if let Err(e) = r.result() {
            return Err(CudaError::BadHandle(format!(
                "cuIpcOpenMemHandle: {} (garbage, from another machine, or its process exited)",
                describe(e)
            )));
        }
        let imported = ImportedMemory {
            gpu: self.clone(),
            ptr,
            len,
        };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; `ptr` is the mapping just opened.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        let available = (base + size as u64).saturating_sub(ptr);
        if len > available {
            // `imported` drops here and closes the mapping.
            return Err(CudaError::TooLarge {
                requested: len,
                available,
            });
        }
        Ok(imported)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Ok(mut k) = self.kernels.lock() {
            if let Some(k) = k.take() {
                let _ = self.bind();
                k.unload();
            }
        }
        // SAFETY: balances the retain in `open`; nothing uses the context after.
        let _ = unsafe { cu::primary_ctx::release(self.device) };
    }
}

fn cu_init() -> sys::CUresult {
    // SAFETY: cuInit may be called any number of times from any thread.
    unsafe { sys::cuInit(0) }
}

/// Device memory that copies may read or write: a base address and a length,
/// alive for as long as the value is.
pub trait DeviceMemory: Send + Sync + 'static {
    fn device_ptr(&self) -> u64;
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn gpu(&self) -> &Arc<Gpu>;
}

/// A worker's device allocation opened in this process from its IPC handle.
pub struct ImportedMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: u64,
}

impl fmt::Debug for ImportedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportedMemory")
            .field("device", &self.gpu.ordinal)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMemory for ImportedMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for ImportedMemory {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed exactly once;
        // every copy holding this memory has finished (they hold an Arc to it).
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// A device allocation owned by this process (`cuMemAlloc`, exportable by IPC,
/// unlike stream-ordered pool memory).
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: u64,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.gpu.ordinal)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes, zeroed.
    pub fn zeroed(gpu: &Arc<Gpu>, len: u64) -> Result<DeviceBuffer, CudaError> {
        gpu.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the size is what we ask for.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len as usize)
        })?;
        let buf = DeviceBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
        };
        // SAFETY: the allocation is `len` bytes long.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(ptr, 0, len as usize)
        })?;
        Ok(buf)
    }

    /// The CUDA IPC handle another process opens this allocation with.
    pub fn ipc_handle(&self) -> Result<Vec<u8>, CudaError> {
        self.gpu.bind()?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: valid out-pointer; `ptr` is the base of a cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut raw, self.ptr)
        })?;
        Ok(raw.reserved.iter().map(|&b| b as u8).collect())
    }

    /// Writes the test pattern [`pattern_word`] over `[offset, offset + len)`
    /// with a GPU kernel: word `i` of the range gets `pattern_word(seed, first_word + i)`.
    pub fn fill(&self, offset: u64, len: u64, seed: u32, first_word: u64) -> Result<(), CudaError> {
        let range = check_words(self.len, offset, len, first_word)?;
        kernels::run(&self.gpu, kernels::Op::Fill, &[self.at(range)], seed).map(|_| ())
    }

    /// Counts, with GPU kernels, the words of each `(offset, len, first_word)`
    /// range that differ from the pattern `fill` would write with the same
    /// arguments (all ranges launched at once, one wait).
    pub fn count_mismatches(
        &self,
        ranges: &[(u64, u64, u64)],
        seed: u32,
    ) -> Result<u64, CudaError> {
        let ranges = ranges
            .iter()
            .map(|&(o, l, f)| check_words(self.len, o, l, f).map(|r| self.at(r)))
            .collect::<Result<Vec<_>, _>>()?;
        kernels::run(&self.gpu, kernels::Op::Verify, &ranges, seed)
    }

    /// Zeroes the whole allocation.
    pub fn zero(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the allocation is `len` bytes long.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, 0, self.len as usize)
        })
    }

    fn at(&self, (offset, words, first): (u64, u64, u64)) -> (u64, u64, u64) {
        (self.ptr + offset, words, first)
    }

    /// Copies `[offset, offset + out.len())` to host memory (synchronously; tests).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), CudaError> {
        if offset
            .checked_add(out.len() as u64)
            .is_none_or(|e| e > self.len)
        {
            return Err(CudaError::OutOfBounds(format!(
                "read of {} bytes at {offset} from {} bytes",
                out.len(),
                self.len
            )));
        }
        self.gpu.bind()?;
        // SAFETY: both ranges were bounds-checked; the copy is synchronous.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset, out.len())
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated in `zeroed`, freed once; no copy holds it (they hold an Arc).
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (portable, not write-combined).
pub struct PinnedBuffer {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; moving it between
// threads moves that ownership.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared references only allow reads of the bytes.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedBuffer {
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedBuffer, CudaError> {
        gpu.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer. PORTABLE: usable from every context.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut ptr, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(PinnedBuffer {
            gpu: gpu.clone(),
            ptr: ptr.cast(),
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated in `new`, alive as long as `self`; no copy
        // is in flight while a reference exists (copies take the buffer by value).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// Pinned staging buffers of one size, reused: pinning is slow (page-locking),
/// so buffers go back to the pool instead of being freed.
pub struct StagingPool {
    gpu: Arc<Gpu>,
    /// Bytes of the buffers it pins and keeps: grows to the largest slice
    /// asked for (`take_at_least`).
    buffer_bytes: std::sync::atomic::AtomicUsize,
    free: Mutex<Vec<PinnedBuffer>>,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("buffer_bytes", &self.buffer_bytes)
            .finish()
    }
}

impl StagingPool {
    pub fn new(gpu: &Arc<Gpu>, buffer_bytes: usize) -> StagingPool {
        StagingPool {
            gpu: gpu.clone(),
            buffer_bytes: std::sync::atomic::AtomicUsize::new(buffer_bytes),
            free: Mutex::new(Vec::new()),
        }
    }

    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A free buffer, pinning a new one when none is free.
    pub fn take(&self) -> Result<PinnedBuffer, CudaError> {
        self.take_at_least(0)
    }

    /// A buffer of at least `len` bytes. A slice larger than the pool's
    /// buffers (a peer that cuts larger staged slices) makes the pool's
    /// buffers that large from then on, so that each such slice does not pin
    /// memory of its own; the smaller buffers are freed as they come back.
    pub fn take_at_least(&self, len: usize) -> Result<PinnedBuffer, CudaError> {
        let size = self
            .buffer_bytes
            .fetch_max(len, std::sync::atomic::Ordering::Relaxed)
            .max(len);
        // Buffers smaller than the pool's are freed, outside its lock.
        let mut outgrown = Vec::new();
        let found = self.free.lock().ok().and_then(|mut free| {
            while let Some(b) = free.pop() {
                if b.len >= len {
                    return Some(b);
                }
                outgrown.push(b);
            }
            None
        });
        drop(outgrown);
        match found {
            Some(b) => Ok(b),
            None => PinnedBuffer::new(&self.gpu, size),
        }
    }

    /// Returns a buffer for reuse (one of the pool's current size; others
    /// are freed).
    pub fn give(&self, buffer: PinnedBuffer) {
        if buffer.len == self.buffer_bytes() {
            if let Ok(mut f) = self.free.lock() {
                f.push(buffer);
            }
        }
    }
}

/// A finished copy: the staging buffer back, with what happened.
#[derive(Debug)]
pub struct CopyDone {
    pub buffer: PinnedBuffer,
    pub result: Result<(), CudaError>,
}

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToHost,
    ToDevice,
}

struct Stream(sys::CUstream);
// SAFETY: CUDA streams may be used from any thread once their context is bound.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing is serialised by its lane's mutex anyway.
unsafe impl Sync for Stream {}

struct Event(sys::CUevent);
// SAFETY: CUDA events may be waited on from any thread.
unsafe impl Send for Event {}

/// A copy on its way: the event after it, and who gets the buffer back.
struct Pending {
    event: Event,
    finish: Box<dyn FnOnce(Result<(), CudaError>) + Send>,
}

/// Stream-ordered copies between device memory and pinned buffers, spread over
/// `lanes` streams of their own: each lane has its own stream, lock and waiter,
/// and copies go to the lanes in turn. (More lanes did not move more on the
/// H100; docs/gpu.md.) Each copy's completion is a future; a thread per lane
/// waits on its copies' events in order.
pub struct CopyQueue {
    gpu: Arc<Gpu>,
    lanes: Vec<Lane>,
    next: std::sync::atomic::AtomicUsize,
    /// Scattered pieces go to the device in one `cuMemcpyBatchAsync` call
    /// where the driver has it (CUDA 12.8+), not one call per piece.
    batch: Option<BatchCopy>,
    /// Set when a batched call failed: the driver has the entry point but not
    /// for these copies; every copy goes one per piece from then on.
    batch_failed: std::sync::atomic::AtomicBool,
}

/// `cuMemcpyBatchAsync` with the CUDA 12.8 signature (the driver hands that
/// version out by request, newer drivers included).
type BatchCopy = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

/// The driver's `cuMemcpyBatchAsync` of CUDA 12.8's signature, if it has one.
/// Asked through `cuGetProcAddress_v2`, never loaded by name, so an older
/// driver gives None rather than a missing-symbol panic.
fn batch_copy() -> Option<BatchCopy> {
    static BATCH: std::sync::OnceLock<Option<BatchCopy>> = std::sync::OnceLock::new();
    *BATCH.get_or_init(|| {
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: the symbol is a NUL-terminated string; pfn and status are
        // valid out-pointers for the call.
        let r = unsafe {
            sys::cuGetProcAddress_v2(
                c"cuMemcpyBatchAsync".as_ptr(),
                &mut pfn,
                12080,
                0,
                &mut status,
            )
        };
        let found = r == sys::CUresult::CUDA_SUCCESS
            && status == sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
            && !pfn.is_null();
        // SAFETY: the driver returned the entry point of the 12.8 ABI of this
        // symbol, whose signature `BatchCopy` is.
        found.then(|| unsafe { std::mem::transmute::<*mut c_void, BatchCopy>(pfn) })
    })
}

/// One stream of a [`CopyQueue`] and the thread that waits on its copies.
struct Lane {
    stream: Stream,
    pending: Mutex<Option<mpsc::Sender<Pending>>>,
    waiter: Option<std::thread::JoinHandle<()>>,
}

impl fmt::Debug for CopyQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyQueue")
            .field("device", &self.gpu.ordinal)
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

impl CopyQueue {
    /// A queue of one lane.
    pub fn new(gpu: &Arc<Gpu>, name: &str) -> Result<CopyQueue, CudaError> {
        Self::with_lanes(gpu, name, 1)
    }

    /// A queue of `lanes` streams (at least one), batching scattered pieces
    /// where the driver can.
    pub fn with_lanes(gpu: &Arc<Gpu>, name: &str, lanes: usize) -> Result<CopyQueue, CudaError> {
        Self::with_options(gpu, name, lanes, true)
    }

    /// As [`with_lanes`](Self::with_lanes); `batch` false issues one copy call
    /// per piece even where the driver could batch them (for comparison).
    pub fn with_options(
        gpu: &Arc<Gpu>,
        name: &str,
        lanes: usize,
        batch: bool,
    ) -> Result<CopyQueue, CudaError> {
        gpu.bind()?;
        let mut queue = CopyQueue {
            gpu: gpu.clone(),
            lanes: Vec::new(),
            next: std::sync::atomic::AtomicUsize::new(0),
            batch: if batch { batch_copy() } else { None },
            batch_failed: std::sync::atomic::AtomicBool::new(false),
        };
        for i in 0..lanes.max(1) {
            // On failure the lanes made so far are torn down by the queue's drop.
            queue.lanes.push(Lane::new(gpu, &format!("{name}.{i}"))?);
        }
        Ok(queue)
    }

    /// How many streams copies are spread over.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Whether scattered pieces go in one batched call.
    pub fn batches(&self) -> bool {
        self.batch.is_some() && !self.batch_failed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Gathers `pieces` (offset, length) of `src` into the front of `buffer`, in
    /// order. The buffer and `src` stay held until the copy is done.
    pub fn to_host(
        &self,
        src: Arc<dyn DeviceMemory>,
        pieces: &[(u64, u64)],
        buffer: PinnedBuffer,
    ) -> Result<oneshot::Receiver<CopyDone>, (CudaError, PinnedBuffer)> {
        self.submit(Direction::ToHost, src, pieces, buffer)
    }

    /// Scatters the front of `buffer` into `pieces` of `dst`, in order.
    pub fn to_device(
        &self,
        dst: Arc<dyn DeviceMemory>,
        pieces: &[(u64, u64)],
        buffer: PinnedBuffer,
    ) -> Result<oneshot::Receiver<CopyDone>, (CudaError, PinnedBuffer)> {
        self.submit(Direction::ToDevice, dst, pieces, buffer)
    }

    fn submit(
        &self,
        direction: Direction,
        memory: Arc<dyn DeviceMemory>,
        pieces: &[(u64, u64)],
        buffer: PinnedBuffer,
    ) -> Result<oneshot::Receiver<CopyDone>, (CudaError, PinnedBuffer)> {
        if let Err(e) = check_pieces(memory.as_ref(), pieces, buffer.len) {
            return Err((e, buffer));
        }
        if let Err(e) = self.gpu.bind() {
            return Err((e, buffer));
        }
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % self.lanes.len();
        let lane = &self.lanes[i];
        let Ok(guard) = lane.pending.lock() else {
            return Err((CudaError::QueueStopped, buffer));
        };
        let Some(tx) = guard.as_ref() else {
            return Err((CudaError::QueueStopped, buffer));
        };
        let batch = self.batch.filter(|_| pieces.len() > 1 && self.batches());
        let mut enqueued = match batch {
            // SAFETY: as in `enqueue_each`: every piece lies inside `memory`
            // and the pieces fit `buffer`; both outlive the copies.
            Some(batch) => unsafe {
                enqueue_batch(batch, direction, lane, memory.as_ref(), pieces, &buffer)
            },
            // SAFETY: as above.
            None => unsafe { enqueue_each(direction, lane, memory.as_ref(), pieces, &buffer) },
        };
        if batch.is_some() && enqueued.is_err() {
            // The driver has the call but refused these copies: wait out what
            // it may have enqueued, stop batching on this queue, and copy the
            // pieces one by one as before batching existed.
            // SAFETY: the stream is ours and alive.
            let _ = unsafe { cu::stream::synchronize(lane.stream.0) };
            self.batch_failed
                .store(true, std::sync::atomic::Ordering::Relaxed);
            // SAFETY: as above.
            enqueued = unsafe { enqueue_each(direction, lane, memory.as_ref(), pieces, &buffer) };
        }
        if let Err(e) = enqueued {
            // Copies already enqueued may still be running: wait before the
            // buffer can be reused.
            // SAFETY: the stream is ours and alive.
            let _ = unsafe { cu::stream::synchronize(lane.stream.0) };
            return Err((e, buffer));
        }
        let event = match cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: the stream is ours and alive.
                let _ = unsafe { cu::stream::synchronize(lane.stream.0) };
                return Err((
                    CudaError::Driver {
                        call: "cuEventCreate",
                        message: describe(e),
                    },
                    buffer,
                ));
            }
        };
        // SAFETY: event and stream are valid and belong to the bound context.
        if let Err(e) = unsafe { cu::event::record(event, lane.stream.0) } {
            // SAFETY: as above; the event is destroyed once.
            unsafe {
                let _ = cu::stream::synchronize(lane.stream.0);
                let _ = cu::event::destroy(event);
            }
            return Err((
                CudaError::Driver {
                    call: "cuEventRecord",
                    message: describe(e),
                },
                buffer,
            ));
        }
        let (done_tx, done_rx) = oneshot::channel();
        let finish = Box::new(move |result: Result<(), CudaError>| {
            // The memory is released only now that the copy is over. A receiver
            // that gave up drops the buffer here, on the waiter thread.
            drop(memory);
            let _ = done_tx.send(CopyDone { buffer, result });
        });
        if tx
            .send(Pending {
                event: Event(event),
                finish,
            })
            .is_err()
        {
            // The waiter is gone (only during drop); nothing will report. The
            // closure (with the buffer) was dropped with the failed send.
            // SAFETY: wait for the copies, then release the event.
            unsafe {
                let _ = cu::stream::synchronize(lane.stream.0);
                let _ = cu::event::destroy(event);
            }
        }
        Ok(done_rx)
    }
}

/// One `cuMemcpy*Async` per piece, gathered into (or scattered from) the front
/// of `buffer` in order.
///
/// # Safety
/// `check_pieces` passed for these pieces, memory and buffer, and both stay
/// alive until the lane's next event completes.
unsafe fn enqueue_each(
    direction: Direction,
    lane: &Lane,
    memory: &dyn DeviceMemory,
    pieces: &[(u64, u64)],
    buffer: &PinnedBuffer,
) -> Result<(), CudaError> {
    let mut at = 0usize;
    for &(offset, len) in pieces {
        let device = memory.device_ptr() + offset;
        // SAFETY: the caller's contract: every piece lies inside `memory` and
        // the pieces together fit `buffer`.
        let r = unsafe {
            let host = buffer.ptr.add(at).cast::<c_void>();
            match direction {
                Direction::ToHost => {
                    sys::cuMemcpyDtoHAsync_v2(host, device, len as usize, lane.stream.0)
                }
                Direction::ToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(device, host, len as usize, lane.stream.0)
                }
            }
        };
        check(
            match direction {
                Direction::ToHost => "cuMemcpyDtoHAsync",
                Direction::ToDevice => "cuMemcpyHtoDAsync",
            },
            r,
        )?;
        at += len as usize;
    }
    Ok(())
}

/// All pieces in one `cuMemcpyBatchAsync` (stream-ordered: each source is read
/// after the stream's earlier work). Measured on the H100 machine: a staged
/// slice of 32 one-block pieces per copy call moved 7.7-7.9 GB/s, one piece
/// per slice 13.9-16.9 (docs/gpu.md).
///
/// # Safety
/// As [`enqueue_each`]; pinned host memory is addressed through unified
/// virtual addressing (its host pointer is its device address).
unsafe fn enqueue_batch(
    batch: BatchCopy,
    direction: Direction,
    lane: &Lane,
    memory: &dyn DeviceMemory,
    pieces: &[(u64, u64)],
    buffer: &PinnedBuffer,
) -> Result<(), CudaError> {
    let mut device = Vec::with_capacity(pieces.len());
    let mut host = Vec::with_capacity(pieces.len());
    let mut sizes = Vec::with_capacity(pieces.len());
    let mut at = 0u64;
    for &(offset, len) in pieces {
        device.push(memory.device_ptr() + offset);
        host.push(buffer.ptr as sys::CUdeviceptr + at);
        sizes.push(len as usize);
        at += len;
    }
    let (dsts, srcs) = match direction {
        Direction::ToHost => (&mut host, &mut device),
        Direction::ToDevice => (&mut device, &mut host),
    };
    let mut attrs = [sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        },
        dstLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        },
        flags: 0,
    }];
    let mut attr_first = [0usize];
    let mut fail = usize::MAX;
    // SAFETY: the arrays hold `pieces.len()` entries each and live through the
    // call (the driver copies the descriptors); the addresses are valid per
    // the caller's contract.
    let r = unsafe {
        batch(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            pieces.len(),
            attrs.as_mut_ptr(),
            attr_first.as_mut_ptr(),
            1,
            &mut fail,
            lane.stream.0,
        )
    };
    check("cuMemcpyBatchAsync", r).map_err(|e| match e {
        CudaError::Driver { call, message } if fail != usize::MAX => CudaError::Driver {
            call,
            message: format!("{message} (at piece {fail} of {})", pieces.len()),
        },
        e => e,
    })
}

fn check_pieces(
    memory: &dyn DeviceMemory,
    pieces: &[(u64, u64)],
    buffer: usize,
) -> Result<(), CudaError> {
    let mut total: u64 = 0;
    for &(offset, len) in pieces {
        if offset.checked_add(len).is_none_or(|e| e > memory.len()) {
            return Err(CudaError::OutOfBounds(format!(
                "piece {offset}+{len} of {} bytes of device memory",
                memory.len()
            )));
        }
        total = total.saturating_add(len);
    }
    if total > buffer as u64 {
        return Err(CudaError::OutOfBounds(format!(
            "{total} bytes of pieces for a {buffer}-byte staging buffer"
        )));
    }
    Ok(())
}

fn wait_loop(gpu: Arc<Gpu>, rx: mpsc::Receiver<Pending>) {
    let bound = gpu.bind();
    while let Ok(p) = rx.recv() {
        let result = match &bound {
            Err(e) => Err(CudaError::Driver {
                call: "cuCtxSetCurrent",
                message: e.to_string(),
            }),
            // SAFETY: the event was recorded on this queue's stream and is
            // destroyed right after, once.
            Ok(()) => unsafe {
                let r = cu::event::synchronize(p.event.0);
                let _ = cu::event::destroy(p.event.0);
                r.map_err(|e| CudaError::Driver {
                    call: "device copy",
                    message: describe(e),
                })
            },
        };
        (p.finish)(result);
    }
}

impl Lane {
    fn new(gpu: &Arc<Gpu>, name: &str) -> Result<Lane, CudaError> {
        gpu.bind()?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| {
            CudaError::Driver {
                call: "cuStreamCreate",
                message: describe(e),
            }
        })?;
        let (tx, rx) = mpsc::channel::<Pending>();
        let for_thread = gpu.clone();
        let waiter = std::thread::Builder::new()
            .name(format!("cuda-{name}"))
            .spawn(move || wait_loop(for_thread, rx));
        let waiter = match waiter {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: the stream was just created, carries nothing, and is
                // destroyed once.
                let _ = unsafe { cu::stream::destroy(stream) };
                return Err(CudaError::Driver {
                    call: "spawn copy waiter",
                    message: e.to_string(),
                });
            }
        };
        Ok(Lane {
            stream: Stream(stream),
            pending: Mutex::new(Some(tx)),
            waiter: Some(waiter),
        })
    }
}

impl Drop for CopyQueue {
    fn drop(&mut self) {
        for lane in &mut self.lanes {
            if let Ok(mut p) = lane.pending.lock() {
                p.take();
            }
            if let Some(w) = lane.waiter.take() {
                let _ = w.join();
            }
        }
        let _ = self.gpu.bind();
        for lane in &self.lanes {
            // SAFETY: every copy on the stream has completed (its waiter drained
            // them); the stream is destroyed once.
            let _ = unsafe { cu::stream::destroy(lane.stream.0) };
        }
    }
}

/// Unified memory: an existing host mapping (a worker's shared-memory KV file)
/// page-locked and mapped into the GPU's address space. Kernels read and write it
/// through [`device_ptr`](Self::device_ptr) (on integrated GPUs at full memory
/// speed), and the sidecar moves it as an ordinary host region (registered with
/// verbs directly where RDMA is present): no staging copy anywhere.
pub struct HostRegistration<'a> {
    gpu: Arc<Gpu>,
    host: *mut u8,
    device: sys::CUdeviceptr,
    len: u64,
    _mapping: std::marker::PhantomData<&'a kvrail_shm::SharedRegion>,
}

// SAFETY: the registration only records addresses; the mapping's owner keeps it alive.
unsafe impl Send for HostRegistration<'_> {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration<'_> {}

impl fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> HostRegistration<'a> {
    /// Pins a worker's shared-memory mapping for the GPU; the registration
    /// borrows the mapping, so it cannot outlive it.
    pub fn pin(gpu: &Arc<Gpu>, mapping: &'a kvrail_shm::SharedRegion) -> Result<Self, CudaError> {
        let host = mapping.as_mut_ptr();
        let len = mapping.len();
        gpu.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: `host..host + len` is the live mapping borrowed for 'a, which
        // outlives the registration (unregistered on drop).
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(host.cast(), len as usize, flags)
        })?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just registered with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        let reg = HostRegistration {
            gpu: gpu.clone(),
            host,
            device,
            len,
            _mapping: std::marker::PhantomData,
        };
        check("cuMemHostGetDevicePointer", r)?;
        Ok(reg)
    }

    /// The address kernels use for the same bytes.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Writes the test pattern into `[offset, offset + len)` with a GPU kernel,
    /// through the device mapping of the host pages.
    pub fn fill(&self, offset: u64, len: u64, seed: u32, first_word: u64) -> Result<(), CudaError> {
        let (o, w, f) = check_words(self.len, offset, len, first_word)?;
        kernels::run(
            &self.gpu,
            kernels::Op::Fill,
            &[(self.device + o, w, f)],
            seed,
        )
        .map(|_| ())
    }

    /// Counts pattern mismatches in `[offset, offset + len)`, on the GPU.
    pub fn count_mismatches(
        &self,
        offset: u64,
        len: u64,
        seed: u32,
        first_word: u64,
    ) -> Result<u64, CudaError> {
        let (o, w, f) = check_words(self.len, offset, len, first_word)?;
        kernels::run(
            &self.gpu,
            kernels::Op::Verify,
            &[(self.device + o, w, f)],
            seed,
        )
    }
}

/// Checks a word-aligned range of an allocation of `size` bytes; returns
/// (offset, words, first word).
fn check_words(
    size: u64,
    offset: u64,
    len: u64,
    first_word: u64,
) -> Result<(u64, u64, u64), CudaError> {
    if !offset.is_multiple_of(4)
        || !len.is_multiple_of(4)
        || offset.checked_add(len).is_none_or(|e| e > size)
    {
        return Err(CudaError::OutOfBounds(format!(
            "range {offset}+{len} of {size} bytes (offset and length must be multiples of 4)"
        )));
    }
    Ok((offset, len / 4, first_word))
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: registered in `new`, unregistered once.
        let _ = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
    }
}
