//! With the SIGBUS guard installed, a mapping it cannot cover is refused, not
//! kept unguarded (its own process: it fills the process-wide table).
#![allow(clippy::unwrap_used)]

use kvrail_shm::{guard, SharedRegion, ShmError};

#[test]
fn a_full_guard_table_refuses_new_mappings_until_one_is_freed() {
    guard::install().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let first = SharedRegion::create(dir.path().join("first"), 4096).unwrap();
    assert!(first.is_guarded());
    // Every other slot taken.
    let mut held = Vec::new();
    loop {
        let e = guard::enter(0x1000 * (held.len() + 1), 4096);
        if !e.is_guarded() {
            break;
        }
        held.push(e);
    }
    assert_eq!(held.len(), guard::MAX_MAPPINGS - 1);
    let err = SharedRegion::create(dir.path().join("second"), 4096).unwrap_err();
    assert!(matches!(err, ShmError::GuardFull(_)), "{err}");
    assert!(err.to_string().contains("4096 mappings"), "{err}");
    // One freed: the next mapping is covered again.
    drop(first);
    let again = SharedRegion::create(dir.path().join("third"), 4096).unwrap();
    assert!(again.is_guarded());
    drop(held);
}
