//! Generates the local API (`proto/kvrail/v1/sidecar.proto`) with protox and tonic.
fn main() {
    let file = "../../proto/kvrail/v1/sidecar.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["../../proto"]).expect("sidecar.proto must compile");
    tonic_prost_build::configure()
        .compile_fds(fds)
        .expect("tonic codegen for sidecar.proto");
}
