//! Generates the peer wire messages from `proto/kvrail/v1/peer.proto` with protox,
//! so no system `protoc` is needed.
fn main() {
    let proto_dir = "../../proto";
    let file = "../../proto/kvrail/v1/peer.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], [proto_dir]).expect("peer.proto must compile");
    prost_build::Config::new()
        .compile_fds(fds)
        .expect("prost codegen for peer.proto");
}
