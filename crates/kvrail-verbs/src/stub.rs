//! Builds without the `rdma` feature: the same types, never constructed.

use std::any::Any;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::{Completion, Endpoint, Limits, QpConfig, VerbsError, WorkRequest};

fn unavailable() -> VerbsError {
    VerbsError::Unavailable("kvrail was built without the `rdma` feature".into())
}

/// Always "built without RDMA".
pub fn port_info(_device: &str, _port: u8) -> Result<crate::PortInfo, VerbsError> {
    Err(unavailable())
}

/// Always "built without RDMA".
pub fn verbs_library() -> Result<String, VerbsError> {
    Err(unavailable())
}

/// Always "built without RDMA".
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    Err(unavailable())
}

#[derive(Debug)]
enum Never {}

#[derive(Debug)]
pub struct Device(Never);

impl Device {
    pub fn open(_: IpAddr, _: Option<&str>, _: Option<u8>) -> Result<Arc<Device>, VerbsError> {
        Err(unavailable())
    }
    pub fn name(&self) -> &str {
        match self.0 {}
    }
    pub fn port(&self) -> u8 {
        match self.0 {}
    }
    pub fn gid_index(&self) -> u8 {
        match self.0 {}
    }
    pub fn gid(&self) -> [u8; 16] {
        match self.0 {}
    }
    pub fn limits(&self) -> Limits {
        match self.0 {}
    }
    pub fn check_port(&self) -> Result<(), VerbsError> {
        match self.0 {}
    }
    pub fn register_buffer(
        self: &Arc<Self>,
        _: Vec<u8>,
        _: crate::RemoteAccess,
    ) -> Result<MemoryRegion, VerbsError> {
        match self.0 {}
    }
    /// # Safety
    /// Never callable: no `Device` exists in this build.
    pub unsafe fn register(
        self: &Arc<Self>,
        _: *mut u8,
        _: usize,
        _: crate::RemoteAccess,
        _: Arc<dyn Any + Send + Sync>,
    ) -> Result<MemoryRegion, VerbsError> {
        match self.0 {}
    }
}

#[derive(Debug)]
pub struct MemoryRegion {
    never: Never,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
}

impl MemoryRegion {
    pub fn contains(&self, _: u64, _: u64) -> bool {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct QueuePair(Never);

impl QueuePair {
    pub fn create(device: &Arc<Device>, _: QpConfig) -> Result<QueuePair, VerbsError> {
        match device.0 {}
    }
    pub fn qp_num(&self) -> u32 {
        match self.0 {}
    }
    pub fn device(&self) -> &Arc<Device> {
        match self.0 {}
    }
    pub fn send_depth(&self) -> u32 {
        match self.0 {}
    }
    pub fn endpoint(&self) -> Result<Endpoint, VerbsError> {
        match self.0 {}
    }
    pub fn connect(&mut self, _: &Endpoint) -> Result<(), VerbsError> {
        match self.0 {}
    }
    pub fn post(&mut self, _: &[WorkRequest]) -> Result<(), VerbsError> {
        match self.0 {}
    }
    pub fn poll(&mut self, _: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        match self.0 {}
    }
    pub async fn wait(&mut self, _: &mut Vec<Completion>, _: Duration) -> Result<(), VerbsError> {
        match self.0 {}
    }
}
