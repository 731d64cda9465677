//! POSIX shared memory: a named segment one process creates and others map.
//!
//! Segments are created `0600` (only this user's processes can map them), named by
//! the caller (the transports name them by communicator id and rank, so another job
//! cannot collide with them), and unlinked when their creator drops them; mappings
//! made by others stay valid until those are dropped too.

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
    pub fn create(name: &str, len: usize) -> Result<Self> {
        Self::map(name, len, true)
    }

    /// Maps the existing segment `name`, which must hold at least `len` bytes.
    pub fn open(name: &str, len: usize) -> Result<Self> {
        Self::map(name, len, false)
    }

    fn map(name: &str, len: usize, owner: bool) -> Result<Self> {
        let cname = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("shared-memory name {name:?}")))?;
        let flags = if owner {
            libc::O_CREAT | libc::O_RDWR | libc::O_TRUNC
        } else {
            libc::O_RDWR
        };
        // SAFETY: a NUL-terminated name; the descriptor is closed below.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(Error::io(
                format!("shm_open {name}"),
                std::io::Error::last_os_error(),
            ));
        }
        let sized = if owner {
            // SAFETY: `fd` is ours.
            let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
            if r == 0 {
                Ok(())
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
            // SAFETY: mapping `len` bytes of a shared object that holds at least that.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
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
