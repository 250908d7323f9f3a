//! The fuzz targets, briefly, as CI runs them: each target's seeds and
//! committed corpus, then a few seconds of mutations (a fixed seed, so a
//! failure reproduces with `kvrail-fuzz TARGET --seed 1`). The long runs are
//! in docs/fuzzing.md.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::path::Path;
use std::time::Duration;

#[test]
fn every_target_survives_its_corpus_and_a_short_run() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for target in kvrail_fuzz::TARGETS {
        let report =
            kvrail_fuzz::mutate::run(target, &corpus.join(target), Duration::from_secs(3), 1)
                .unwrap();
        println!("{}", report.to_json());
        assert!(report.crash.is_none(), "{}", report.to_json());
        assert!(report.executions > 100, "{}", report.to_json());
    }
}
