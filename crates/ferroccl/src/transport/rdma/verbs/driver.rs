//! The verbs calls: opening the device, registering memory, creating and connecting
//! one reliable-connected queue pair per link, posting and polling.
//!
//! Every type here owns one verbs object and destroys it in `Drop` (logging, never
//! panicking, on failure). [`VerbsQp`] declares its fields so that they drop in the
//! order verbs requires: queue pair, then completion queue, then memory regions, then
//! the memory itself, then (through the shared [`Device`]) the protection domain and
//! the device context.
//!
//! None of this has run against RDMA hardware: the machines this was written on have
//! no RDMA device and no RDMA support in the kernel. The numbers it passes to verbs
//! come from the pure functions in [`super::post`] and [`super::record`], and the
//! handshake's store protocol is [`super::handshake`]; those are tested.

use super::handshake::{Handshake, Step};
use super::post::{self, Post, Regions, SendPost, Wc};
use super::record::{ConnRecord, LinkId};
use crate::error::{Error, Result};
use crate::rendezvous::StoreClient;
use crate::transport::rdma::proto::{Completion, Params, WorkRequest};
use crate::transport::rdma::QueuePair;
use crate::transport::LinkError;
use ibverbs_sys as ffi;
use std::alloc::Layout;
use std::collections::VecDeque;
use std::io;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Completions taken from the completion queue per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// Bytes reserved after a ring (or bounce buffer) for its 8-byte credit word; a whole
/// cache line, so the NIC's credit writes never share a line with slot data.
const WORD_AREA: usize = 64;

/// Logs a failed destroy call from a `Drop` (which must not panic; the object is
/// leaked, which is all that is left to do).
fn destroyed(call: &str, rc: std::os::raw::c_int) {
    if rc != 0 {
        tracing::warn!("{call} failed: {}", io::Error::from_raw_os_error(rc));
    }
}

/// A verbs return code (0 or an errno value) as a result.
fn errno(rc: std::os::raw::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

fn link_io(kind: io::ErrorKind, msg: String) -> LinkError {
    LinkError::Io(io::Error::new(kind, msg))
}

/// An open device context; closed on drop.
struct Context {
    ctx: NonNull<ffi::ibv_context>,
    name: String,
}

// SAFETY: libibverbs is thread-safe (rdma-core, "libibverbs is thread safe"): a context
// may be used and closed from any thread.
unsafe impl Send for Context {}
// SAFETY: as above; shared use only calls verbs, which lock internally.
unsafe impl Sync for Context {}

impl Context {
    /// Lists the devices (`ibv_get_device_list(3)`) and opens the first
    /// (`ibv_open_device(3)`); no device, or no kernel support, is the typed error of
    /// [`super::classify`].
    fn open_first() -> Result<Self> {
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed below on every path.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        let count = if list.is_null() {
            Err(io::Error::last_os_error())
        } else {
            Ok(usize::try_from(n).unwrap_or(0))
        };
        if let Err(e) = super::classify(count) {
            if !list.is_null() {
                // SAFETY: `list` came from ibv_get_device_list and is freed once.
                unsafe { ffi::ibv_free_device_list(list) };
            }
            return Err(e);
        }
        // SAFETY: the list is non-null and holds `n >= 1` device pointers.
        let dev = unsafe { *list };
        // SAFETY: `dev` came from the list, which is still alive.
        let opened = unsafe { Self::open(dev) };
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list) };
        opened
    }

    /// Opens `dev`.
    ///
    /// # Safety
    ///
    /// `dev` must come from a device list that is still alive.
    unsafe fn open(dev: *mut ffi::ibv_device) -> Result<Self> {
        // SAFETY: the caller guarantees `dev` is a live device.
        let name_ptr = unsafe { ffi::ibv_get_device_name(dev) };
        let name = if name_ptr.is_null() {
            "an unnamed device".to_string()
        } else {
            // SAFETY: a non-null device name is a NUL-terminated string owned by the
            // device, alive while the list is.
            unsafe { std::ffi::CStr::from_ptr(name_ptr) }
                .to_string_lossy()
                .into_owned()
        };
        // SAFETY: as above; an opened context stays valid after the list is freed.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        match NonNull::new(ctx) {
            Some(ctx) => Ok(Context { ctx, name }),
            None => Err(Error::io(
                format!("opening RDMA device {name}"),
                io::Error::last_os_error(),
            )),
        }
    }

    fn ptr(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context was opened by us and every object made from it is
        // destroyed first (they hold an Arc<Device>, which holds this).
        destroyed("ibv_close_device", unsafe {
            ffi::ibv_close_device(self.ptr())
        });
    }
}

/// Finds the first RDMA device and opens it, returning its name (see [`super::probe`]).
pub fn probe() -> Result<String> {
    Context::open_first().map(|c| c.name.clone())
}

/// What a port says about itself, as a connection record needs it.
#[derive(Clone, Copy, Debug)]
struct PortInfo {
    lid: u16,
    mtu: u8,
    link_layer: u8,
    gid: [u8; 16],
}

/// The opened device, its protection domain and port 1, shared by every link of a
/// rank.
pub struct Device {
    pd: NonNull<ffi::ibv_pd>,
    port: PortInfo,
    gid_index: u8,
    // Dropped after `pd` is deallocated in `Drop::drop`.
    ctx: Context,
}

// SAFETY: see `Context`: verbs objects may be used from any thread.
unsafe impl Send for Device {}
// SAFETY: see `Context`.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the first device, queries port [`post::PORT`] (it must be active) and its
    /// GID at `gid_index`, and allocates a protection domain.
    pub fn open(gid_index: u8) -> Result<Self> {
        let ctx = Context::open_first()?;
        let name = ctx.name.clone();
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: `attr` is a full-size ibv_port_attr, larger than the compat layout
        // the exported symbol writes (the `ibverbs` crate makes the same call).
        errno(unsafe {
            ffi::ibv_query_port(
                ctx.ptr(),
                post::PORT,
                &mut attr as *mut ffi::ibv_port_attr as *mut _,
            )
        })
        .map_err(|e| Error::io(format!("ibv_query_port({name}, port {})", post::PORT), e))?;
        if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(Error::Unavailable {
                what: "transport rdma".into(),
                why: format!(
                    "port {} of RDMA device {name} is not active (ibv_port_state {})",
                    post::PORT,
                    attr.state
                ),
            });
        }
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: `gid` is a valid out-pointer for one GID.
        let rc =
            unsafe { ffi::ibv_query_gid(ctx.ptr(), post::PORT, i32::from(gid_index), &mut gid) };
        if rc != 0 {
            return Err(Error::io(
                format!(
                    "ibv_query_gid({name}, port {}, index {gid_index})",
                    post::PORT
                ),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: ctx is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| {
            Error::io(format!("ibv_alloc_pd({name})"), io::Error::last_os_error())
        })?;
        Ok(Device {
            pd,
            port: PortInfo {
                lid: attr.lid,
                mtu: u8::try_from(attr.active_mtu).unwrap_or(1),
                link_layer: attr.link_layer,
                // SAFETY: ibv_query_gid filled the 16 raw bytes.
                gid: unsafe { gid.raw },
            },
            gid_index,
            ctx,
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.ctx.name
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an Arc<Device>, so all are gone.
        destroyed("ibv_dealloc_pd", unsafe {
            ffi::ibv_dealloc_pd(self.pd.as_ptr())
        });
    }
}

/// Zeroed, page-aligned memory for a ring or a bounce buffer plus its credit word.
struct Region {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: plain heap memory, owned; the NIC's concurrent access is coordinated by the
// protocol, not by which thread holds the owner.
unsafe impl Send for Region {}

impl Region {
    fn new(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| Error::Config(format!("rdma buffer of {len} bytes: {e}")))?;
        // SAFETY: `len` is non-zero (ring_bytes >= 1 plus the word area).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            Error::Config(format!("could not allocate {len} bytes for an RDMA ring"))
        })?;
        Ok(Region { ptr, layout })
    }

    fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The 8-byte word at `off` (8-aligned, inside the region).
    fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off + 8 <= self.layout.size());
        // SAFETY: in bounds and 8-aligned (the region is page-aligned); the memory
        // lives as long as `self`; the NIC writes it with an 8-byte RDMA write, and we
        // only access it atomically.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(off).cast()) }
    }

    fn copy_in(&mut self, at: usize, src: &[u8]) {
        assert!(at + src.len() <= self.layout.size(), "copy past the region");
        // SAFETY: in bounds (checked); the protocol guarantees the NIC is not reading
        // this bounce slot (its previous write completed).
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(at), src.len()) }
    }

    fn copy_out(&self, at: usize, dst: &mut [u8]) {
        assert!(at + dst.len() <= self.layout.size(), "copy past the region");
        // SAFETY: in bounds (checked); the protocol guarantees the peer does not write
        // this ring slot until it is freed, and its data landed before the receive
        // completion that made it readable.
        unsafe { ptr::copy_nonoverlapping(self.ptr.as_ptr().add(at), dst.as_mut_ptr(), dst.len()) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; its MR is deregistered first.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A registered memory region; deregistered on drop.
struct Mr(NonNull<ffi::ibv_mr>);

// SAFETY: see `Context`.
unsafe impl Send for Mr {}

impl Mr {
    fn register(dev: &Device, r: &Region, access: ffi::ibv_access_flags) -> Result<Self> {
        // SAFETY: the region is valid for its whole length and outlives the MR (field
        // order in VerbsQp).
        let mr = unsafe {
            ffi::ibv_reg_mr(
                dev.pd.as_ptr(),
                r.ptr.as_ptr().cast(),
                r.layout.size(),
                access.0 as i32,
            )
        };
        NonNull::new(mr).map(Mr).ok_or_else(|| {
            Error::io(
                format!(
                    "ibv_reg_mr of {} bytes on {} (is the locked-memory limit, ulimit -l, too low?)",
                    r.layout.size(),
                    dev.name()
                ),
                io::Error::last_os_error(),
            )
        })
    }

    fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { self.0.as_ref().lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { self.0.as_ref().rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by us; the QP that used it is destroyed first.
        destroyed("ibv_dereg_mr", unsafe {
            ffi::ibv_dereg_mr(self.0.as_ptr())
        });
    }
}

/// A completion queue; destroyed on drop.
struct Cq(NonNull<ffi::ibv_cq>);

// SAFETY: see `Context`.
unsafe impl Send for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created by us; its QP is destroyed first.
        destroyed("ibv_destroy_cq", unsafe {
            ffi::ibv_destroy_cq(self.0.as_ptr())
        });
    }
}

/// A queue pair; destroyed on drop.
struct Qp(NonNull<ffi::ibv_qp>);

// SAFETY: see `Context`.
unsafe impl Send for Qp {}

impl Qp {
    fn modify(
        &self,
        (mut attr, mask): (ffi::ibv_qp_attr, ffi::ibv_qp_attr_mask),
    ) -> io::Result<()> {
        // SAFETY: the QP is alive; `attr` is a valid ibv_qp_attr for `mask`.
        errno(unsafe { ffi::ibv_modify_qp(self.0.as_ptr(), &mut attr, mask.0 as i32) })
    }

    /// The device's operations table, through which verbs.h's static inlines
    /// (`ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`) call the provider.
    fn ops(&self) -> &ffi::ibv_context_ops {
        // SAFETY: a live QP's context is open, and outlives the QP (Arc<Device>).
        unsafe { &(*self.0.as_ref().context).ops }
    }

    fn num(&self) -> u32 {
        // SAFETY: the QP is alive.
        unsafe { self.0.as_ref().qp_num }
    }

    /// `ibv_post_send(3)` (a static inline in verbs.h: the context's ops table).
    fn post_send(&self, p: &SendPost) -> io::Result<()> {
        let mut sge = ffi::ibv_sge {
            addr: p.local_addr,
            length: p.len,
            lkey: p.lkey,
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id: p.wr_id,
            next: ptr::null_mut(),
            sg_list: if p.len == 0 {
                ptr::null_mut()
            } else {
                &mut sge
            },
            num_sge: i32::from(p.len != 0),
            opcode: p.opcode,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: p.remote_addr,
            rkey: p.rkey,
        };
        if let Some(imm) = p.imm_be {
            wr.__bindgen_anon_1.imm_data = imm;
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        errno(match self.ops().post_send {
            // SAFETY: the QP and its context are alive; `wr` and `sge` live across the
            // call (verbs copies them into the send queue); the bytes they name are in
            // registered memory (checked by post::plan).
            Some(f) => unsafe { f(self.0.as_ptr(), &mut wr, &mut bad) },
            None => libc::ENOSYS,
        })
    }

    /// `ibv_post_recv(3)` of one request with no scatter list.
    fn post_recv(&self, wr_id: u64) -> io::Result<()> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        errno(match self.ops().post_recv {
            // SAFETY: the QP and its context are alive; `wr` lives across the call.
            Some(f) => unsafe { f(self.0.as_ptr(), &mut wr, &mut bad) },
            None => libc::ENOSYS,
        })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by us, destroyed once, before its CQ and MRs.
        destroyed("ibv_destroy_qp", unsafe {
            ffi::ibv_destroy_qp(self.0.as_ptr())
        });
    }
}

/// A link whose handshake is under way.
struct Connecting {
    hs: Handshake,
    /// Writes the protocol asked for before the peer was ready, in order.
    queued: VecDeque<WorkRequest>,
}

enum State {
    Connecting(Box<Connecting>),
    Up(Regions),
}

/// One end of an RDMA link over verbs: an RC queue pair with its own completion
/// queue, its ring and bounce buffer, connected lazily through the store.
///
/// [`VerbsQp::create`] brings the queue pair to INIT, posts the `S + 1` receive
/// requests and publishes the connection record; the handshake then advances on each
/// [`QueuePair::poll`], without blocking, so ranks may connect their links in any
/// order: fetch the peer's record, go to RTR and RTS, say so, and start posting writes
/// once the peer has said the same. Writes asked for before that are queued.
pub struct VerbsQp {
    // Field order is drop order: QP, CQ, MRs, memory, device.
    qp: Qp,
    cq: Cq,
    /// Held only to keep the ring registered (its rkey is in `local`).
    _ring_mr: Mr,
    bounce_mr: Mr,
    ring: Region,
    bounce: Region,
    dev: Arc<Device>,
    params: Params,
    me: usize,
    peer: usize,
    local: ConnRecord,
    state: State,
    activity: Arc<AtomicU64>,
    last_credit: u64,
}

impl VerbsQp {
    /// Creates the queue pair of `link` (this end `link.from`, peer `link.to`), brings
    /// it to INIT with its receive requests posted, and publishes its record; the rest
    /// of the handshake runs on later polls ([`Handshake`]).
    pub fn create(
        dev: Arc<Device>,
        store: Arc<Mutex<StoreClient>>,
        link: LinkId,
        params: Params,
        activity: Arc<AtomicU64>,
    ) -> Result<Self> {
        let (me, peer) = (link.from as usize, link.to as usize);
        let what = |s: &str| format!("rank {me}: {s} for the RDMA link to rank {peer}");
        let rb = params.ring_bytes();
        let ring = Region::new(rb + WORD_AREA)?;
        let bounce = Region::new(rb + WORD_AREA)?;
        let ring_mr = Mr::register(
            &dev,
            &ring,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE,
        )?;
        // The bounce buffer is only read by the local NIC: no access flags.
        let bounce_mr = Mr::register(&dev, &bounce, ffi::ibv_access_flags(0))?;
        let sends = params.slots + 2; // S data writes, one credit, one close
        let recvs = params.slots + 1;
        let cqe = i32::try_from(sends + recvs)
            .map_err(|_| Error::Config(format!("rdma ring of {} slots", params.slots)))?;
        // SAFETY: the context is open; no channel, no context pointer.
        let cq =
            unsafe { ffi::ibv_create_cq(dev.ctx.ptr(), cqe, ptr::null_mut(), ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).map(Cq).ok_or_else(|| {
            Error::io(
                what("creating a completion queue"),
                io::Error::last_os_error(),
            )
        })?;
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq.0.as_ptr(),
            recv_cq: cq.0.as_ptr(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: sends as u32,
                max_recv_wr: recvs as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: the PD and CQ are alive; `init` is a valid attribute block.
        let qp = unsafe { ffi::ibv_create_qp(dev.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).map(Qp).ok_or_else(|| {
            Error::io(
                what(&format!(
                    "creating an RC queue pair ({sends} send, {recvs} receive requests)"
                )),
                io::Error::last_os_error(),
            )
        })?;
        qp.modify(post::init_attr())
            .map_err(|e| Error::io(what("moving the queue pair to INIT"), e))?;
        for wr in crate::transport::rdma::proto::Endpoint::initial_recvs(&params) {
            if let WorkRequest::PostRecv { wr_id } = wr {
                qp.post_recv(wr_id)
                    .map_err(|e| Error::io(what("posting the initial receive requests"), e))?;
            }
        }
        let n = crate::rendezvous::auth::nonce();
        let psn = u32::from_le_bytes([n[0], n[1], n[2], 0]);
        let local = ConnRecord {
            link,
            link_layer: dev.port.link_layer,
            lid: dev.port.lid,
            mtu: dev.port.mtu,
            gid: dev.port.gid,
            qpn: qp.num(),
            psn,
            ring_addr: ring.addr(),
            ring_rkey: ring_mr.rkey(),
            credit_addr: ring.addr() + rb as u64,
            credit_rkey: ring_mr.rkey(),
            params,
        };
        let hs = Handshake::start(store, local)?;
        Ok(VerbsQp {
            qp,
            cq,
            _ring_mr: ring_mr,
            bounce_mr,
            ring,
            bounce,
            dev,
            params,
            me,
            peer,
            local,
            state: State::Connecting(Box::new(Connecting {
                hs,
                queued: VecDeque::new(),
            })),
            activity,
            last_credit: 0,
        })
    }

    fn regions(&self, peer: &ConnRecord) -> Regions {
        Regions::new(
            self.params,
            self.bounce.addr(),
            self.bounce_mr.lkey(),
            self.bounce.addr() + self.params.ring_bytes() as u64,
            peer,
        )
    }

    /// One step of the handshake; once both ends are in RTS, posts what was queued.
    fn advance(&mut self) -> std::result::Result<(), LinkError> {
        let State::Connecting(c) = &mut self.state else {
            return Ok(());
        };
        let (qp, local, gid_index) = (&self.qp, &self.local, self.dev.gid_index);
        let step = c.hs.advance(Instant::now(), |peer| {
            qp.modify(post::rtr_attr(local, peer, gid_index))?;
            qp.modify(post::rts_attr(local))
        });
        let rec = match step {
            Ok(Step::Waiting) => return Ok(()),
            Ok(Step::Ready(rec)) => rec,
            Err(e) => {
                return Err(link_io(
                    io::ErrorKind::Other,
                    format!("RDMA link of rank {} to rank {}: {e}", self.me, self.peer),
                ))
            }
        };
        let regions = self.regions(&rec);
        if let State::Connecting(c) = std::mem::replace(&mut self.state, State::Up(regions)) {
            self.activity.fetch_add(1, Ordering::Relaxed);
            for wr in c.queued {
                self.post(&wr)?;
            }
        }
        Ok(())
    }
}

impl QueuePair for VerbsQp {
    fn post(&mut self, wr: &WorkRequest) -> std::result::Result<(), LinkError> {
        let r = match &mut self.state {
            State::Up(r) => *r,
            State::Connecting(c) => {
                return match *wr {
                    // Receive requests are valid from INIT on.
                    WorkRequest::PostRecv { wr_id } => {
                        self.qp.post_recv(wr_id).map_err(LinkError::Io)
                    }
                    _ => {
                        c.queued.push_back(wr.clone());
                        Ok(())
                    }
                };
            }
        };
        match post::plan(wr, &r).map_err(|e| link_io(io::ErrorKind::InvalidInput, e))? {
            Post::Recv { wr_id } => self.qp.post_recv(wr_id),
            Post::Send(p) => {
                if let Some(v) = p.credit {
                    // The one credit write in flight has completed: the word is free.
                    self.bounce
                        .word(self.params.ring_bytes())
                        .store(v, Ordering::Release);
                }
                self.qp.post_send(&p)
            }
        }
        .map_err(|e| {
            link_io(
                e.kind(),
                format!(
                    "rank {}: posting to the RDMA link to rank {}: {e}",
                    self.me, self.peer
                ),
            )
        })
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> std::result::Result<(), LinkError> {
        if let State::Connecting(_) = self.state {
            return self.advance();
        }
        let mut wcs = [MaybeUninit::<ffi::ibv_wc>::uninit(); POLL_BATCH];
        let before = out.len();
        loop {
            // SAFETY: the CQ and its context are alive; `wcs` has room for POLL_BATCH
            // entries, of which poll_cq initialises the first `n`.
            let n = unsafe {
                let ctx = self.cq.0.as_ref().context;
                match (*ctx).ops.poll_cq {
                    Some(f) => f(
                        self.cq.0.as_ptr(),
                        POLL_BATCH as i32,
                        wcs.as_mut_ptr().cast(),
                    ),
                    None => -libc::ENOSYS,
                }
            };
            if n < 0 {
                return Err(link_io(
                    io::ErrorKind::Other,
                    format!(
                        "rank {}: ibv_poll_cq on the RDMA link to rank {} failed ({n})",
                        self.me, self.peer
                    ),
                ));
            }
            for wc in &wcs[..n as usize] {
                // SAFETY: poll_cq initialised the first `n` entries.
                let wc = unsafe { wc.assume_init_ref() };
                out.push(post::completion(Wc {
                    wr_id: wc.wr_id(),
                    error: wc.error(),
                    opcode: wc.opcode(),
                    imm_be: wc.imm_data(),
                }));
            }
            if (n as usize) < POLL_BATCH {
                break;
            }
        }
        let credit = self.credit_word();
        if out.len() > before || credit != self.last_credit {
            self.last_credit = credit;
            self.activity.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn credit_word(&self) -> u64 {
        self.ring
            .word(self.params.ring_bytes())
            .load(Ordering::Acquire)
    }

    fn fill_bounce(&mut self, slot: usize, off: usize, src: &[u8]) {
        self.bounce
            .copy_in(slot * self.params.slot_bytes + off, src);
    }

    fn read_ring(&self, slot: usize, off: usize, dst: &mut [u8]) {
        self.ring.copy_out(slot * self.params.slot_bytes + off, dst);
    }
}
