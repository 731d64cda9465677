//! POSIX shared memory: a named segment one process creates and others map.
//!
//! Segments are created `0600` (only this user's processes can map them), named by
//! the caller (the transports name them by communicator id and rank, so another job
//! cannot collide with them), and unlinked when their creator drops them (unless it hands
//! that to someone else, [`ShmSegment::disown`]); mappings made by others stay valid until those are dropped
//! too. Bytes are moved in and out by [`ShmSegment::write_at`] / [`ShmSegment::read_at`]
//! on raw pointers (no Rust reference to shared bytes is ever formed); who may touch
//! which bytes when is the caller's protocol, published through [`ShmSegment::word`].

use crate::error::{Error, Result};
use std::ffi::CString;
use std::sync::atomic::AtomicU64;

/// A mapped shared-memory segment of a fixed size.
pub(crate) struct ShmSegment {
    ptr: *mut libc::c_void,
    len: usize,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is process-wide; this type hands out only atomics into it.
unsafe impl Send for ShmSegment {}
// SAFETY: as above: shared access goes through atomics.
unsafe impl Sync for ShmSegment {}

impl ShmSegment {
    /// Creates (or truncates and takes over) the segment `name` of `len` bytes,
    /// zero-filled; it is unlinked when this value is dropped.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn create(name: &str, len: usize) -> Result<Self> {
        Self::map(
            name,
            len,
            libc::O_CREAT | libc::O_RDWR | libc::O_TRUNC,
            true,
        )
    }

    /// Creates the segment `name` of `len` bytes, zero-filled, failing if the name
    /// exists (nobody else's segment is ever taken over); unlinked on drop.
    pub fn create_new(name: &str, len: usize) -> Result<Self> {
        Self::map(name, len, libc::O_CREAT | libc::O_RDWR | libc::O_EXCL, true)
    }

    /// Maps the existing segment `name`, which must hold at least `len` bytes.
    pub fn open(name: &str, len: usize) -> Result<Self> {
        Self::map(name, len, libc::O_RDWR, false)
    }

    fn map(name: &str, len: usize, flags: libc::c_int, owner: bool) -> Result<Self> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("shared-memory name {name:?}")))?;
        // SAFETY: a NUL-terminated name; the descriptor is closed below.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), flags, 0o600) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::ENOENT) if owner => " (no /dev/shm: is it mounted?)",
                Some(libc::EROFS) => " (/dev/shm is read-only)",
                Some(libc::EACCES) => " (no permission in /dev/shm)",
                _ => "",
            };
            return Err(Error::io(format!("shm_open {name}{hint}"), e));
        }
        let sized = if owner {
            // SAFETY: `fd` is ours.
            let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
            if r == 0 {
                reserve(fd, len)
            } else {
                Err(std::io::Error::last_os_error())
            }
        } else {
            let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
            // SAFETY: `fd` is ours and `st` a valid out-pointer.
            let r = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
            if r != 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: fstat succeeded and filled `st`.
                let size = unsafe { st.assume_init() }.st_size as usize;
                if size < len {
                    Err(std::io::Error::other(format!(
                        "segment has {size} bytes, expected {len}"
                    )))
                } else {
                    Ok(())
                }
            }
        };
        let mapped = sized.and_then(|()| {
            // Populated: every page is in this process's page tables from the start, so
            // the first pass of a ring's bytes does not take a fault per page (a 64 KiB
            // all-to-all over 4 ranks ran at a third of its speed for its first few
            // hundred calls, until each 4 MiB ring had wrapped once).
            // SAFETY: mapping `len` bytes of a shared object that holds at least that.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_POPULATE,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(p)
            }
        });
        // SAFETY: `fd` is ours; the mapping does not need it open.
        unsafe { libc::close(fd) };
        let ptr = mapped.map_err(|e| {
            if owner {
                // SAFETY: unlinking the name we just created.
                unsafe { libc::shm_unlink(cname.as_ptr()) };
            }
            Error::io(format!("mapping shared memory {name}"), e)
        })?;
        Ok(ShmSegment {
            ptr,
            len,
            name: cname,
            owner,
        })
    }

    /// The `i`-th 8-byte word of the segment, as an atomic shared with every process
    /// that maps it.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        assert!(
            (i + 1) * 8 <= self.len,
            "word {i} of a {}-byte segment",
            self.len
        );
        // SAFETY: in bounds (checked), 8-byte aligned (mappings are page-aligned), and
        // valid for the lifetime of `self`; every access to it is atomic.
        unsafe { &*self.ptr.cast::<AtomicU64>().add(i) }
    }

    /// The mapping's first byte (page-aligned), for registering it with a device
    /// driver; valid for the lifetime of `self`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.cast()
    }

    /// Gives up removing the name on drop (a creator's segment whose name someone
    /// else removes, [`unlink_name`]).
    pub fn disown(&mut self) {
        self.owner = false;
    }

    /// Copies `src` into the segment at byte `off`. The caller's protocol must give
    /// this process those bytes alone (no other process reads or writes them until it
    /// publishes them through an atomic word with `Release`).
    pub fn write_at(&self, off: usize, src: &[u8]) {
        assert!(
            off.checked_add(src.len())
                .is_some_and(|end| end <= self.len),
            "write of {} bytes at {off} in a {}-byte segment",
            src.len(),
            self.len
        );
        // SAFETY: the base is inside the mapping (the whole range is checked above).
        let to = unsafe { self.ptr.cast::<u8>().add(off) };
        for (o, k) in super::mem::pieces(to as usize, src.as_ptr() as usize, src.len()) {
            // SAFETY: the range is inside the mapping (checked), `src` cannot overlap a
            // shared mapping we only touch through raw pointers, and no reference to
            // the shared bytes is formed; `o + k <= src.len()` (`pieces`).
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(o), to.add(o), k) };
        }
    }

    /// Copies from the segment at byte `off` into `dst`. The caller's protocol must have
    /// published those bytes to this process (an `Acquire` load of the word that says
    /// they are written) and keep the writer off them until this returns.
    pub fn read_at(&self, off: usize, dst: &mut [u8]) {
        assert!(
            off.checked_add(dst.len())
                .is_some_and(|end| end <= self.len),
            "read of {} bytes at {off} in a {}-byte segment",
            dst.len(),
            self.len
        );
        // SAFETY: the base is inside the mapping (the whole range is checked above).
        let from = unsafe { self.ptr.cast::<u8>().add(off) };
        let to = dst.as_mut_ptr();
        for (o, k) in super::mem::pieces(to as usize, from as usize, dst.len()) {
            // SAFETY: the range is inside the mapping (checked); `dst` is our own memory,
            // distinct from the mapping, and no reference to the shared bytes is
            // formed; `o + k <= dst.len()` (`pieces`).
            unsafe { std::ptr::copy_nonoverlapping(from.add(o), to.add(o), k) };
        }
    }
}

/// Whether process `pid` exists (as this process's pid namespace sees it): `kill(pid,
/// 0)` answers without sending anything; a process of another user still counts.
pub(crate) fn process_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Gives the first `len` bytes of `fd` their pages now. A tmpfs (`/dev/shm`) grants
/// `ftruncate` beyond its free space and fails only when a page is first touched,
/// with SIGBUS; reserving them here turns a full `/dev/shm` into an error at set-up.
fn reserve(fd: libc::c_int, len: usize) -> std::io::Result<()> {
    loop {
        // SAFETY: `fd` is an open descriptor of the caller's; posix_fallocate returns
        // the error number instead of setting errno.
        let r = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        match r {
            0 => return Ok(()),
            libc::EINTR => continue,
            // A file system without fallocate: nothing to reserve with.
            libc::EOPNOTSUPP => return Ok(()),
            e => {
                let e = std::io::Error::from_raw_os_error(e);
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("reserving {len} bytes: {e} (is /dev/shm full?)"),
                ));
            }
        }
    }
}

/// Bytes free for this user in `/dev/shm` (`statvfs`), or `None` when it cannot be
/// read.
pub(crate) fn shm_free_bytes() -> Option<u64> {
    let path = CString::new("/dev/shm").ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    let r = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if r != 0 {
        return None;
    }
    // SAFETY: statvfs succeeded and filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// This process's effective user id.
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Removes `name` from the shared-memory namespace (a segment left by a dead job); an
/// error when it is not there or not ours to remove.
pub(crate) fn unlink_name(name: &str) -> std::io::Result<()> {
    let cname = CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated name.
    let r = unsafe { libc::shm_unlink(cname.as_ptr()) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once; unlinking our own name.
        unsafe {
            libc::munmap(self.ptr, self.len);
            if self.owner {
                libc::shm_unlink(self.name.as_ptr());
            }
        }
    }
}

/// A segment whose mapping reserves more address space than the object holds, so it
/// can grow without moving: symmetric memory (`transport/shm/sym.rs`). The creator
/// grows the object ([`SymSegment::grow`], its pages reserved as [`ShmSegment`]'s
/// are); every process maps the whole reservation once, and touches only bytes the
/// creator has said (through an atomic word) are there — a byte past the object's end
/// is `SIGBUS`.
pub(crate) struct SymSegment {
    ptr: *mut libc::c_void,
    /// Bytes of address space mapped.
    reserve: usize,
    /// Bytes the object holds, as this process made or last grew it (the creator's).
    held: usize,
    /// The creator's descriptor, for growing; `None` in the processes that open it.
    fd: Option<libc::c_int>,
    name: CString,
    /// Whether dropping this removes the name (the creator's, until [`SymSegment::unlink`]).
    named: bool,
}

// SAFETY: the mapping is process-wide; shared access goes through atomics or through
// raw pointers under the caller's protocol.
unsafe impl Send for SymSegment {}
// SAFETY: as above.
unsafe impl Sync for SymSegment {}

impl SymSegment {
    /// Creates the segment `name` holding `len` bytes (zero-filled, reserved), mapped
    /// over `reserve >= len` bytes; fails if the name exists.
    pub fn create(name: &str, len: usize, reserve: usize) -> Result<Self> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("shared-memory name {name:?}")))?;
        // SAFETY: a NUL-terminated name; the descriptor is kept (closed on drop).
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_RDWR | libc::O_EXCL,
                0o600,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open {name}"),
                std::io::Error::last_os_error(),
            ));
        }
        let mut s = SymSegment {
            ptr: std::ptr::null_mut(),
            reserve,
            held: 0,
            fd: Some(fd),
            name: cname,
            named: true,
        };
        s.ptr = map_reserve(fd, reserve).map_err(|e| Error::io(format!("mapping {name}"), e))?;
        s.grow(len)?;
        Ok(s)
    }

    /// Maps the existing segment `name` over `reserve` bytes (what it holds grows
    /// later, by its creator).
    pub fn open(name: &str, reserve: usize) -> Result<Self> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("shared-memory name {name:?}")))?;
        // SAFETY: a NUL-terminated name; the descriptor is closed below.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0o600) };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open {name}"),
                std::io::Error::last_os_error(),
            ));
        }
        let p = map_reserve(fd, reserve);
        // SAFETY: `fd` is ours; the mapping does not need it open.
        unsafe { libc::close(fd) };
        Ok(SymSegment {
            ptr: p.map_err(|e| Error::io(format!("mapping {name}"), e))?,
            reserve,
            held: 0,
            fd: None,
            name: cname,
            named: false,
        })
    }

    /// Makes the object hold at least `len` bytes (the creator only; a no-op when it
    /// does), reserving the pages so a full `/dev/shm` is an error here, not a
    /// `SIGBUS` later.
    pub fn grow(&mut self, len: usize) -> Result<()> {
        if len <= self.held {
            return Ok(());
        }
        let Some(fd) = self.fd else {
            return Err(Error::InvalidArgument(
                "internal: only a segment's creator grows it".into(),
            ));
        };
        if len > self.reserve {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes of symmetric memory exceed its reservation of {} bytes",
                self.reserve
            )));
        }
        // SAFETY: `fd` is this segment's open descriptor.
        let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let r = if r == 0 {
            reserve(fd, len)
        } else {
            Err(std::io::Error::last_os_error())
        };
        r.map_err(|e| {
            Error::io(
                format!(
                    "growing shared memory {} to {len} bytes",
                    self.name.to_string_lossy()
                ),
                e,
            )
        })?;
        self.held = len;
        Ok(())
    }

    /// Removes the name now (every process that needs it has mapped it).
    pub fn unlink(&mut self) {
        if std::mem::take(&mut self.named) {
            // SAFETY: unlinking our own name once.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
        }
    }

    /// The `i`-th 8-byte word of the first page (the caller keeps its header there and
    /// the object always holds it), as an atomic shared with every process mapping it.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < 512 && self.reserve >= 4096, "header word {i}");
        // SAFETY: in the first page (checked), which the object holds from its
        // creation; 8-byte aligned; valid for the lifetime of `self`; atomic access.
        unsafe { &*self.ptr.cast::<AtomicU64>().add(i) }
    }

    /// The 8-byte word at byte `off` (a multiple of 8) of the bytes the object held
    /// from its creation (the caller's header beyond the first page), as an atomic
    /// shared with every process mapping it.
    pub fn word_at(&self, off: usize, created: usize) -> &AtomicU64 {
        assert!(
            off.is_multiple_of(8) && off + 8 <= created && created <= self.reserve,
            "header word at {off}"
        );
        // SAFETY: 8-byte aligned, inside what the object holds from its creation (the
        // caller creates it with `created` bytes and peers open only created objects,
        // checked by their magic), valid for the lifetime of `self`; atomic access.
        unsafe { &*self.ptr.cast::<u8>().add(off).cast::<AtomicU64>() }
    }

    /// The address of bytes `off..off + len` of the mapping, checked against the
    /// reservation (not against what the object holds: the caller's protocol says
    /// that).
    pub fn addr(&self, off: usize, len: usize) -> Option<*mut u8> {
        let end = off.checked_add(len)?;
        // SAFETY: `off <= reserve`, inside the mapping.
        (end <= self.reserve).then(|| unsafe { self.ptr.cast::<u8>().add(off) })
    }
}

/// Maps `reserve` bytes of `fd`, shared, without populating (the object may hold
/// fewer).
fn map_reserve(fd: libc::c_int, reserve: usize) -> std::io::Result<*mut libc::c_void> {
    // SAFETY: a fresh shared mapping of an open descriptor; nothing is touched here.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(p)
    }
}

impl Drop for SymSegment {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once (a failed create never mapped: null),
        // closing our own descriptor, unlinking our own name.
        unsafe {
            if !self.ptr.is_null() {
                libc::munmap(self.ptr, self.reserve);
            }
            if let Some(fd) = self.fd {
                libc::close(fd);
            }
        }
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_second_mapping_sees_the_first_and_the_name_goes_with_its_creator() {
        let name = format!("/ferroccl-test-{}", std::process::id());
        let a = ShmSegment::create(&name, 64).unwrap();
        let b = ShmSegment::open(&name, 64).unwrap();
        a.word(3).store(42, Ordering::Release);
        assert_eq!(b.word(3).load(Ordering::Acquire), 42);
        assert_eq!(b.word(0).load(Ordering::Acquire), 0, "zero-filled");
        // Asking for more than it holds is refused.
        assert!(ShmSegment::open(&name, 4096).is_err());
        drop(a);
        assert!(
            ShmSegment::open(&name, 64).is_err(),
            "unlinked with its creator"
        );
        assert_eq!(
            b.word(3).load(Ordering::Acquire),
            42,
            "mappings outlive the name"
        );
    }

    /// A reserved segment grows in place: a peer's mapping sees what the creator
    /// writes past the old end, a growth past the reservation is refused, and the name
    /// is gone once unlinked.
    #[test]
    fn a_symmetric_segment_grows_without_moving() {
        let name = format!("/ferroccl-test-sym-{}", std::process::id());
        let mut mine = SymSegment::create(&name, 4096, 1 << 30).unwrap();
        let theirs = SymSegment::open(&name, 1 << 30).unwrap();
        mine.word(1).store(7, std::sync::atomic::Ordering::Release);
        assert_eq!(theirs.word(1).load(std::sync::atomic::Ordering::Acquire), 7);
        mine.grow(64 << 20).unwrap();
        let (p, q) = (
            mine.addr(40 << 20, 8).unwrap(),
            theirs.addr(40 << 20, 8).unwrap(),
        );
        // SAFETY: 8 bytes inside what the object now holds, in both mappings.
        unsafe {
            p.cast::<u64>().write_unaligned(0xfeed);
            assert_eq!(q.cast::<u64>().read_unaligned(), 0xfeed);
        }
        assert!(mine.addr((1 << 30) - 4, 8).is_none());
        assert!(mine.grow((1 << 30) + 1).is_err());
        let mut peer = SymSegment::open(&name, 1 << 30).unwrap();
        assert!(peer.grow(1 << 29).is_err(), "only the creator grows it");
        mine.unlink();
        assert!(SymSegment::open(&name, 4096).is_err());
        assert_eq!(theirs.word(1).load(std::sync::atomic::Ordering::Acquire), 7);
    }
}
