//! Futex wait and wake on a word of a shared mapping: how one process sleeps
//! until another moves a ring index, without a system call on either side
//! while both are busy (the waker calls [`wake`] only when the sleeper said it
//! sleeps). Shared (not `FUTEX_PRIVATE_FLAG`) futexes, keyed by the page, so
//! two processes mapping the same file meet on the same word.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout`. Returns on a wake, a
/// changed word, the timeout or a signal; the caller re-checks its condition.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the aligned u32 `word` points to (a live
    // reference) and the timespec on our stack; it writes nothing.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process sleeping on `word`.
pub fn wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address as a key; `word` is live.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}
