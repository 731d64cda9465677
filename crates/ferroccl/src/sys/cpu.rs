//! How many CPUs this process may run on, and how many the host has.

/// CPUs in this process's affinity mask (`sched_getaffinity`), or `None` when it
/// cannot be read.
pub(crate) fn affinity_cpus() -> Option<usize> {
    let mut set = std::mem::MaybeUninit::<libc::cpu_set_t>::zeroed();
    // SAFETY: `set` is a valid, zeroed cpu_set_t of the size passed; pid 0 is this
    // thread.
    let r = unsafe {
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set.as_mut_ptr())
    };
    if r != 0 {
        return None;
    }
    // SAFETY: sched_getaffinity filled the set.
    let set = unsafe { set.assume_init() };
    // SAFETY: CPU_COUNT reads the set it is given.
    let n = unsafe { libc::CPU_COUNT(&set) };
    usize::try_from(n).ok().filter(|&n| n > 0)
}

/// CPUs online on this host (`sysconf(_SC_NPROCESSORS_ONLN)`), or `None`.
pub(crate) fn online_cpus() -> Option<usize> {
    // SAFETY: sysconf takes a constant and returns a number.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).ok().filter(|&n| n > 0)
}

/// CPUs this process may use: its affinity mask and cgroup quota
/// (`available_parallelism`), 1 when they cannot be read.
pub(crate) fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPUs one of `local` ranks sharing `usable` CPUs should use for its own threads:
/// an even share, at least 1. A mask narrower than the host is not taken as the
/// launcher's pinning here: a container's cpuset looks the same, and all its ranks
/// share it.
pub(crate) fn share_of(local: usize, usable: usize) -> usize {
    (usable / local.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_gets_an_even_share_of_the_usable_cpus() {
        assert_eq!(share_of(4, 16), 4);
        assert_eq!(share_of(3, 16), 5);
        assert_eq!(share_of(8, 2), 1);
        assert_eq!(share_of(0, 6), 6);
        assert_eq!(share_of(1, 6), 6);
        assert!(usable_cpus() >= 1);
    }

    #[test]
    fn this_process_runs_on_some_of_the_hosts_cpus() {
        let (mine, all) = (affinity_cpus().unwrap(), online_cpus().unwrap());
        assert!(mine >= 1 && mine <= all, "{mine} of {all}");
    }
}
