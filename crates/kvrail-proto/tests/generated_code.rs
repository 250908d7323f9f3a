//! The checked-in API types and stubs (`src/generated/`) are what
//! `proto/kvrail/v1/sidecar.proto` generates today. After changing the proto,
//! `KVRAIL_REGENERATE=1 cargo test -p kvrail-proto --test generated_code`
//! rewrites them.

use std::path::Path;

#[test]
fn checked_in_api_code_matches_the_proto() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto_dir = crate_dir.join("../../proto");
    let fds = protox::compile([proto_dir.join("kvrail/v1/sidecar.proto")], [&proto_dir])
        .expect("sidecar.proto compiles");
    let out = tempfile::tempdir().expect("temporary directory");
    tonic_prost_build::configure()
        .out_dir(out.path())
        .compile_fds(fds)
        .expect("tonic generates the API");
    let name = "kvrail.v1.rs";
    let fresh = std::fs::read_to_string(out.path().join(name)).expect("generated file");
    let checked_in_path = crate_dir.join("src/generated").join(name);
    if std::env::var_os("KVRAIL_REGENERATE").is_some() {
        std::fs::write(&checked_in_path, &fresh).expect("rewrite the checked-in file");
        return;
    }
    let checked_in = std::fs::read_to_string(&checked_in_path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "{} is stale: run `KVRAIL_REGENERATE=1 cargo test -p kvrail-proto --test generated_code`",
        checked_in_path.display()
    );
}
