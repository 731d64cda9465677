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
}
