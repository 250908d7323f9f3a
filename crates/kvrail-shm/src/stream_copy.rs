//! Copies that land received bytes in a region without passing them through
//! this core's cache.
//!
//! A receiver that must copy (QUIC hands its payload over in quinn's buffers)
//! writes each byte once into a region no one on this core reads again: the
//! decode worker or the GPU reads the blocks later. An ordinary copy first
//! reads every destination line into the cache (a read for ownership) and
//! evicts warmer lines to make room; non-temporal stores write whole lines
//! straight to memory. On the 16-core Xeon, one thread moving 64 KiB chunks
//! from a warm buffer into a 256 MiB region: 7.7 GB/s with `memcpy`, 12.2 GB/s
//! streaming (`tools/bench/landing.c`, docs/benchmarks.md, [landing-16core]).
//!
//! Small copies keep the ordinary path: their destination is likely read soon
//! (a 4 KiB block the decode worker is waiting for), and each streaming copy
//! ends with a store fence, which costs more than a short copy saves.

/// Copies shorter than this are ordinary copies.
pub const STREAMING_MIN_BYTES: usize = 16 << 10;

/// Copies `src` into `dst` (same lengths), with non-temporal stores from
/// [`STREAMING_MIN_BYTES`] up where the CPU has them (x86-64), and ends with a
/// store fence so that the bytes are ordered before whatever this thread
/// stores next (the completion that tells a worker its blocks are there).
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    if src.len() < STREAMING_MIN_BYTES {
        dst.copy_from_slice(src);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::copy_streaming(dst, src);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    const LINE: usize = 64;

    pub(super) fn copy_streaming(dst: &mut [u8], src: &[u8]) {
        // Up to the first cache line boundary of the destination, an ordinary
        // copy: streaming stores want 16-byte alignment and whole lines.
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let lines = (dst.len() - head) / LINE;
        let body = head + lines * LINE;
        let d = dst[head..body].as_mut_ptr();
        let s = src[head..body].as_ptr();
        for i in 0..lines {
            // SAFETY: SSE2 is part of x86-64. Both ranges lie inside the
            // slices just split off (`lines` whole lines from `head`); the
            // loads are unaligned loads; each store goes to `d + i*64 + k*16`,
            // 16-byte aligned because `d` is 64-byte aligned. `dst` is borrowed
            // mutably, so nothing else in this process reads or writes it
            // meanwhile.
            unsafe {
                let from = s.add(i * LINE);
                let to = d.add(i * LINE);
                let a = _mm_loadu_si128(from.cast::<__m128i>());
                let b = _mm_loadu_si128(from.add(16).cast::<__m128i>());
                let c = _mm_loadu_si128(from.add(32).cast::<__m128i>());
                let e = _mm_loadu_si128(from.add(48).cast::<__m128i>());
                _mm_stream_si128(to.cast::<__m128i>(), a);
                _mm_stream_si128(to.add(16).cast::<__m128i>(), b);
                _mm_stream_si128(to.add(32).cast::<__m128i>(), c);
                _mm_stream_si128(to.add(48).cast::<__m128i>(), e);
            }
        }
        // Non-temporal stores are weakly ordered: fence them before any store
        // that publishes the bytes (another thread may read them after it).
        // SAFETY: SSE is part of x86-64; a fence has no operands.
        unsafe { _mm_sfence() };
        dst[body..].copy_from_slice(&src[body..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and misalignment around the thresholds lands exactly the
    /// source's bytes, and nothing outside the destination range.
    #[test]
    fn lands_exactly_its_bytes_at_every_offset_and_length() {
        let src: Vec<u8> = (0..(STREAMING_MIN_BYTES * 3))
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let lengths = [
            0,
            1,
            63,
            STREAMING_MIN_BYTES - 1,
            STREAMING_MIN_BYTES,
            STREAMING_MIN_BYTES + 1,
            STREAMING_MIN_BYTES + 63,
            2 * STREAMING_MIN_BYTES + 65,
        ];
        for len in lengths {
            for dst_off in [0usize, 1, 15, 16, 33, 64] {
                for src_off in [0usize, 1, 31] {
                    let mut region = vec![0xEEu8; len + dst_off + 128];
                    copy_streaming(
                        &mut region[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                    );
                    assert!(
                        region[..dst_off].iter().all(|&b| b == 0xEE),
                        "before, len {len}"
                    );
                    assert_eq!(
                        &region[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "len {len} dst+{dst_off} src+{src_off}"
                    );
                    assert!(
                        region[dst_off + len..].iter().all(|&b| b == 0xEE),
                        "after, len {len}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_slices_of_different_lengths() {
        copy_streaming(&mut [0u8; 4], &[1u8; 5]);
    }
}
