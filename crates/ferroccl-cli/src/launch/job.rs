//! The ranks of one attempt: started, watched, stopped, reaped.

use super::*;

/// One started rank.
pub(super) struct Rank {
    pub(super) child: Child,
    /// Its pid, which is also its process group id.
    pub(super) pid: libc::pid_t,
    /// How it ended, once seen (it stays unreaped until [`Job::reap_and_drain`], so its
    /// pid and process group id cannot be reused while we may still signal them).
    pub(super) exit: Option<RankExit>,
    /// Reaped already (only when `waitid` was unavailable).
    pub(super) reaped: bool,
}

pub(super) struct Job {
    pub(super) ranks: Vec<Rank>,
    pub(super) readers: Vec<JoinHandle<()>>,
    pub(super) fwd: Arc<Forwarding>,
    /// The job-wide rank of `ranks[0]` (this host's first).
    pub(super) first_rank: usize,
}

impl Job {
    pub(super) fn new(fwd: Arc<Forwarding>) -> Self {
        Self {
            ranks: Vec::new(),
            readers: Vec::new(),
            fwd,
            first_rank: 0,
        }
    }

    pub(super) fn start(
        &mut self,
        nproc: usize,
        program: &OsString,
        args: &[OsString],
        env: &AttemptEnv<'_>,
    ) -> Result<(), LaunchError> {
        let foreign: Vec<OsString> = std::env::vars_os()
            .map(|(k, _)| k)
            .filter(|k| {
                let k = k.to_string_lossy();
                k.starts_with(FOREIGN_PREFIX) || FOREIGN_VARS.contains(&k.as_ref())
            })
            .collect();
        // One job token for all ranks (kept if the caller set one): every connection
        // of the job proves it, so a stranger or a process of another job is refused.
        let token = std::env::var("FERROCCL_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(ferroccl::rendezvous::new_token);
        self.first_rank = env.node_rank * nproc;
        for local in 0..nproc {
            let rank = self.first_rank + local;
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", (env.nnodes * nproc).to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("GROUP_RANK", env.node_rank.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("MASTER_ADDR", env.master_addr)
                .env("MASTER_PORT", env.port.to_string())
                .env("FERROCCL_LAUNCHED", "1")
                .env("FERROCCL_TOKEN", &token)
                // The job's identity, in every rank's JOIN: a rank of another job (or
                // of an earlier attempt) that reaches this store is refused by name.
                .env("FERROCCL_JOB_ID", env.job_id)
                .env("FERROCCL_RESTART_COUNT", env.attempt.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            for k in &foreign {
                cmd.env_remove(k);
            }
            die_with_parent(&mut cmd);
            let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
                program: program.to_string_lossy().into_owned(),
                rank,
                source,
            })?;
            let pid = libc::pid_t::try_from(child.id()).unwrap_or(libc::pid_t::MAX);
            let out = child.stdout.take();
            let err = child.stderr.take();
            self.ranks.push(Rank {
                child,
                pid,
                exit: None,
                reaped: false,
            });
            if let Some(out) = out {
                self.forward(rank, out, Stream::Stdout)?;
            }
            if let Some(err) = err {
                self.forward(rank, err, Stream::Stderr)?;
            }
            // Starting many ranks takes a while: a signal, or a rank that failed
            // already, stops the start-up here (the caller stops those started).
            let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
            if sig != 0 {
                return Err(LaunchError::Interrupted {
                    signal: sig,
                    stopped: self.running(),
                });
            }
            if local % 8 == 7 || local + 1 == nproc {
                if let Some((rank, status)) = self.poll() {
                    return Err(LaunchError::RankFailed {
                        rank,
                        status,
                        stopped: self.running(),
                    });
                }
            }
        }
        Ok(())
    }

    pub(super) fn forward(
        &mut self,
        rank: usize,
        pipe: impl Read + Send + 'static,
        stream: Stream,
    ) -> Result<(), LaunchError> {
        let fwd = Arc::clone(&self.fwd);
        fwd.live.fetch_add(1, Ordering::SeqCst);
        let spawned = thread::Builder::new()
            .name(format!("rank{rank}-{stream:?}"))
            .spawn(move || forward_lines(rank, pipe, stream, &fwd));
        match spawned {
            Ok(h) => {
                self.readers.push(h);
                Ok(())
            }
            Err(source) => {
                self.fwd.live.fetch_sub(1, Ordering::SeqCst);
                Err(LaunchError::Io {
                    what: "starting an output-forwarding thread",
                    source,
                })
            }
        }
    }

    /// Looks for ranks that ended; returns the first failure seen in this pass.
    pub(super) fn poll(&mut self) -> Option<(usize, RankExit)> {
        let mut failed = None;
        for (i, r) in self.ranks.iter_mut().enumerate() {
            if r.exit.is_some() {
                continue;
            }
            if let Some(st) = poll_exit(r) {
                r.exit = Some(st);
                if failed.is_none() && !st.success() {
                    failed = Some((self.first_rank + i, st));
                }
            }
        }
        failed
    }

    pub(super) fn running(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&i| self.ranks[i].exit.is_none())
            .map(|i| self.first_rank + i)
            .collect()
    }

    /// Sends `sig` to the process group of every unreaped rank (those already exited
    /// too: that reaches processes they left behind).
    pub(super) fn signal_all(&self, sig: i32) {
        for r in &self.ranks {
            if r.reaped || r.pid <= 0 {
                continue;
            }
            // SAFETY: plain syscall; the pid is an unreaped child of ours, so neither
            // it nor its process group id can belong to an unrelated process.
            unsafe {
                if libc::kill(-r.pid, sig) != 0 {
                    libc::kill(r.pid, sig);
                }
                // A stopped rank (SIGSTOP, a debugger let go) acts on a stop signal
                // only once it runs again: wake it, or only SIGKILL would end it.
                if sig != libc::SIGKILL && libc::kill(-r.pid, libc::SIGCONT) != 0 {
                    libc::kill(r.pid, libc::SIGCONT);
                }
            }
        }
    }

    /// With `FERROCCL_TRACE_DIR` set (the ranks inherit it), asks every running rank
    /// for its flight recorder before it is stopped: SIGUSR1, which ferroccl answers by
    /// dumping into that directory. Waits until each running rank's `rank-<i>.jsonl`
    /// there is fresh, the rank has ended, or [`DUMP_WAIT`] has passed, whichever is
    /// first (a second signal to the launcher cuts it short).
    pub(super) fn request_dumps(&mut self) {
        let Some(dir) = std::env::var_os(ferroccl::trace::TRACE_DIR_ENV).filter(|d| !d.is_empty())
        else {
            return;
        };
        let dir = std::path::PathBuf::from(dir);
        // File times come from a coarse clock: allow for it (a dump taken a moment
        // before the request, at the failure, is as good).
        let asked = std::time::SystemTime::now() - Duration::from_millis(100);
        let running = self.running();
        for &i in &running {
            let r = &self.ranks[i];
            if r.reaped || r.pid <= 0 {
                continue;
            }
            // SAFETY: plain syscall to an unreaped child of ours (so the pid is not
            // reused); to the rank itself only, not to processes it started, which may
            // not handle SIGUSR1.
            unsafe { libc::kill(r.pid, libc::SIGUSR1) };
        }
        let fresh = |i: usize| {
            std::fs::metadata(dir.join(format!("rank-{i}.jsonl")))
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= asked)
        };
        let since = Instant::now();
        while since.elapsed() < DUMP_WAIT && PENDING_SIGNAL.load(Ordering::SeqCst) == 0 {
            self.poll();
            if running
                .iter()
                .all(|&i| self.ranks[i].exit.is_some() || fresh(i))
            {
                break;
            }
            thread::sleep(POLL);
        }
    }

    /// The wait loop: returns when every rank has ended.
    ///
    /// When a rank fails, the others get [`SETTLE`] to end on their own first: a
    /// ferroccl rank told of the failure errors within milliseconds and says why on
    /// stderr, words a SIGTERM would cut off. Those still running then are stopped.
    pub(super) fn wait(&mut self, grace: Duration) -> Result<(), LaunchError> {
        let mut outcome: Option<LaunchError> = None;
        let mut stopping_since: Option<Instant> = None;
        let mut settle_until: Option<Instant> = None;
        let mut killed = false;
        loop {
            let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
            if sig != 0 {
                if outcome.is_none() || settle_until.is_some() {
                    // A signal stops the job now, also while a failure settles.
                    settle_until = None;
                    let stopped = self.running();
                    outcome = Some(match outcome.take() {
                        Some(LaunchError::RankFailed { rank, status, .. }) => {
                            LaunchError::RankFailed {
                                rank,
                                status,
                                stopped,
                            }
                        }
                        _ => LaunchError::Interrupted {
                            signal: sig,
                            stopped,
                        },
                    });
                    self.request_dumps();
                    self.signal_all(sig);
                    stopping_since = Some(Instant::now());
                } else if !killed {
                    // A second signal while stopping: do not wait for the grace period.
                    self.signal_all(libc::SIGKILL);
                    killed = true;
                }
            }
            if let Some((rank, status)) = self.poll() {
                if outcome.is_none() {
                    outcome = Some(LaunchError::RankFailed {
                        rank,
                        status,
                        stopped: Vec::new(),
                    });
                    settle_until = Some(Instant::now() + SETTLE);
                }
            }
            if let Some(until) = settle_until {
                let all_ended = self.ranks.iter().all(|r| r.exit.is_some());
                if all_ended || Instant::now() >= until {
                    settle_until = None;
                    let still = self.running();
                    if let Some(LaunchError::RankFailed { stopped, .. }) = &mut outcome {
                        *stopped = still;
                    }
                    if !all_ended {
                        self.request_dumps();
                        self.signal_all(libc::SIGTERM);
                        stopping_since = Some(Instant::now());
                    }
                }
            }
            if self.ranks.iter().all(|r| r.exit.is_some()) {
                break;
            }
            if let Some(since) = stopping_since {
                if !killed && since.elapsed() >= grace {
                    self.signal_all(libc::SIGKILL);
                    killed = true;
                }
            }
            thread::sleep(POLL);
        }
        match outcome {
            Some(e) => {
                // Leftovers in the ranks' process groups (children that ignored SIGTERM).
                self.signal_all(libc::SIGKILL);
                Err(e)
            }
            None => Ok(()),
        }
    }

    /// Stops every started rank (SIGTERM, SIGKILL after `grace`) and waits for them.
    pub(super) fn stop(&mut self, grace: Duration) {
        self.signal_all(libc::SIGTERM);
        let since = Instant::now();
        loop {
            self.poll();
            if self.ranks.iter().all(|r| r.exit.is_some()) || since.elapsed() >= grace {
                break;
            }
            thread::sleep(POLL);
        }
        self.signal_all(libc::SIGKILL);
    }

    /// After a failed or interrupted job: every started rank's last line on stderr
    /// (its own error, usually), in rank order, so that no rank's word is lost among
    /// the others' output.
    pub(super) fn print_last_words(&self) {
        let words = self
            .fwd
            .last_words
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let _guard = lock_output();
        let mut err = io::stderr().lock();
        let _ = writeln!(err, "ferroccl launch: each rank's last line on stderr:");
        for (i, r) in self.ranks.iter().enumerate() {
            let rank = self.first_rank + i;
            let how = r
                .exit
                .map_or("not seen ending".to_string(), |e| e.to_string());
            let _ = match words.get(&rank) {
                Some(w) => writeln!(err, "  [{rank}] ({how}) {w}"),
                None => writeln!(err, "  [{rank}] ({how}) nothing on stderr"),
            };
        }
    }

    /// Reaps every rank, then waits for the forwarders to reach end of output.
    pub(super) fn reap_and_drain(&mut self) {
        for r in &mut self.ranks {
            if !r.reaped {
                let _ = r.child.wait();
                r.reaped = true;
            }
        }
        let mut last = self.fwd.progress.load(Ordering::SeqCst);
        let mut idle_since = Instant::now();
        while self.fwd.live.load(Ordering::SeqCst) > 0 {
            let now = self.fwd.progress.load(Ordering::SeqCst);
            if now != last || self.fwd.writing.load(Ordering::SeqCst) > 0 {
                last = now;
                idle_since = Instant::now();
            } else if idle_since.elapsed() >= DRAIN_IDLE {
                // Something outside the job holds a pipe open; leave its reader behind.
                self.readers.clear();
                return;
            }
            thread::sleep(POLL);
        }
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Whether the rank has ended, without reaping it (so its pid stays ours to signal).
#[cfg(target_os = "linux")]
pub(super) fn poll_exit(r: &mut Rank) -> Option<RankExit> {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value and waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let id = libc::id_t::try_from(r.pid).unwrap_or(0);
    // SAFETY: `info` is a valid, writable siginfo_t.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            id,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    if rc != 0 {
        return try_wait_exit(r);
    }
    // SAFETY: waitid filled the SIGCHLD fields (or left the zeroed struct: si_pid 0).
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if pid == 0 {
        return None;
    }
    match info.si_code {
        libc::CLD_EXITED => Some(RankExit::Code(status)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some(RankExit::Signal(status)),
        _ => None,
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn poll_exit(r: &mut Rank) -> Option<RankExit> {
    try_wait_exit(r)
}

/// Fallback that reaps: the rank is then no longer signalled.
pub(super) fn try_wait_exit(r: &mut Rank) -> Option<RankExit> {
    match r.child.try_wait() {
        Ok(Some(st)) => {
            r.reaped = true;
            Some(match (st.code(), st.signal()) {
                (Some(c), _) => RankExit::Code(c),
                (None, Some(s)) => RankExit::Signal(s),
                (None, None) => RankExit::Code(1),
            })
        }
        Ok(None) => None,
        Err(_) => {
            // Not our child any more (cannot happen unless someone else reaped it).
            r.reaped = true;
            Some(RankExit::Code(1))
        }
    }
}

/// On Linux, have the kernel SIGKILL the rank if the launcher dies, so a killed launcher
/// leaves no orphans.
#[cfg(target_os = "linux")]
pub(super) fn die_with_parent(cmd: &mut Command) {
    let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: the closure only makes async-signal-safe syscalls (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                // The launcher died before prctl took effect.
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn die_with_parent(_cmd: &mut Command) {}
