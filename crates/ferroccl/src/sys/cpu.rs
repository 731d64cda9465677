//! How many CPUs this process may run on, how many the host has, and binding a rank to its share.

/// CPUs in this process's affinity mask (`sched_getaffinity`), or `None` when it
/// cannot be read.
pub(crate) fn affinity_cpus() -> Option<usize> {
    allowed_cpus().map(|c| c.len()).filter(|&n| n > 0)
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

/// The CPUs in this thread's affinity mask, in order, or `None` when it cannot be
/// read.
pub(crate) fn allowed_cpus() -> Option<Vec<usize>> {
    let mut set = std::mem::MaybeUninit::<libc::cpu_set_t>::zeroed();
    // SAFETY: as in `affinity_cpus`.
    let r = unsafe {
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set.as_mut_ptr())
    };
    if r != 0 {
        return None;
    }
    // SAFETY: sched_getaffinity filled the set.
    let set = unsafe { set.assume_init() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET reads the set it is given, for indices below its size.
    Some(
        (0..max)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect(),
    )
}

/// Restricts this thread (and the threads it starts from now on) to `cpus`.
pub(crate) fn bind_this_thread(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET writes a bit of the set it is given; out-of-range indices
        // are ignored by the macro's bounds check.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: a valid set of the size passed; pid 0 is this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The CPUs the `index`-th of `local` ranks on a host should bind to, out of the
/// `allowed` CPUs (this process's mask) of a host with `online` CPUs: an even,
/// contiguous share (the first `allowed % local` ranks one CPU more), so ranks never
/// share a CPU. `None` — leave the scheduler alone — for one rank, when the ranks
/// outnumber the CPUs (they must share), or when the mask is narrower than the host
/// (a launcher, `taskset`, `numactl` or Slurm placed this process already).
pub(crate) fn bind_share(
    index: usize,
    local: usize,
    allowed: &[usize],
    online: usize,
) -> Option<Vec<usize>> {
    // More ranks than CPUs: no binding, as Open MPI does not bind an oversubscribed
    // job. Consecutive ranks pinned to one CPU each made the bench's runs more alike
    // (4 ranks on 2 CPUs, 5 runs: worst slowest/fastest at >= 64 KiB 1.44 against
    // 2.30), but a rank whose work is uneven (a training straggler that sleeps) would
    // leave its CPU half idle while the ranks pinned beside the others' wait.
    if local <= 1 || index >= local || allowed.len() < local || allowed.len() < online {
        return None;
    }
    let (q, r) = (allowed.len() / local, allowed.len() % local);
    let start = index * q + index.min(r);
    let len = q + usize::from(index < r);
    Some(allowed[start..start + len].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_bind_to_disjoint_even_shares_or_not_at_all() {
        let all: Vec<usize> = (0..10).collect();
        let shares: Vec<Vec<usize>> = (0..4)
            .map(|i| bind_share(i, 4, &all, 10).unwrap())
            .collect();
        assert_eq!(shares[0], vec![0, 1, 2]);
        assert_eq!(shares[1], vec![3, 4, 5]);
        assert_eq!(shares[2], vec![6, 7]);
        assert_eq!(shares[3], vec![8, 9]);
        // Every CPU once: disjoint and complete.
        let flat: Vec<usize> = shares.concat();
        assert_eq!(flat, all);
        // Two ranks on two CPUs: one each.
        assert_eq!(bind_share(1, 2, &[0, 1], 2), Some(vec![1]));
        assert_eq!(bind_share(0, 4, &[0, 1], 2), None);
        // One rank, a mask narrower than the host, a bad index.
        assert_eq!(bind_share(0, 1, &all, 10), None);
        assert_eq!(bind_share(0, 2, &[2, 3], 8), None);
        assert_eq!(bind_share(2, 2, &[0, 1], 2), None);
        assert!(allowed_cpus().is_some_and(|c| !c.is_empty()));
    }

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
