//! The checked-in peer messages (`src/generated/`) are what
//! `proto/kvrail/v1/peer.proto` generates today. After changing the proto,
//! `KVRAIL_REGENERATE=1 cargo test -p kvrail-core --test generated_code`
//! rewrites them.

use std::path::Path;

#[test]
fn checked_in_peer_messages_match_the_proto() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto_dir = crate_dir.join("../../proto");
    let fds = protox::compile([proto_dir.join("kvrail/v1/peer.proto")], [&proto_dir])
        .expect("peer.proto compiles");
    let out = tempfile::tempdir().expect("temporary directory");
    prost_build::Config::new()
        .out_dir(out.path())
        .compile_fds(fds)
        .expect("prost generates the peer messages");
    let name = "kvrail.v1.peer.rs";
    let fresh = std::fs::read_to_string(out.path().join(name)).expect("generated file");
    let checked_in_path = crate_dir.join("src/generated").join(name);
    if std::env::var_os("KVRAIL_REGENERATE").is_some() {
        std::fs::write(&checked_in_path, &fresh).expect("rewrite the checked-in file");
        return;
    }
    let checked_in = std::fs::read_to_string(&checked_in_path).unwrap_or_default();
    assert!(
        checked_in == fresh,
        "{} is stale: run `KVRAIL_REGENERATE=1 cargo test -p kvrail-core --test generated_code`",
        checked_in_path.display()
    );
}
