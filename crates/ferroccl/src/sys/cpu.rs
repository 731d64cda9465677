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

/// The CPUs one of `local` ranks on this host should use for its own threads: its
/// affinity mask's where a launcher pinned it (a mask narrower than the host: the other
/// ranks got CPUs of their own), else an even share of the CPUs it may use (affinity
/// and cgroup quota, `available_parallelism`); at least 1.
pub(crate) fn rank_share(local: usize) -> usize {
    let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
    share_of(local, affinity_cpus(), online_cpus(), usable)
}

fn share_of(local: usize, affinity: Option<usize>, online: Option<usize>, usable: usize) -> usize {
    match (affinity, online) {
        (Some(mine), Some(all)) if mine < all => mine.min(usable).max(1),
        _ => (usable / local.max(1)).max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_rank_keeps_its_cpus_and_an_unpinned_one_gets_its_share() {
        // Pinned by the launcher to 4 of 16: all 4, whatever the local count.
        assert_eq!(share_of(4, Some(4), Some(16), 4), 4);
        // A cgroup quota below the mask still limits it.
        assert_eq!(share_of(4, Some(4), Some(16), 2), 2);
        // Not pinned: the usable CPUs split evenly, at least one each.
        assert_eq!(share_of(4, Some(16), Some(16), 16), 4);
        assert_eq!(share_of(3, Some(16), Some(16), 16), 5);
        assert_eq!(share_of(8, Some(2), Some(2), 2), 1);
        assert_eq!(share_of(0, None, None, 6), 6);
        // Unknown mask or host: the share of what it may use.
        assert_eq!(share_of(2, None, Some(16), 16), 8);
        assert!(rank_share(1) >= 1);
    }

    #[test]
    fn this_process_runs_on_some_of_the_hosts_cpus() {
        let (mine, all) = (affinity_cpus().unwrap(), online_cpus().unwrap());
        assert!(mine >= 1 && mine <= all, "{mine} of {all}");
    }
}
