//! The libibverbs calls, each behind a safe type that owns its object.

use std::any::Any;
use std::ffi::CStr;
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{null_mut, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sys::{self, *};
use tokio::io::unix::AsyncFd;

use crate::{
    gid_of, Completion, CompletionError, Endpoint, Limits, Opcode, PortInfo, QpConfig, VerbsError,
    WorkRequest, RECV_SLOT_BYTES,
};

fn last_error(op: &'static str, device: &str) -> VerbsError {
    VerbsError::Call {
        op,
        device: device.to_string(),
        source: io::Error::last_os_error(),
    }
}

/// libibverbs, or why RDMA is off on this host.
fn loaded() -> Result<&'static Lib, VerbsError> {
    sys::lib().map_err(VerbsError::Unavailable)
}

fn call(op: &'static str, device: &str, rc: i32) -> Result<(), VerbsError> {
    if rc == 0 {
        return Ok(());
    }
    // Verbs calls return the errno, or -1 with errno set.
    let source = if rc > 0 {
        io::Error::from_raw_os_error(rc)
    } else {
        io::Error::last_os_error()
    };
    Err(VerbsError::Call {
        op,
        device: device.to_string(),
        source,
    })
}

/// The libibverbs this process loaded (its soname), or why RDMA is off.
pub fn verbs_library() -> Result<String, VerbsError> {
    loaded().map(|lib| lib.path.clone())
}

/// A device port as verbs reports it, for diagnostics (`kvrail doctor`).
pub fn port_info(device: &str, port: u8) -> Result<PortInfo, VerbsError> {
    let lib = loaded()?;
    let (ctx, _guard) = open_context(device)?;
    let mut pa: ibv_port_attr = zeroed();
    // SAFETY: ctx is open (closed by the guard after); pa is a valid out-pointer.
    call("ibv_query_port", device, unsafe {
        (lib.query_port)(ctx.as_ptr(), port, &mut pa)
    })?;
    Ok(PortInfo {
        state: port_state_name(pa.state),
        active: pa.state == IBV_PORT_ACTIVE,
        active_mtu: mtu_bytes(pa.active_mtu),
        max_mtu: mtu_bytes(pa.max_mtu),
        ethernet: pa.link_layer == 2,
    })
}

/// Names of the RDMA devices on this host, or why there are none.
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let lib = loaded()?;
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        let e = io::Error::last_os_error();
        let why = if e.raw_os_error() == Some(libc::ENOSYS) {
            "this kernel has no RDMA support (ibv_get_device_list: ENOSYS)".to_string()
        } else {
            format!("ibv_get_device_list failed: {e}")
        };
        return Err(VerbsError::Unavailable(why));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let name = unsafe { CStr::from_ptr((lib.get_device_name)(*list.add(i))) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { (lib.free_device_list)(list) };
    if names.is_empty() {
        return Err(VerbsError::Unavailable(
            "no RDMA devices on this host".into(),
        ));
    }
    Ok(names)
}

/// One device port, opened, with a protection domain.
pub struct Device {
    lib: &'static Lib,
    ctx: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
    name: String,
    port: u8,
    gid_index: u8,
    gid: [u8; 16],
    limits: Limits,
}

// SAFETY: libibverbs objects may be used from any thread; the context and PD are
// only destroyed in Drop, when no other reference exists.
unsafe impl Send for Device {}
// SAFETY: as above; every call on them is thread-safe per the verbs API.
unsafe impl Sync for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Device({} port {} gid {})",
            self.name, self.port, self.gid_index
        )
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc of this device, so none is left.
        unsafe {
            (self.lib.dealloc_pd)(self.pd.as_ptr());
            (self.lib.close_device)(self.ctx.as_ptr());
        }
    }
}

fn port_state_name(s: u32) -> &'static str {
    match s {
        IBV_PORT_ACTIVE => "active",
        IBV_PORT_DOWN => "down",
        IBV_PORT_INIT => "initializing",
        IBV_PORT_ARMED => "armed",
        IBV_PORT_ACTIVE_DEFER => "active (deferred)",
        _ => "in an unknown state",
    }
}

fn mtu_bytes(m: u32) -> u32 {
    match m {
        IBV_MTU_256 => 256,
        IBV_MTU_512 => 512,
        IBV_MTU_1024 => 1024,
        IBV_MTU_2048 => 2048,
        _ => 4096,
    }
}

fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        0..=256 => IBV_MTU_256,
        257..=512 => IBV_MTU_512,
        513..=1024 => IBV_MTU_1024,
        1025..=2048 => IBV_MTU_2048,
        _ => IBV_MTU_4096,
    }
}

/// Whether sysfs calls this GID a RoCE v2 one (routable over UDP/IP).
fn is_roce_v2(device: &str, port: u8, index: i32) -> bool {
    let path = format!("/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}");
    std::fs::read_to_string(path).is_ok_and(|t| t.trim().eq_ignore_ascii_case("RoCE v2"))
}

impl Device {
    /// Opens the device port whose GID table holds `ip` (preferring a RoCE v2
    /// entry), or, with `name`, that device, using `ip`'s GID if it has one and
    /// else `gid_index`.
    pub fn open(
        ip: IpAddr,
        name: Option<&str>,
        gid_index: Option<u8>,
    ) -> Result<Arc<Device>, VerbsError> {
        let wanted = gid_of(ip);
        let names = device_names()?;
        let mut fallback: Option<(String, u8, u8)> = None;
        for dev in &names {
            if name.is_some_and(|n| n != dev) {
                continue;
            }
            let Some(found) = Self::find_gid(dev, &wanted)? else {
                if let (Some(_), Some(g)) = (name, gid_index) {
                    fallback = Some((dev.clone(), 1, g));
                }
                continue;
            };
            return Self::open_port(dev, found.0, found.1);
        }
        match fallback {
            Some((dev, port, g)) => Self::open_port(&dev, port, g),
            None => Err(VerbsError::NoDeviceFor(ip)),
        }
    }

    /// (port, gid index) of `dev` whose GID equals `wanted`.
    fn find_gid(dev: &str, wanted: &[u8; 16]) -> Result<Option<(u8, u8)>, VerbsError> {
        let lib = loaded()?;
        let (ctx, _guard) = open_context(dev)?;
        let mut attr: ibv_device_attr = zeroed();
        // SAFETY: ctx is open; attr is a valid out-pointer.
        call("ibv_query_device", dev, unsafe {
            (lib.query_device)(ctx.as_ptr(), &mut attr)
        })?;
        let mut best = None;
        for port in 1..=attr.phys_port_cnt {
            let mut pa: ibv_port_attr = zeroed();
            // SAFETY: as above.
            if unsafe { (lib.query_port)(ctx.as_ptr(), port, &mut pa) } != 0 {
                continue;
            }
            for index in 0..pa.gid_tbl_len.min(256) {
                let mut gid: ibv_gid = zeroed();
                // SAFETY: index is below the table length; gid is an out-pointer.
                if unsafe { (lib.query_gid)(ctx.as_ptr(), port, index, &mut gid) } != 0 {
                    continue;
                }
                // SAFETY: ibv_gid is a union of plain bytes.
                let raw = unsafe { gid.raw };
                if &raw == wanted {
                    if is_roce_v2(dev, port, index) {
                        return Ok(Some((port, index as u8)));
                    }
                    best.get_or_insert((port, index as u8));
                }
            }
        }
        Ok(best)
    }

    fn open_port(dev: &str, port: u8, gid_index: u8) -> Result<Arc<Device>, VerbsError> {
        let lib = loaded()?;
        let (ctx, guard) = open_context(dev)?;
        let mut attr: ibv_device_attr = zeroed();
        // SAFETY: ctx is open; attr is a valid out-pointer.
        call("ibv_query_device", dev, unsafe {
            (lib.query_device)(ctx.as_ptr(), &mut attr)
        })?;
        let mut gid: ibv_gid = zeroed();
        // SAFETY: as above.
        call("ibv_query_gid", dev, unsafe {
            (lib.query_gid)(ctx.as_ptr(), port, i32::from(gid_index), &mut gid)
        })?;
        // SAFETY: ctx is open.
        let pd = NonNull::new(unsafe { (lib.alloc_pd)(ctx.as_ptr()) })
            .ok_or_else(|| last_error("ibv_alloc_pd", dev))?;
        std::mem::forget(guard);
        let pos = |v: i32| v.max(0) as u32;
        Ok(Arc::new(Device {
            lib,
            ctx,
            pd,
            name: dev.to_string(),
            port,
            gid_index,
            // SAFETY: ibv_gid is a union of plain bytes.
            gid: unsafe { gid.raw },
            limits: Limits {
                max_sge: pos(attr.max_sge),
                max_qp_wr: pos(attr.max_qp_wr),
                max_qp_rd_atom: pos(attr.max_qp_rd_atom),
                max_qp_init_rd_atom: pos(attr.max_qp_init_rd_atom),
                max_cqe: pos(attr.max_cqe),
            },
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn port(&self) -> u8 {
        self.port
    }

    pub fn gid_index(&self) -> u8 {
        self.gid_index
    }

    pub fn gid(&self) -> [u8; 16] {
        self.gid
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn port_attr(&self) -> Result<ibv_port_attr, VerbsError> {
        let mut pa: ibv_port_attr = zeroed();
        // SAFETY: the context is open for the device's lifetime.
        call("ibv_query_port", &self.name, unsafe {
            (self.lib.query_port)(self.ctx.as_ptr(), self.port, &mut pa)
        })?;
        Ok(pa)
    }

    /// Ok if the port can carry traffic now.
    pub fn check_port(&self) -> Result<(), VerbsError> {
        let pa = self.port_attr()?;
        if pa.state == IBV_PORT_ACTIVE {
            return Ok(());
        }
        Err(VerbsError::PortNotActive {
            device: self.name.clone(),
            port: self.port,
            state: port_state_name(pa.state),
        })
    }

    /// Registers a buffer the registration owns (freed with it): the safe
    /// form of [`Device::register`], for buffers of the driver's own.
    pub fn register_buffer(
        self: &Arc<Self>,
        buffer: Vec<u8>,
        remote: crate::RemoteAccess,
    ) -> Result<MemoryRegion, VerbsError> {
        let mut buffer = buffer.into_boxed_slice();
        let (ptr, len) = (buffer.as_mut_ptr(), buffer.len());
        // Moving the box into the owner does not move its heap block.
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(buffer);
        // SAFETY: the block stays allocated while `owner` lives, and the MR
        // keeps `owner` until it is deregistered; nothing else reaches it.
        unsafe { self.register(ptr, len, remote, owner) }
    }

    /// Registers `[addr, addr + len)` for local writes and what `remote`
    /// allows a peer holding its key.
    ///
    /// # Safety
    /// The memory must stay mapped for as long as `owner` is alive; the region
    /// keeps `owner` until it is deregistered.
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        remote: crate::RemoteAccess,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<MemoryRegion, VerbsError> {
        let access = IBV_ACCESS_LOCAL_WRITE
            | match remote {
                crate::RemoteAccess::None => 0,
                crate::RemoteAccess::Write => IBV_ACCESS_REMOTE_WRITE,
                crate::RemoteAccess::ReadWrite => IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
            };
        // SAFETY: the caller guarantees the range is mapped while `owner` lives,
        // and the MR keeps `owner`.
        let mr = unsafe { (self.lib.reg_mr)(self.pd.as_ptr(), addr.cast(), len, access as i32) };
        let mr = NonNull::new(mr).ok_or_else(|| last_error("ibv_reg_mr", &self.name))?;
        // SAFETY: a registered MR is valid until ibv_dereg_mr.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(MemoryRegion {
            mr,
            addr: addr as u64,
            len: len as u64,
            lkey,
            rkey,
            _device: self.clone(),
            _owner: owner,
        })
    }
}

/// Closes a context opened for a lookup unless it is kept.
struct CtxGuard(*mut ibv_context, &'static Lib);

impl Drop for CtxGuard {
    fn drop(&mut self) {
        // SAFETY: the pointer came from ibv_open_device and is closed once.
        unsafe { (self.1.close_device)(self.0) };
    }
}

fn open_context(dev: &str) -> Result<(NonNull<ibv_context>, CtxGuard), VerbsError> {
    let lib = loaded()?;
    let mut n = 0i32;
    // SAFETY: valid out-pointer; the list is freed below.
    let list = unsafe { (lib.get_device_list)(&mut n) };
    if list.is_null() {
        return Err(last_error("ibv_get_device_list", dev));
    }
    let mut ctx = null_mut();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let d = unsafe { *list.add(i) };
        // SAFETY: as above.
        let name = unsafe { CStr::from_ptr((lib.get_device_name)(d)) };
        if name.to_bytes() == dev.as_bytes() {
            // SAFETY: d is a valid device of the list, opened before the list is freed.
            ctx = unsafe { (lib.open_device)(d) };
            break;
        }
    }
    // SAFETY: freed once; opened contexts stay valid after it.
    unsafe { (lib.free_device_list)(list) };
    let ctx = NonNull::new(ctx).ok_or_else(|| last_error("ibv_open_device", dev))?;
    Ok((ctx, CtxGuard(ctx.as_ptr(), lib)))
}

fn zeroed<T>() -> T {
    // SAFETY: only used for the C attribute structs of libibverbs, for which
    // all-zero bytes are a valid (empty) value.
    unsafe { std::mem::zeroed() }
}

/// A registered memory region.
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    _device: Arc<Device>,
    _owner: Arc<dyn Any + Send + Sync>,
}

// SAFETY: an MR handle is only read (keys) and deregistered once in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MemoryRegion({:#x}+{} rkey {:#x})",
            self.addr, self.len, self.rkey
        )
    }
}

impl MemoryRegion {
    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `Device::register` and deregistered once; the
        // owner (the mapping) is dropped after this.
        unsafe { (self._device.lib.dereg_mr)(self.mr.as_ptr()) };
    }
}

/// The bit that marks a receive's work request id.
const RECV_BIT: u64 = 1 << 63;

/// A reliable-connected queue pair with its own completion queue and channel.
pub struct QueuePair {
    device: Arc<Device>,
    channel: NonNull<ibv_comp_channel>,
    cq: NonNull<ibv_cq>,
    qp: NonNull<ibv_qp>,
    psn: u32,
    config: QpConfig,
    // Deregistered before the buffer it covers is freed (field order).
    recv_mr: Option<MemoryRegion>,
    recv_buf: Box<[u8]>,
    wait: Option<AsyncFd<RawFd>>,
    unacked_events: u32,
    wcs: Vec<ibv_wc>,
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
}

// SAFETY: the queue pair is used by one task at a time (&mut self for posting
// and polling); verbs objects are thread-safe anyway.
unsafe impl Send for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueuePair({} qpn {})", self.device.name, self.qp_num())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Leave the reactor before the channel's descriptor is closed.
        drop(self.wait.take());
        // SAFETY: destroyed once, QP before CQ before channel, after acknowledging
        // every CQ event (ibv_destroy_cq waits for that); the receive MR drops after.
        unsafe {
            (self.device.lib.destroy_qp)(self.qp.as_ptr());
            if self.unacked_events > 0 {
                (self.device.lib.ack_cq_events)(self.cq.as_ptr(), self.unacked_events);
            }
            (self.device.lib.destroy_cq)(self.cq.as_ptr());
            (self.device.lib.destroy_comp_channel)(self.channel.as_ptr());
        }
    }
}

impl QueuePair {
    /// Creates a queue pair on `device`, moves it to INIT and posts its receives.
    /// Must run inside a tokio runtime (its completion channel is registered there).
    pub fn create(device: &Arc<Device>, config: QpConfig) -> Result<QueuePair, VerbsError> {
        let name = device.name.clone();
        let lim = device.limits;
        let send_depth = config.send_depth.min(lim.max_qp_wr).max(16);
        let recv_depth = config.recv_depth.min(lim.max_qp_wr).max(4);
        let cqe = (send_depth + recv_depth).min(lim.max_cqe.max(64)) as i32;
        // SAFETY: the context is open.
        let channel =
            NonNull::new(unsafe { (device.lib.create_comp_channel)(device.ctx.as_ptr()) })
                .ok_or_else(|| last_error("ibv_create_comp_channel", &name))?;
        // SAFETY: as above; the channel outlives the CQ (Drop order).
        let cq = unsafe {
            (device.lib.create_cq)(device.ctx.as_ptr(), cqe, null_mut(), channel.as_ptr(), 0)
        };
        let Some(cq) = NonNull::new(cq) else {
            let e = last_error("ibv_create_cq", &name);
            // SAFETY: created above, not used elsewhere.
            unsafe { (device.lib.destroy_comp_channel)(channel.as_ptr()) };
            return Err(e);
        };
        let mut ia: ibv_qp_init_attr = zeroed();
        ia.send_cq = cq.as_ptr();
        ia.recv_cq = cq.as_ptr();
        ia.qp_type = IBV_QPT_RC;
        ia.sq_sig_all = 0;
        ia.cap.max_send_wr = send_depth;
        ia.cap.max_recv_wr = recv_depth;
        ia.cap.max_send_sge = lim.max_sge.clamp(1, 30);
        ia.cap.max_recv_sge = 1;
        ia.cap.max_inline_data = RECV_SLOT_BYTES;
        // SAFETY: pd and cq are valid; ia is fully initialised.
        let qp = unsafe { (device.lib.create_qp)(device.pd.as_ptr(), &mut ia) };
        let Some(qp) = NonNull::new(qp) else {
            let e = last_error("ibv_create_qp", &name);
            // SAFETY: created above, not used elsewhere.
            unsafe {
                (device.lib.destroy_cq)(cq.as_ptr());
                (device.lib.destroy_comp_channel)(channel.as_ptr());
            }
            return Err(e);
        };
        let mut me = QueuePair {
            device: device.clone(),
            channel,
            cq,
            qp,
            psn: rand_psn(),
            config: QpConfig {
                send_depth,
                recv_depth,
                ..config
            },
            recv_mr: None,
            recv_buf: vec![0u8; (recv_depth * RECV_SLOT_BYTES) as usize].into_boxed_slice(),
            wait: None,
            unacked_events: 0,
            wcs: Vec::new(),
            sges: Vec::new(),
            wrs: Vec::new(),
        };
        // From here on an error drops `me`, whose Drop destroys what was created.
        // SAFETY: the channel's fd is valid while the channel lives.
        let fd = unsafe { (*channel.as_ptr()).fd };
        set_nonblocking(fd).map_err(|source| VerbsError::Call {
            op: "fcntl(O_NONBLOCK)",
            device: name.clone(),
            source,
        })?;
        // SAFETY: the channel's descriptor stays open until Drop, which drops the
        // AsyncFd before destroying the channel.
        let wait = unsafe { AsyncFd::register(fd) }.map_err(|e| VerbsError::Call {
            op: "AsyncFd::register",
            device: name.clone(),
            source: e.into(),
        })?;
        me.wait = Some(wait);
        let ptr = me.recv_buf.as_mut_ptr();
        let len = me.recv_buf.len();
        // SAFETY: the receive buffer is a boxed slice owned by the queue pair (its
        // heap block never moves) and the MR is dropped before it (field order).
        me.recv_mr =
            Some(unsafe { device.register(ptr, len, crate::RemoteAccess::None, Arc::new(())) }?);
        me.modify_init()?;
        for slot in 0..recv_depth {
            me.post_recv(slot)?;
        }
        me.arm()?;
        Ok(me)
    }

    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is valid while self lives.
        unsafe { (*self.qp.as_ptr()).qp_num }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Send queue slots.
    pub fn send_depth(&self) -> u32 {
        self.config.send_depth
    }

    /// This queue pair's address for the peer.
    pub fn endpoint(&self) -> Result<Endpoint, VerbsError> {
        let pa = self.device.port_attr()?;
        Ok(Endpoint {
            qp_num: self.qp_num(),
            psn: self.psn,
            gid: self.device.gid,
            mtu: mtu_bytes(pa.active_mtu),
        })
    }

    fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: i32,
        what: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: the QP is valid; attr is initialised for the bits in mask.
        call(what, &self.device.name, unsafe {
            (self.device.lib.modify_qp)(self.qp.as_ptr(), attr, mask)
        })
    }

    fn modify_init(&self) -> Result<(), VerbsError> {
        let mut at: ibv_qp_attr = zeroed();
        at.qp_state = IBV_QPS_INIT;
        at.port_num = self.device.port;
        at.pkey_index = 0;
        at.qp_access_flags =
            (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE) as _;
        let m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        self.modify(&mut at, m, "ibv_modify_qp(INIT)")
    }

    /// Connects to the peer's queue pair: RTR, then RTS.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError> {
        let local_mtu = mtu_bytes(self.device.port_attr()?.active_mtu);
        let rd_atom = |v: u32| v.clamp(1, 16) as u8;
        let mut at: ibv_qp_attr = zeroed();
        at.qp_state = IBV_QPS_RTR;
        at.path_mtu = mtu_enum(local_mtu.min(remote.mtu));
        at.dest_qp_num = remote.qp_num;
        at.rq_psn = remote.psn;
        at.max_dest_rd_atomic = rd_atom(self.device.limits.max_qp_rd_atom);
        at.min_rnr_timer = self.config.min_rnr_timer.min(31);
        at.ah_attr.is_global = 1;
        at.ah_attr.grh.dgid.raw = remote.gid;
        at.ah_attr.grh.sgid_index = self.device.gid_index;
        at.ah_attr.grh.hop_limit = 64;
        at.ah_attr.port_num = self.device.port;
        let m = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut at, m, "ibv_modify_qp(RTR)")?;
        let mut at: ibv_qp_attr = zeroed();
        at.qp_state = IBV_QPS_RTS;
        at.timeout = self.config.timeout;
        at.retry_cnt = self.config.retry_cnt.min(7);
        at.rnr_retry = self.config.rnr_retry.min(7);
        at.sq_psn = self.psn;
        at.max_rd_atomic = rd_atom(self.device.limits.max_qp_init_rd_atom);
        let m = IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut at, m, "ibv_modify_qp(RTS)")
    }

    fn post_recv(&mut self, slot: u32) -> Result<(), VerbsError> {
        let Some(mr) = &self.recv_mr else {
            return Err(VerbsError::Rejected("receive buffer not registered".into()));
        };
        let mut sge = ibv_sge {
            addr: mr.addr + u64::from(slot * RECV_SLOT_BYTES),
            length: RECV_SLOT_BYTES,
            lkey: mr.lkey,
        };
        let mut wr: ibv_recv_wr = zeroed();
        wr.wr_id = RECV_BIT | u64::from(slot);
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        // SAFETY: sge and wr live across the call; the slot lies in the registered buffer.
        call("ibv_post_recv", &self.device.name, unsafe {
            sys::post_recv(self.qp.as_ptr(), &mut wr, &mut bad)
        })
    }

    /// Posts `wrs` as one chained list (one doorbell). Addresses and keys were
    /// checked by the caller against its registrations and the peer's grant.
    pub fn post(&mut self, wrs: &[WorkRequest]) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let max_sge = self.device.limits.max_sge.clamp(1, 30) as usize;
        self.sges.clear();
        self.wrs.clear();
        for w in wrs {
            if w.sges.len() > max_sge
                || (w.opcode == Opcode::Send && w.inline.len() > RECV_SLOT_BYTES as usize)
            {
                return Err(VerbsError::Rejected(format!(
                    "{} SGEs / {} inline bytes exceed the queue pair's limits",
                    w.sges.len(),
                    w.inline.len()
                )));
            }
        }
        // Build every SGE first: the vector must not move once WRs point into it.
        for w in wrs {
            match w.opcode {
                Opcode::Send => self.sges.push(ibv_sge {
                    addr: w.inline.as_ptr() as u64,
                    length: w.inline.len() as u32,
                    lkey: 0,
                }),
                _ => self.sges.extend(w.sges.iter().map(|s| ibv_sge {
                    addr: s.addr,
                    length: s.len,
                    lkey: s.lkey,
                })),
            }
        }
        let mut first = 0usize;
        for w in wrs {
            let n = if w.opcode == Opcode::Send {
                1
            } else {
                w.sges.len()
            };
            let mut wr: ibv_send_wr = zeroed();
            wr.wr_id = w.wr_id;
            wr.sg_list = self.sges[first..].as_mut_ptr();
            wr.num_sge = n as i32;
            first += n;
            let mut flags = 0;
            if w.signaled {
                flags |= IBV_SEND_SIGNALED;
            }
            match w.opcode {
                Opcode::Write => {
                    wr.opcode = IBV_WR_RDMA_WRITE;
                    wr.wr.rdma.remote_addr = w.remote_addr;
                    wr.wr.rdma.rkey = w.rkey;
                }
                Opcode::Read => {
                    wr.opcode = IBV_WR_RDMA_READ;
                    wr.wr.rdma.remote_addr = w.remote_addr;
                    wr.wr.rdma.rkey = w.rkey;
                }
                Opcode::Send => {
                    wr.opcode = IBV_WR_SEND;
                    flags |= IBV_SEND_INLINE;
                }
            }
            wr.send_flags = flags;
            self.wrs.push(wr);
        }
        let n = self.wrs.len();
        for i in 0..n - 1 {
            let next: *mut ibv_send_wr = &mut self.wrs[i + 1];
            self.wrs[i].next = next;
        }
        let mut bad = null_mut();
        // SAFETY: the WR chain and its SGEs live in self.wrs/self.sges, which are not
        // touched during the call; inline payloads are copied by the call; local
        // addresses lie in registered regions (checked by the caller).
        call("ibv_post_send", &self.device.name, unsafe {
            sys::post_send(self.qp.as_ptr(), self.wrs.as_mut_ptr(), &mut bad)
        })
    }

    fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is valid.
        call("ibv_req_notify_cq", &self.device.name, unsafe {
            sys::req_notify_cq(self.cq.as_ptr(), 0)
        })
    }

    /// Moves finished work requests into `out`; receives are re-posted.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        let mut total = 0;
        loop {
            self.wcs.clear();
            self.wcs.resize_with(BATCH, zeroed);
            // SAFETY: wcs has room for BATCH entries.
            let n = unsafe { sys::poll_cq(self.cq.as_ptr(), BATCH as i32, self.wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(last_error("ibv_poll_cq", &self.device.name));
            }
            let n = n as usize;
            for i in 0..n {
                let (status, vendor_err, wr_id, byte_len) = {
                    let wc = &self.wcs[i];
                    (wc.status, wc.vendor_err, wc.wr_id, wc.byte_len)
                };
                let error = (status != IBV_WC_SUCCESS).then(|| {
                    // SAFETY: returns a static string for any status value.
                    let text = unsafe { CStr::from_ptr((self.device.lib.wc_status_str)(status)) };
                    CompletionError {
                        status,
                        text: text.to_string_lossy().into_owned(),
                        vendor_err,
                        remote_access: matches!(
                            status,
                            IBV_WC_REM_ACCESS_ERR | IBV_WC_REM_INV_REQ_ERR
                        ),
                        flushed: status == IBV_WC_WR_FLUSH_ERR,
                    }
                });
                let mut received = None;
                if wr_id & RECV_BIT != 0 {
                    let slot = (wr_id & !RECV_BIT) as u32;
                    if error.is_none() {
                        let start = (slot * RECV_SLOT_BYTES) as usize;
                        let len = (byte_len as usize).min(RECV_SLOT_BYTES as usize);
                        received = Some(self.recv_buf[start..start + len].to_vec());
                        self.post_recv(slot)?;
                    } else {
                        received = Some(Vec::new());
                    }
                }
                out.push(Completion {
                    wr_id: wr_id & !RECV_BIT,
                    error,
                    received,
                });
            }
            total += n;
            if n < BATCH {
                return Ok(total);
            }
        }
    }

    /// Waits until completions are there and moves them into `out`. With
    /// `busy_poll`, polls that long before sleeping on the completion channel.
    pub async fn wait(
        &mut self,
        out: &mut Vec<Completion>,
        busy_poll: Duration,
    ) -> Result<(), VerbsError> {
        let start = Instant::now();
        loop {
            if self.poll(out)? > 0 {
                return Ok(());
            }
            if start.elapsed() < busy_poll {
                tokio::task::yield_now().await;
                continue;
            }
            // Re-armed before the last poll, so an event is due for anything new.
            let Some(wait) = &self.wait else {
                return Err(VerbsError::Rejected("queue pair is closing".into()));
            };
            let mut guard = wait.readable().await.map_err(|source| VerbsError::Call {
                op: "completion channel",
                device: self.device.name.clone(),
                source,
            })?;
            let mut cq = null_mut();
            let mut ctx = null_mut();
            // SAFETY: the channel is non-blocking; out-pointers are valid.
            let rc =
                unsafe { (self.device.lib.get_cq_event)(self.channel.as_ptr(), &mut cq, &mut ctx) };
            if rc != 0 {
                guard.clear_ready();
                continue;
            }
            self.unacked_events += 1;
            if self.unacked_events >= 64 {
                // SAFETY: acknowledges events taken from this CQ.
                unsafe { (self.device.lib.ack_cq_events)(self.cq.as_ptr(), self.unacked_events) };
                self.unacked_events = 0;
            }
            self.arm()?;
        }
    }

    /// The completion channel's file descriptor.
    pub fn channel_fd(&self) -> Option<RawFd> {
        self.wait.as_ref().map(|w| w.as_raw_fd())
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with plain integer arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A 24-bit starting packet sequence number that differs between queue pairs.
fn rand_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    (h.finish() as u32) & 0x00ff_ffff
}
