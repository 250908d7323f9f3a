//! Two tiny kernels, shipped as PTX that the driver compiles for the device at
//! load time (no nvcc or NVRTC needed): fill a range with a pattern, and count
//! the words that differ from it. Workers use them to write KV blocks on the GPU
//! and to verify, on the GPU, what arrived.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::{check, describe, CudaError, Gpu};

/// Word `index` of the pattern for `seed`: a multiplicative hash of the index,
/// so that every word of a multi-GiB region differs from its neighbours.
pub fn pattern_word(seed: u32, index: u64) -> u32 {
    ((index as u32).wrapping_mul(0x9E37_79B1)) ^ ((index >> 32) as u32) ^ seed
}

/// Both kernels walk `words` 32-bit words from `buf` with a grid-stride loop;
/// word i's expected value is `pattern_word(seed, first + i)`.
const PTX: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry kvrail_fill(
    .param .u64 p_buf,
    .param .u64 p_words,
    .param .u64 p_first,
    .param .u32 p_seed,
    .param .u64 p_count
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_first];
    ld.param.u32 %r1, [p_seed];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r5, %r3;
FILL_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra FILL_DONE;
    add.u64 %rd7, %rd4, %rd3;
    cvt.u32.u64 %r6, %rd7;
    shr.u64 %rd8, %rd7, 32;
    cvt.u32.u64 %r7, %rd8;
    mul.lo.u32 %r6, %r6, 0x9E3779B1;
    xor.b32 %r6, %r6, %r7;
    xor.b32 %r6, %r6, %r1;
    shl.b64 %rd9, %rd4, 2;
    add.u64 %rd9, %rd1, %rd9;
    st.global.u32 [%rd9], %r6;
    add.u64 %rd4, %rd4, %rd6;
    bra.uni FILL_LOOP;
FILL_DONE:
    ret;
}

.visible .entry kvrail_verify(
    .param .u64 p_buf,
    .param .u64 p_words,
    .param .u64 p_first,
    .param .u32 p_seed,
    .param .u64 p_count
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<14>;

    ld.param.u64 %rd1, [p_buf];
    ld.param.u64 %rd2, [p_words];
    ld.param.u64 %rd3, [p_first];
    ld.param.u32 %r1, [p_seed];
    ld.param.u64 %rd10, [p_count];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd10, %rd10;
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r5, %r3;
VERIFY_LOOP:
    setp.ge.u64 %p1, %rd4, %rd2;
    @%p1 bra VERIFY_DONE;
    add.u64 %rd7, %rd4, %rd3;
    cvt.u32.u64 %r6, %rd7;
    shr.u64 %rd8, %rd7, 32;
    cvt.u32.u64 %r7, %rd8;
    mul.lo.u32 %r6, %r6, 0x9E3779B1;
    xor.b32 %r6, %r6, %r7;
    xor.b32 %r6, %r6, %r1;
    shl.b64 %rd9, %rd4, 2;
    add.u64 %rd9, %rd1, %rd9;
    ld.global.u32 %r8, [%rd9];
    setp.ne.u32 %p2, %r8, %r6;
    @%p2 atom.global.add.u64 %rd11, [%rd10], 1;
    add.u64 %rd4, %rd4, %rd6;
    bra.uni VERIFY_LOOP;
VERIFY_DONE:
    ret;
}
"#;

/// The loaded module and its two functions.
pub(crate) struct Kernels {
    module: sys::CUmodule,
    fill: sys::CUfunction,
    verify: sys::CUfunction,
}

// SAFETY: module and function handles are usable from any thread with the
// context bound; access goes through the Gpu's mutex.
unsafe impl Send for Kernels {}

impl Kernels {
    fn load() -> Result<Kernels, CudaError> {
        let image = std::ffi::CString::new(PTX).map_err(|e| CudaError::Driver {
            call: "kernel source",
            message: e.to_string(),
        })?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX string alive for the call.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        let function = |name: &str| -> Result<sys::CUfunction, CudaError> {
            let name = std::ffi::CString::new(name).map_err(|e| CudaError::Driver {
                call: "kernel name",
                message: e.to_string(),
            })?;
            // SAFETY: `module` was just loaded; the name is NUL-terminated.
            unsafe { cu::module::get_function(module, name) }.map_err(|e| CudaError::Driver {
                call: "cuModuleGetFunction",
                message: describe(e),
            })
        };
        Ok(Kernels {
            module,
            fill: function("kvrail_fill")?,
            verify: function("kvrail_verify")?,
        })
    }

    pub(crate) fn unload(self) {
        // SAFETY: loaded once in `load`, unloaded once; no launch is running
        // (launches synchronise before returning).
        let _ = unsafe { cu::module::unload(self.module) };
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Fill,
    Verify,
}

/// Runs one kernel over each `(device address, words, first word index)` range,
/// all launched back to back into one counter, and waits once for all of them.
/// Returns the mismatch count (0 for a fill).
pub(crate) fn run(
    gpu: &Arc<Gpu>,
    op: Op,
    ranges: &[(u64, u64, u64)],
    seed: u32,
) -> Result<u64, CudaError> {
    gpu.bind()?;
    let mut guard = gpu.kernels.lock().map_err(|_| CudaError::Driver {
        call: "kernel lock",
        message: "poisoned".into(),
    })?;
    if guard.is_none() {
        *guard = Some(Kernels::load()?);
    }
    let Some(k) = guard.as_ref() else {
        return Err(CudaError::QueueStopped);
    };
    let mut counter: sys::CUdeviceptr = 0;
    // SAFETY: valid out-pointer, 8 bytes.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut counter, 8) })?;
    let result = (|| {
        // SAFETY: `counter` is an 8-byte allocation.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(counter, 0, 8) })?;
        let function = match op {
            Op::Fill => k.fill,
            Op::Verify => k.verify,
        };
        const THREADS: u32 = 256;
        for &(buf, words, first) in ranges {
            let (mut p_buf, mut p_words, mut p_first, mut p_seed, mut p_count) =
                (buf, words, first, seed, counter);
            let mut params: [*mut c_void; 5] = [
                (&mut p_buf as *mut u64).cast(),
                (&mut p_words as *mut u64).cast(),
                (&mut p_first as *mut u64).cast(),
                (&mut p_seed as *mut u32).cast(),
                (&mut p_count as *mut u64).cast(),
            ];
            let blocks = words.div_ceil(u64::from(THREADS)).clamp(1, 4096) as u32;
            // SAFETY: the parameters match the kernels' signatures (u64, u64, u64,
            // u32, u64) and are copied by the launch call; the callers bounds-checked
            // each `buf..buf + 4 * words`. The synchronize below makes every launch
            // finish before the counter is read and freed.
            unsafe {
                cu::launch_kernel(
                    function,
                    (blocks, 1, 1),
                    (THREADS, 1, 1),
                    0,
                    std::ptr::null_mut(),
                    &mut params,
                )
            }
            .map_err(|e| CudaError::Driver {
                call: "cuLaunchKernel",
                message: describe(e),
            })?;
        }
        cu::ctx::synchronize().map_err(|e| CudaError::Driver {
            call: "kernel",
            message: describe(e),
        })?;
        let mut count = 0u64;
        // SAFETY: 8 bytes from an 8-byte allocation into a u64.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2((&mut count as *mut u64).cast(), counter, 8)
        })?;
        Ok(count)
    })();
    if result.is_err() {
        // A failed launch may leave others running on the counter.
        let _ = cu::ctx::synchronize();
    }
    // SAFETY: allocated above, freed once, after every launch finished.
    let _ = unsafe { sys::cuMemFree_v2(counter) };
    result
}

#[cfg(test)]
mod tests {
    use super::pattern_word;

    #[test]
    fn pattern_words_differ_and_depend_on_the_seed() {
        assert_ne!(pattern_word(1, 0), pattern_word(2, 0));
        assert_ne!(pattern_word(1, 5), pattern_word(1, 6));
        // The high half of the index matters too (regions over 16 GiB).
        assert_ne!(pattern_word(1, 7), pattern_word(1, 7 + (1 << 32)));
    }
}
