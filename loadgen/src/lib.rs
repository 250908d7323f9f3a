//! loadgen's reusable parts: starting real sidecar processes (on loopback or in a
//! namespaced multi-rail lab), shared with the end-to-end tests.

pub mod cluster;
pub mod etcd_nodes;
pub mod netlab;
pub mod prometheus;
