//! Every number the command line takes, checked in one place.
//!
//! The flags' parsers (`value_parser`) and the host limits a run is checked against
//! before anything starts. Each error is one line naming the value and the range
//! allowed (clap adds the flag), so a bad number is refused up front instead of
//! panicking, aborting, or quietly meaning something else:
//!
//! - durations ([`seconds`]): finite, from 1 ms to [`MAX_SECONDS`] (7 days, the
//!   library's [`ferroccl::config::MAX_TIMEOUT`]);
//! - sizes ([`size`]): bytes with an optional K/M/G suffix, at most [`MAX_BYTES`];
//!   a bench's sizes are also held to whole elements and to this host's memory
//!   ([`bench_memory`]);
//! - rank counts ([`ranks`]): 1 to [`MAX_RANKS`], and what this host can run
//!   ([`host_can_run`]: processes, file descriptors, memory, CPUs);
//! - a parameter server's staleness bound ([`staleness`]: 0 to [`MAX_STALENESS`]
//!   steps, or `inf`) and a straggler's slowdown ([`slow_factor`]: 1 to
//!   [`MAX_SLOW_FACTOR`]).

use std::time::Duration;

/// The longest timeout a flag takes, in seconds: 7 days.
pub const MAX_SECONDS: f64 = ferroccl::config::MAX_TIMEOUT.as_secs() as f64;
/// The shortest: 1 ms (shorter ones round to nothing).
pub const MIN_SECONDS: f64 = 0.001;
/// The largest size a flag takes: 1 TiB (a bench is also held to this host's memory).
pub const MAX_BYTES: usize = 1 << 40;
/// The most iterations a bench runs per size (a billion: days at any size).
pub const MAX_ITERS: usize = 1_000_000_000;
/// The most ranks any command starts on one host (before the host's own limits).
pub const MAX_RANKS: usize = 65_536;
/// Local ranks per CPU at most: ranks busy-poll, so beyond this they mostly wait for
/// a CPU and every timeout becomes a lottery.
pub const RANKS_PER_CPU: usize = 64;

/// A duration in seconds (`60`, `2.5`): finite, within [`MIN_SECONDS`]..=[`MAX_SECONDS`].
pub fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !v.is_finite() {
        return Err(format!(
            "{s} is not a finite number of seconds (the longest allowed is {MAX_SECONDS} s, 7 days)"
        ));
    }
    if v < MIN_SECONDS {
        return Err(format!(
            "{s} s is below the shortest allowed, {MIN_SECONDS} s (a timeout of 0 or less would fail every wait)"
        ));
    }
    if v > MAX_SECONDS {
        return Err(format!(
            "{s} s is above the longest allowed, {MAX_SECONDS} s (7 days)"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A size in bytes, with an optional K, M or G suffix (powers of 1024), at most
/// [`MAX_BYTES`].
pub fn size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let v = num
        .parse::<u128>()
        .map_err(|_| format!("{s:?} is not a size (bytes, or a number with K/M/G)"))?;
    match v.checked_mul(mul as u128) {
        Some(b) if b <= MAX_BYTES as u128 => Ok(b as usize),
        _ => Err(format!(
            "{s} is larger than the largest size allowed, {} (1 TiB)",
            MAX_BYTES
        )),
    }
}

/// An iteration count: 0..=[`MAX_ITERS`].
pub fn iters(s: &str) -> Result<usize, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a count (a whole number from 0)"))?;
    if v > MAX_ITERS as u64 {
        return Err(format!("{v} is above the most allowed, {MAX_ITERS}"));
    }
    Ok(v as usize)
}

#[cfg_attr(not(feature = "candle"), allow(unused_imports))]
pub use training::*;

/// The training flags' parsers (`ferroccl train`, built with the `candle` feature; the
/// tests below check them in every build).
#[cfg_attr(not(feature = "candle"), allow(dead_code))]
mod training {
    pub(super) fn real(s: &str) -> Result<f64, String> {
        let v: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number"))?;
        if v.is_finite() {
            Ok(v)
        } else {
            Err(format!("{s} is not a finite number"))
        }
    }

    /// A finite number above 0 (a learning rate).
    pub fn positive(s: &str) -> Result<f64, String> {
        match real(s)? {
            v if v > 0.0 => Ok(v),
            _ => Err(format!("{s} must be above 0")),
        }
    }

    /// A finite number of 0 or more (a weight decay).
    pub fn non_negative(s: &str) -> Result<f32, String> {
        match real(s)? {
            v if v >= 0.0 && v <= f32::MAX as f64 => Ok(v as f32),
            _ => Err(format!("{s} must be 0 or more")),
        }
    }

    /// A momentum: 0 <= m < 1 (at 1 or above, velocity never decays).
    pub fn momentum(s: &str) -> Result<f32, String> {
        match real(s)? {
            v if (0.0..1.0).contains(&v) => Ok(v as f32),
            _ => Err(format!("{s} must be from 0 up to, not including, 1")),
        }
    }

    /// A share of something: 0 <= f < 1.
    pub fn fraction(s: &str) -> Result<f64, String> {
        match real(s)? {
            v if (0.0..1.0).contains(&v) => Ok(v),
            _ => Err(format!("{s} must be from 0 up to, not including, 1")),
        }
    }

    /// The largest staleness bound a flag takes in steps (beyond it, say `inf`).
    pub const MAX_STALENESS: u64 = 1_000_000;
    /// The largest straggler slowdown a flag takes.
    pub const MAX_SLOW_FACTOR: f64 = 1000.0;

    /// A staleness bound in steps, `None` for `inf` (fully asynchronous).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct StalenessBound(pub Option<u64>);

    /// A staleness bound: a whole number of steps, 0..=[`MAX_STALENESS`], or `inf`.
    pub fn staleness(s: &str) -> Result<StalenessBound, String> {
        let t = s.trim();
        if t == "inf" || t == "async" {
            return Ok(StalenessBound(None));
        }
        let v: u64 = t.parse().map_err(|_| {
            format!("{s:?} is not a staleness bound (a whole number of steps from 0, or inf)")
        })?;
        if v > MAX_STALENESS {
            return Err(format!(
                "{v} steps is above the most allowed, {MAX_STALENESS} (say inf for no bound)"
            ));
        }
        Ok(StalenessBound(Some(v)))
    }

    /// A straggler's slowdown: finite, 1..=[`MAX_SLOW_FACTOR`] (1: not slow).
    pub fn slow_factor(s: &str) -> Result<f64, String> {
        match real(s)? {
            v if (1.0..=MAX_SLOW_FACTOR).contains(&v) => Ok(v),
            _ => Err(format!(
                "{s} must be from 1 (not slow) to {MAX_SLOW_FACTOR}"
            )),
        }
    }
}

/// A rank count: 1..=[`MAX_RANKS`] (what this host can run is [`host_can_run`]'s).
pub fn ranks(s: &str) -> Result<usize, String> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a rank count (a whole number from 1)"))?;
    if v == 0 {
        return Err("a job needs at least 1 rank".into());
    }
    if v > MAX_RANKS as u64 {
        return Err(format!("{v} ranks is above the most allowed, {MAX_RANKS}"));
    }
    Ok(v as usize)
}

/// What this host offers, read once before a run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Host {
    /// CPUs this process may use.
    pub cpus: usize,
    /// Bytes of memory available (`MemAvailable`).
    pub mem_available: u64,
    /// The soft and hard limits on open files per process.
    pub nofile: (u64, u64),
    /// New processes this user may still start (the lesser of `RLIMIT_NPROC` less the
    /// tasks running, and the kernel's free pids and threads).
    pub tasks_free: u64,
}

impl Host {
    /// This host, now (a value that cannot be read is taken as unlimited).
    pub fn read() -> Host {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mem_available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find(|l| l.starts_with("MemAvailable:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|k| k.parse::<u64>().ok())
            })
            .map_or(u64::MAX, |kib| kib.saturating_mul(1024));
        let limit = |res| {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes one rlimit into the valid struct given.
            if unsafe { libc::getrlimit(res, &mut r) } == 0 {
                (r.rlim_cur, r.rlim_max)
            } else {
                (libc::RLIM_INFINITY, libc::RLIM_INFINITY)
            }
        };
        let read_u64 = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
        };
        // Tasks (threads) on the whole machine now: the fourth field of loadavg is
        // "running/total".
        let tasks_now = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|t| {
                t.split_whitespace()
                    .nth(3)
                    .and_then(|f| f.split('/').nth(1))
                    .and_then(|n| n.parse::<u64>().ok())
            })
            .unwrap_or(0);
        let kernel_free = [
            read_u64("/proc/sys/kernel/pid_max"),
            read_u64("/proc/sys/kernel/threads-max"),
        ]
        .into_iter()
        .flatten()
        .map(|m| m.saturating_sub(tasks_now))
        .min()
        .unwrap_or(u64::MAX);
        let nproc = limit(libc::RLIMIT_NPROC).0;
        let user_free = if nproc == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            nproc.saturating_sub(tasks_now)
        };
        Host {
            cpus,
            mem_available,
            nofile: limit(libc::RLIMIT_NOFILE),
            tasks_free: kernel_free.min(user_free),
        }
    }
}

/// What one rank of a job needs, as far as the launcher can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankNeeds {
    /// Threads (tasks) each rank runs.
    pub threads: u64,
    /// Bytes of memory each rank needs.
    pub memory: u64,
    /// File descriptors each rank opens, beyond a base of 64 (`None`: not known, a
    /// command other than ferroccl's own).
    pub files: Option<u64>,
}

impl RankNeeds {
    /// A rank of an unknown command: one task, a few MiB.
    pub const UNKNOWN: RankNeeds = RankNeeds {
        threads: 1,
        memory: 4 << 20,
        files: None,
    };

    /// A ferroccl rank of an `n`-rank job holding `buffers` bytes: its threads
    /// (caller, engine worker, point-to-point, store), a baseline of 16 MiB, and two
    /// links (collectives and point-to-point) per peer.
    pub fn ferroccl(n: usize, buffers: u64) -> RankNeeds {
        RankNeeds {
            threads: 4,
            memory: (16u64 << 20).saturating_add(buffers),
            files: Some(2 * n.saturating_sub(1) as u64),
        }
    }
}

/// Whether this host can run `n` local ranks that each need `need`; the launcher
/// itself keeps two pipes per rank open. `Err` says which limit it breaks and by how
/// much, in one line.
pub fn host_can_run(host: &Host, n: usize, need: RankNeeds) -> Result<(), String> {
    let n64 = n as u64;
    let cpu_cap = host.cpus.saturating_mul(RANKS_PER_CPU);
    if n > cpu_cap {
        return Err(format!(
            "{n} ranks on this host's {} CPUs: at most {cpu_cap} ({RANKS_PER_CPU} per CPU; ranks busy-poll, so more would only wait for a CPU)",
            host.cpus
        ));
    }
    let tasks = n64.saturating_mul(need.threads);
    if tasks > host.tasks_free {
        return Err(format!(
            "{n} ranks need about {tasks} processes and threads; this host lets this user start {} more (ulimit -u, kernel.pid_max, kernel.threads-max)",
            host.tasks_free
        ));
    }
    // The launcher: stdout and stderr pipes per rank, plus its own.
    let launcher_files = 64 + 2 * n64;
    if launcher_files > host.nofile.1 {
        return Err(format!(
            "{n} ranks need {launcher_files} open files in the launcher; the limit is {} (ulimit -Hn)",
            host.nofile.1
        ));
    }
    if let Some(f) = need.files {
        let per = 64 + f;
        if per > host.nofile.1 {
            return Err(format!(
                "each of {n} ranks needs about {per} open files (two links per peer); the limit is {} (ulimit -Hn)",
                host.nofile.1
            ));
        }
    }
    let mem = n64.saturating_mul(need.memory);
    if mem > host.mem_available {
        return Err(format!(
            "{n} ranks need about {} MiB of memory; this host has {} MiB available",
            mem >> 20,
            host.mem_available >> 20
        ));
    }
    Ok(())
}

/// Raises this process's soft open-file limit to what `need` files take (up to the
/// hard limit), so that ranks it starts inherit it; a no-op when the soft limit is
/// enough.
pub fn raise_nofile(need: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one valid rlimit struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 || r.rlim_cur >= need {
            return;
        }
        r.rlim_cur = need.min(r.rlim_max);
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
}

/// A bench's per-rank buffers for sizes up to `max_bytes` (send, receive and the
/// transport's staging: about three times the largest message).
pub fn bench_memory(max_bytes: usize) -> u64 {
    (max_bytes as u64).saturating_mul(3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn durations_are_finite_positive_and_bounded() {
        assert_eq!(seconds("60"), Ok(Duration::from_secs(60)));
        assert_eq!(seconds(" 2.5 "), Ok(Duration::from_millis(2500)));
        assert_eq!(seconds("604800"), Ok(Duration::from_secs(604_800)));
        for bad in [
            "inf",
            "-inf",
            "nan",
            "NaN",
            "1e300",
            "99999999999999999999",
            "0",
            "-1",
            "0.0001",
            "",
            "5s",
            "604801",
        ] {
            let e = seconds(bad).unwrap_err();
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
        assert!(seconds("0").unwrap_err().contains("0.001"));
        assert!(seconds("inf").unwrap_err().contains("finite"));
    }

    #[test]
    fn sizes_are_checked_for_overflow_and_bounds() {
        assert_eq!(size("64M"), Ok(64 << 20));
        assert_eq!(size("1k"), Ok(1024));
        assert_eq!(size("1024G"), Ok(1 << 40));
        for bad in [
            "18446744073709551615",
            "99999999G",
            "1025G",
            "x",
            "",
            "-1",
            "1.5M",
            "G",
        ] {
            assert!(size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn reals_are_finite_and_in_range() {
        assert_eq!(positive("0.05"), Ok(0.05));
        assert_eq!(momentum("0"), Ok(0.0));
        assert_eq!(fraction("0.1"), Ok(0.1));
        assert_eq!(non_negative("1e-4"), Ok(1e-4));
        for bad in ["nan", "inf", "-1", "0", "x"] {
            assert!(positive(bad).is_err(), "{bad}");
        }
        for bad in ["1", "1.5", "-0.1", "nan"] {
            assert!(momentum(bad).is_err() && fraction(bad).is_err(), "{bad}");
        }
        assert!(non_negative("1e300").is_err() && non_negative("-1").is_err());
        assert_eq!(iters("20"), Ok(20));
        assert!(iters("18446744073709551615").is_err() && iters("-1").is_err());
    }

    #[test]
    fn staleness_and_slowdowns_are_bounded() {
        assert_eq!(staleness("0"), Ok(StalenessBound(Some(0))));
        assert_eq!(staleness("inf"), Ok(StalenessBound(None)));
        assert_eq!(staleness("1000000"), Ok(StalenessBound(Some(1_000_000))));
        for bad in ["-1", "1.5", "1000001", "18446744073709551616", "x", ""] {
            let e = staleness(bad).unwrap_err();
            assert!(!e.contains('\n'), "{bad}: {e}");
        }
        assert_eq!(slow_factor("2"), Ok(2.0));
        assert_eq!(slow_factor("1"), Ok(1.0));
        for bad in ["0.5", "0", "-2", "nan", "inf", "1001"] {
            assert!(slow_factor(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rank_counts_are_positive_and_bounded() {
        assert_eq!(ranks("4"), Ok(4));
        for bad in ["0", "-1", "65537", "100000", "3.5", "x"] {
            assert!(ranks(bad).is_err(), "{bad}");
        }
    }

    fn host() -> Host {
        Host {
            cpus: 2,
            mem_available: 24 << 30,
            nofile: (1024, 20_000),
            tasks_free: 50_000,
        }
    }

    #[test]
    fn the_host_limits_name_what_they_break() {
        let h = host();
        assert_eq!(host_can_run(&h, 4, RankNeeds::ferroccl(4, 3 << 26)), Ok(()));
        // 3000 ranks on 2 CPUs: refused for the CPUs, whatever else.
        let e = host_can_run(&h, 3000, RankNeeds::ferroccl(3000, 0)).unwrap_err();
        assert!(e.contains("2 CPUs") && e.contains("128"), "{e}");
        let many = Host { cpus: 4096, ..h };
        let e = host_can_run(&many, 20_000, RankNeeds::ferroccl(20_000, 0)).unwrap_err();
        assert!(e.contains("processes"), "{e}");
        let e = host_can_run(&many, 12_000, RankNeeds::ferroccl(12_000, 0)).unwrap_err();
        assert!(e.contains("open files"), "{e}");
        let e = host_can_run(&h, 100, RankNeeds::ferroccl(100, 1 << 30)).unwrap_err();
        assert!(e.contains("MiB of memory"), "{e}");
        // Another command's ranks: its files are not counted, the launcher's are.
        assert_eq!(host_can_run(&h, 100, RankNeeds::UNKNOWN), Ok(()));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// No input makes a parser panic, and whatever they accept is in range.
        #[test]
        fn no_input_panics_the_parsers(s in any::<String>(), t in "[-+0-9.eEinfINFaAKkMmGg ]{0,24}") {
            for s in [&s, &t] {
                if let Ok(d) = seconds(s) {
                    prop_assert!(d >= Duration::from_millis(1) && d.as_secs_f64() <= MAX_SECONDS);
                }
                if let Ok(b) = size(s) {
                    prop_assert!(b <= MAX_BYTES);
                }
                if let Ok(n) = ranks(s) {
                    prop_assert!((1..=MAX_RANKS).contains(&n));
                }
                if let Ok(n) = iters(s) {
                    prop_assert!(n <= MAX_ITERS);
                }
                if let Ok(StalenessBound(Some(k))) = staleness(s) {
                    prop_assert!(k <= MAX_STALENESS);
                }
                if let Ok(f) = slow_factor(s) {
                    prop_assert!((1.0..=MAX_SLOW_FACTOR).contains(&f));
                }
                for v in [positive(s), fraction(s)].into_iter().flatten() {
                    prop_assert!(v.is_finite() && v >= 0.0);
                }
                for v in [momentum(s), non_negative(s)].into_iter().flatten() {
                    prop_assert!(v.is_finite() && v >= 0.0);
                }
            }
        }

        /// The host check never panics, whatever the host and the needs.
        #[test]
        fn no_host_panics_the_limits(cpus in 0usize..10_000, mem: u64, soft: u64, hard: u64,
                                     tasks: u64, n in 0usize..200_000, buf: u64) {
            let h = Host { cpus, mem_available: mem, nofile: (soft, hard), tasks_free: tasks };
            let _ = host_can_run(&h, n, RankNeeds::ferroccl(n, buf));
            let _ = host_can_run(&h, n, RankNeeds::UNKNOWN);
        }
    }
}
