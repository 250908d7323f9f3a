//! Types and gRPC stubs of the kvrail local worker API (`kvrail.v1`).
#![allow(clippy::doc_markdown, missing_docs)]

/// Everything generated from `proto/kvrail/v1/sidecar.proto`.
pub mod v1 {
    tonic::include_proto!("kvrail.v1");
}

pub use v1::*;
