//! Cross-memory attach: reading another process's memory in one copy
//! (`process_vm_readv`), for the shared-memory transport's single copy.
//!
//! The kernel allows it when this process may ptrace the other (same user, and under
//! Yama's `ptrace_scope` 1 only if the other named us, or anyone, its ptracer; scope 2
//! and 3 forbid it). Nothing here assumes it works: [`Remote::open`] proves it by
//! reading a [`cookie`] the other process published, which also proves the pid names
//! the process that published it (not another one in another pid namespace, or one
//! that took a dead process's pid).
//!
//! A [`Remote`] holds a pidfd of the process, so [`Remote::exited`] tells whether the
//! pid still names it: a read that raced with the process's death (its pid possibly
//! reused) is thrown away by the caller.

use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

/// This process's cookie: an address in it and the random word stored there, which a
/// peer reads through [`Remote::open`] to prove it can read this process's memory.
pub(crate) fn cookie() -> (u64, u64) {
    static COOKIE: OnceLock<Box<u64>> = OnceLock::new();
    let c = COOKIE.get_or_init(|| {
        let mut v = 0u64;
        // SAFETY: writing 8 bytes into `v`, which we own.
        let r = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
        if r != 8 {
            // No entropy call: anything unlikely to sit at that address by chance.
            v = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ (u64::from(std::process::id()) << 32);
        }
        Box::new(v | 1)
    });
    (&**c as *const u64 as u64, **c)
}

/// Lets peer processes of this user read this process's memory where Yama's
/// `ptrace_scope` is 1 (they are siblings, not ancestors): `PR_SET_PTRACER_ANY`, as
/// Open MPI's CMA path does. Returns why single copy cannot work here, if it cannot.
pub(crate) fn allow_peers() -> Result<(), String> {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    match scope {
        None | Some(0) => Ok(()),
        Some(1) => {
            // SAFETY: prctl with integer arguments only.
            let r = unsafe {
                libc::prctl(
                    libc::PR_SET_PTRACER,
                    libc::PR_SET_PTRACER_ANY,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                    0 as libc::c_ulong,
                )
            };
            if r == 0 {
                Ok(())
            } else {
                Err(format!(
                    "prctl(PR_SET_PTRACER) failed under Yama ptrace_scope 1: {}",
                    io::Error::last_os_error()
                ))
            }
        }
        Some(s) => Err(format!(
            "Yama ptrace_scope is {s}: no process may read another's memory"
        )),
    }
}

/// Another process whose memory this one can read.
pub(crate) struct Remote {
    pid: libc::pid_t,
    pidfd: OwnedFd,
}

impl Remote {
    /// Opens process `pid` and reads its cookie at `addr`, which must be `value`: an
    /// error says why this process cannot read that one's memory.
    pub fn open(pid: u32, addr: u64, value: u64) -> io::Result<Remote> {
        let pid = libc::pid_t::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| io::Error::other(format!("pid {pid}")))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just gave us, owned from here on.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
        let r = Remote { pid, pidfd };
        let mut got = [0u8; 8];
        let n = r.read(addr, &mut [IoSliceMut::new(&mut got)])?;
        if n != 8 || u64::from_ne_bytes(got) != value {
            return Err(io::Error::other(format!(
                "pid {pid} is not the process that published the cookie"
            )));
        }
        if r.exited() {
            return Err(io::Error::other(format!("process {pid} exited")));
        }
        Ok(r)
    }

    /// Copies from this process's memory at `addr` into `dst` (in order, as one
    /// stream), returning how many bytes came (fewer than asked when the range ends in
    /// unmapped memory). The caller guarantees, by its protocol with the other process,
    /// that the range is readable and not being changed, and checks [`Remote::exited`]
    /// before trusting the bytes.
    pub fn read(&self, addr: u64, dst: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        let total: usize = dst.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        // IoSliceMut is ABI-compatible with iovec on unix.
        let local = dst.as_mut_ptr().cast::<libc::iovec>();
        let remote = libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: total,
        };
        loop {
            // SAFETY: `local` points to `dst.len()` valid iovecs over memory we may
            // write; the remote range is only read, by the kernel, in the other process.
            let n = unsafe {
                libc::process_vm_readv(self.pid, local, dst.len() as libc::c_ulong, &remote, 1, 0)
            };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Whether the process has exited (its pid may now name another process).
    pub fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r != 0 && (r < 0 || p.revents != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_itself_and_a_wrong_cookie_is_refused() {
        let (addr, value) = cookie();
        let me = std::process::id();
        let r = Remote::open(me, addr, value).expect("reading our own memory");
        assert!(!r.exited());
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 13) as u8).collect();
        let (mut a, mut b) = (vec![0u8; 30_000], vec![0u8; 70_000]);
        let n = r
            .read(
                src.as_ptr() as u64,
                &mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)],
            )
            .unwrap();
        assert_eq!(n, 100_000);
        assert_eq!(a[..], src[..30_000]);
        assert_eq!(b[..], src[30_000..]);
        assert!(Remote::open(me, addr, value ^ 2).is_err(), "wrong cookie");
        assert!(Remote::open(0, addr, value).is_err(), "no pid 0");
    }

    #[test]
    fn a_child_that_exited_is_seen_to_have() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawning sleep");
        let pid = child.id();
        // The child's memory holds no cookie of ours: open fails, but the pidfd
        // liveness check is what this test is about, so make one directly.
        // SAFETY: as in Remote::open.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        assert!(fd >= 0, "{}", io::Error::last_os_error());
        let r = Remote {
            pid: pid as libc::pid_t,
            // SAFETY: a descriptor just made.
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) },
        };
        assert!(!r.exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(r.exited());
    }
}
