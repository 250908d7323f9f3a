//! libibverbs, loaded at run time.
//!
//! kvrail must start on hosts without rdma-core (and build on hosts without its
//! headers or libclang), so nothing here is generated or linked: the few C
//! structs kvrail fills in are declared by hand from rdma-core's `verbs.h`, and
//! the functions are looked up in `libibverbs.so.1` by `dlopen` the first time
//! RDMA is asked for. libibverbs keeps these symbols and layouts stable (ABI
//! version `IBVERBS_1.1`). The sizes and offsets asserted at the end of this
//! file are what `layout.c` (next to Cargo.toml) printed against rdma-core 44's
//! headers, built for x86_64 and for aarch64 (the same on both).
//!
//! Structs that libibverbs allocates and kvrail only reads through a pointer
//! (`ibv_context`, `ibv_cq`, `ibv_qp`) are declared up to the last field kvrail
//! reads: what follows holds `pthread_mutex_t`, whose size differs by
//! architecture, and is never touched here.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// Opaque library types, only ever used behind pointers.
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ibv_pd {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ibv_srq {
    _opaque: [u8; 0],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_gid {
    pub raw: [u8; 16],
    pub global: [u64; 2],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_uint,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `wr.rdma` of `ibv_send_wr`; the union's other members (atomic: 32 bytes,
/// ud) are covered by the padding.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_rdma_wr {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_rdma_wr,
    _atomic: [u64; 4],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    // bind_mw { mw*, rkey, ibv_mw_bind_info { mr*, addr, length, flags } } is the
    // largest member of the last union: 48 bytes, 8-aligned.
    _bind_mw: [u64; 6],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
type Unused = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: the provider's fast-path entry points, which
/// `verbs.h` calls from inline functions (post, poll, arm).
#[repr(C)]
pub struct ibv_context_ops {
    _compat: [Unused; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    _compat2: [Unused; 12],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
    _compat3: [Unused; 5],
}

/// The leading fields of `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
}

/// The leading fields of `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// The leading fields of `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
}

pub const IBV_PORT_DOWN: c_uint = 1;
pub const IBV_PORT_INIT: c_uint = 2;
pub const IBV_PORT_ARMED: c_uint = 3;
pub const IBV_PORT_ACTIVE: c_uint = 4;
pub const IBV_PORT_ACTIVE_DEFER: c_uint = 5;

pub const IBV_MTU_256: c_uint = 1;
pub const IBV_MTU_512: c_uint = 2;
pub const IBV_MTU_1024: c_uint = 3;
pub const IBV_MTU_2048: c_uint = 4;
pub const IBV_MTU_4096: c_uint = 5;

pub const IBV_ACCESS_LOCAL_WRITE: c_uint = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_uint = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_uint = 1 << 2;

pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;

pub const IBV_QPT_RC: c_uint = 2;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_RDMA_READ: c_uint = 4;

pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_SEND_INLINE: c_uint = 1 << 3;

pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub const IBV_WC_REM_INV_REQ_ERR: c_uint = 9;
pub const IBV_WC_REM_ACCESS_ERR: c_uint = 10;

/// The exported libibverbs functions kvrail calls, resolved once.
pub struct Lib {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    /// The exported (compat) entry point: fills the leading fields of
    /// `ibv_port_attr`, which are all kvrail reads.
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub wc_status_str: unsafe extern "C" fn(c_uint) -> *const c_char,
    /// Where the library was found (for the log).
    pub path: String,
}

/// The names tried, in order: the runtime soname, then the development link
/// (some distributions ship only that inside containers).
const LIBRARY_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

/// libibverbs, loaded on first use; `Err` says why RDMA is off on this host.
pub fn lib() -> Result<&'static Lib, String> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Lib, String> {
    let mut errors = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading libibverbs runs its initialisers, which only read the
        // provider configuration; no other code of ours runs concurrently with them.
        match unsafe { libloading::Library::new(name) } {
            Ok(library) => return resolve(library, name),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(format!(
        "libibverbs cannot be loaded (to use RDMA install rdma-core's libibverbs1 \
         and its providers, e.g. Debian's ibverbs-providers): {}",
        errors.join("; ")
    ))
}

fn resolve(library: libloading::Library, name: &str) -> Result<Lib, String> {
    macro_rules! sym {
        ($sym:literal) => {{
            // SAFETY: the symbol's C signature is the one declared in the `Lib`
            // field it is stored in (rdma-core's verbs.h, IBVERBS_1.1).
            let s = unsafe { library.get(concat!($sym, "\0").as_bytes()) }
                .map_err(|e| format!("{name} lacks {}: {e}", $sym))?;
            *s
        }};
    }
    let lib = Lib {
        get_device_list: sym!("ibv_get_device_list"),
        free_device_list: sym!("ibv_free_device_list"),
        get_device_name: sym!("ibv_get_device_name"),
        open_device: sym!("ibv_open_device"),
        close_device: sym!("ibv_close_device"),
        query_device: sym!("ibv_query_device"),
        query_port: sym!("ibv_query_port"),
        query_gid: sym!("ibv_query_gid"),
        alloc_pd: sym!("ibv_alloc_pd"),
        dealloc_pd: sym!("ibv_dealloc_pd"),
        reg_mr: sym!("ibv_reg_mr"),
        dereg_mr: sym!("ibv_dereg_mr"),
        create_comp_channel: sym!("ibv_create_comp_channel"),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
        create_cq: sym!("ibv_create_cq"),
        destroy_cq: sym!("ibv_destroy_cq"),
        create_qp: sym!("ibv_create_qp"),
        destroy_qp: sym!("ibv_destroy_qp"),
        modify_qp: sym!("ibv_modify_qp"),
        get_cq_event: sym!("ibv_get_cq_event"),
        ack_cq_events: sym!("ibv_ack_cq_events"),
        wc_status_str: sym!("ibv_wc_status_str"),
        path: name.to_string(),
    };
    // The function pointers stay valid for the life of the process.
    std::mem::forget(library);
    Ok(lib)
}

/// Offsets and sizes from rdma-core 44's `verbs.h`, compiled with gcc 12 for
/// x86_64 and aarch64 (both LP64, same values).
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(offset_of!(ibv_device_attr, max_qp_wr) == 112);
    assert!(offset_of!(ibv_device_attr, max_sge) == 120);
    assert!(offset_of!(ibv_device_attr, max_cqe) == 132);
    assert!(offset_of!(ibv_device_attr, max_qp_rd_atom) == 144);
    assert!(offset_of!(ibv_device_attr, max_qp_init_rd_atom) == 156);
    assert!(offset_of!(ibv_device_attr, phys_port_cnt) == 227);
    assert!(size_of::<ibv_port_attr>() == 52);
    assert!(offset_of!(ibv_port_attr, active_mtu) == 8);
    assert!(offset_of!(ibv_port_attr, gid_tbl_len) == 12);
    assert!(offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(size_of::<ibv_global_route>() == 24);
    assert!(size_of::<ibv_ah_attr>() == 32);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(offset_of!(ibv_qp_attr, dest_qp_num) == 28);
    assert!(offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(offset_of!(ibv_qp_attr, pkey_index) == 120);
    assert!(offset_of!(ibv_qp_attr, max_rd_atomic) == 126);
    assert!(offset_of!(ibv_qp_attr, port_num) == 129);
    assert!(offset_of!(ibv_qp_attr, rnr_retry) == 132);
    assert!(offset_of!(ibv_qp_attr, rate_limit) == 136);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr, qp_type) == 52);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(offset_of!(ibv_send_wr, opcode) == 28);
    assert!(offset_of!(ibv_send_wr, wr) == 40);
    assert!(offset_of!(ibv_send_wr, qp_type) == 72);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(size_of::<ibv_sge>() == 16);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(offset_of!(ibv_wc, byte_len) == 20);
    assert!(offset_of!(ibv_wc, wc_flags) == 36);
    assert!(size_of::<ibv_comp_channel>() == 16);
    assert!(offset_of!(ibv_mr, lkey) == 36);
    assert!(offset_of!(ibv_mr, rkey) == 40);
    assert!(offset_of!(ibv_context, ops) == 8);
    assert!(size_of::<ibv_context_ops>() == 256);
    assert!(offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(ibv_context_ops, req_notify_cq) == 96);
    assert!(offset_of!(ibv_context_ops, post_send) == 200);
    assert!(offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(offset_of!(ibv_cq, cqe) == 28);
};

// The fast path: `verbs.h` defines these as inline calls through the
// context's ops table, so they are not exported symbols.

/// `ibv_post_send`.
///
/// # Safety
/// `qp` is a live queue pair; `wr` a valid chain whose SGEs outlive the call.
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a live QP points at its live context (caller's contract).
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the provider's entry point, called as verbs.h does.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_recv`.
///
/// # Safety
/// As [`post_send`].
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: as in post_send.
    match unsafe { (*(*qp).context).ops.post_recv } {
        // SAFETY: as in post_send.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_poll_cq`.
///
/// # Safety
/// `cq` is a live completion queue; `wc` has room for `n` entries.
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live CQ points at its live context (caller's contract).
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: the provider's entry point, called as verbs.h does.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -1,
    }
}

/// `ibv_req_notify_cq`.
///
/// # Safety
/// `cq` is a live completion queue.
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: as in poll_cq.
    match unsafe { (*(*cq).context).ops.req_notify_cq } {
        // SAFETY: as in poll_cq.
        Some(f) => unsafe { f(cq, solicited_only) },
        None => libc::EOPNOTSUPP,
    }
}
