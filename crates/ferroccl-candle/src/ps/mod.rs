//! A sharded parameter server with bounded staleness (SSP), next to [`crate::ddp`]'s
//! synchronous data parallelism.
//!
//! Every rank is a worker and the server of one shard: the flat f32 parameter vector
//! is cut into N balanced contiguous shards ([`ssp::shards`]), shard j served by rank
//! j. Each step a worker pulls every shard (the server answers once the SSP rule
//! admits the worker, [`ssp`]), computes its gradient, and pushes each shard's part to
//! its server, which applies it with the [`Optimizer`] in arrival order. A worker waits
//! only on the servers it talks to, never on another worker directly; with staleness
//! s = 0 it is synchronous (servers average each step's gradients, as DDP), with
//! s = ∞ fully asynchronous. The pure core (clocks, admission, staleness, each shard's
//! state machine) is [`ssp`]; this module only moves its messages.
//!
//! **Threads and communicators.** A rank's server runs on a thread of its own, so a
//! worker that computes (or a straggler that sleeps) never stops its shard from being
//! served. Two communicators split from the job's carry the traffic: on `req` workers
//! send (pulls, pushes, finishes) and servers receive; on `rep` servers send (versions
//! and parameters) and workers receive. Point-to-point messages are matched per
//! (communicator, peer) in posting order, so with each direction on its own
//! communicator a rank's worker and server (who share both, behind a mutex held only
//! to post) never take each other's messages, even when they talk to themselves. A
//! server keeps one header receive posted per running worker and polls them
//! ([`ferroccl`] has no receive-from-any-source).
//!
//! **Failures.** A server whose receive fails (a worker's rank died: its connection
//! closed) fails and aborts the rank's two communicators, so that nothing waits on it;
//! every server holds a receive from every running worker, so every surviving rank's
//! server sees a dead rank itself and its error names it (a failed server aborts its
//! rank a second later, so that its own abort does not reach the others first). Of its
//! server's and its worker's failures a rank returns the one seen first (the later is
//! an echo: its own abort, or a neighbour's).

pub mod ssp;

use crate::ddp::Optimizer;
use crate::error::{Error, Result};
use ferroccl::{Communicator, Pending, ReduceOp};
use ssp::{shards, Histogram, ShardServer, Staleness};
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const TAG_HEAD: u32 = 0x7073_0001;
const TAG_GRAD: u32 = 0x7073_0002;
const TAG_REPLY: u32 = 0x7073_0003;
const TAG_PARAMS: u32 = 0x7073_0004;

const PULL: i64 = 1;
const PUSH: i64 = 2;
const DONE: i64 = 3;

/// How long a rank whose worker failed lets its server find the cause itself (a dead
/// peer, which names the rank) before aborting it.
const GRACE: Duration = Duration::from_secs(2);

/// How long a failed server waits before aborting its rank's communicators (see
/// [`run`]).
const CASCADE_DELAY: Duration = Duration::from_secs(1);

/// What a worker does: the parameter server calls it once per step.
pub trait Worker {
    /// Whether to run `step` (false: the worker finishes, its clock stays `step`).
    fn wants(&mut self, step: u64) -> bool;
    /// The gradient of `step` at `params` (the whole flat vector; as long as it), and
    /// the learning rate to apply it at.
    fn gradient(&mut self, step: u64, params: &[f32]) -> Result<(Vec<f32>, f32)>;
}

/// The servers' state, whole (every shard end to end): what a checkpoint holds and
/// a resumed run starts from.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PsState {
    /// The parameters.
    pub params: Vec<f32>,
    /// The optimizer's buffers by kind (SGD: `momentum`), each as long as `params`.
    pub opt: Vec<(String, Vec<f32>)>,
    /// The optimizer's counters by kind (Adam: `step`), one per server.
    pub counters: Vec<(String, Vec<u64>)>,
    /// Each worker's clock (steps done).
    pub clocks: Vec<u64>,
}

/// What a parameter-server run did; the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct PsOutcome {
    /// The servers' final state.
    pub state: PsState,
    /// Staleness of every update applied, over all servers.
    pub histogram: Histogram,
    /// Optimizer steps applied, over all servers.
    pub updates: u64,
}

fn lock(m: &Mutex<Communicator>) -> MutexGuard<'_, Communicator> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs a parameter-server job on `comm`'s ranks: every rank calls it with the same
/// `params` length, staleness and optimizer; rank 0's `params` (or `resume`'s state)
/// are where every shard starts. Returns when every worker has finished, with the
/// servers' final state gathered on every rank.
pub fn run<O: Optimizer + Send>(
    comm: &Communicator,
    mut params: Vec<f32>,
    opt: O,
    staleness: Staleness,
    resume: Option<&PsState>,
    worker: &mut impl Worker,
) -> Result<PsOutcome> {
    let (n, me) = (comm.world_size(), comm.rank());
    let layout = shards(params.len(), n)?;
    let mine = layout[me].clone();
    comm.broadcast(&mut params, 0)?;
    let clocks = match resume {
        Some(st) => {
            check_state(st, params.len(), n)?;
            st.clocks.clone()
        }
        None => vec![0; n],
    };
    let start = clocks[me];
    let shard = match resume {
        Some(st) => st.params[mine.clone()].to_vec(),
        None => params[mine.clone()].to_vec(),
    };
    let mut srv = ShardServer::new(shard, opt, clocks, staleness);
    if let Some(st) = resume {
        restore_shard(&mut srv, st, &mine, me)?;
    }
    let req = comm
        .split(Some(0), me as i64)?
        .ok_or_else(|| Error::invalid("split gave no communicator"))?;
    let rep = comm
        .split(Some(0), me as i64)?
        .ok_or_else(|| Error::invalid("split gave no communicator"))?;
    let aborts = [req.abort_handle(), rep.abort_handle()];
    let abort = || aborts.iter().for_each(|a| a.abort());
    let (req, rep) = (Mutex::new(req), Mutex::new(rep));
    let (served, worked) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let r = serve(&req, &rep, &mut srv, &layout, me);
            let at = Instant::now();
            if r.is_err() {
                // The failure closed this server's receives (their communicator tells its
                // peers why); the other communicator is aborted a moment later, so that
                // the other ranks' servers, which hold receives from every worker, see
                // where the failure started before they hear that this rank gave up.
                std::thread::sleep(CASCADE_DELAY);
                abort();
            }
            (r, at)
        });
        let w = work(&req, &rep, &layout, start, worker);
        let w_at = Instant::now();
        if w.is_err() {
            let t = Instant::now();
            while !h.is_finished() && t.elapsed() < GRACE {
                std::thread::sleep(Duration::from_millis(5));
            }
            abort();
        }
        let served = h.join().unwrap_or_else(|_| {
            (
                Err(Error::invalid("the parameter server's thread panicked")),
                Instant::now(),
            )
        });
        (served, (w, w_at))
    });
    // Of two failures, the first seen: the later one is its echo (this rank's own
    // abort, or a neighbour's).
    match (served, worked) {
        ((Ok(()), _), (Ok(_), _)) => {}
        ((Err(s), _), (Ok(_), _)) => return Err(s),
        ((Ok(()), _), (Err(w), _)) => return Err(w),
        ((Err(s), s_at), (Err(w), w_at)) => return Err(if w_at < s_at { w } else { s }),
    }
    gather(comm, &mut srv, &layout)
}

fn check_state(st: &PsState, total: usize, n: usize) -> Result<()> {
    let bad = |why: String| Err(Error::invalid(format!("parameter-server state: {why}")));
    if st.params.len() != total || st.opt.iter().any(|(_, b)| b.len() != total) {
        return bad(format!(
            "holds {} parameters, the model {total}",
            st.params.len()
        ));
    }
    if st.clocks.len() != n || st.counters.iter().any(|(_, c)| c.len() != n) {
        return bad(format!(
            "written by {} workers, this job has {n}",
            st.clocks.len()
        ));
    }
    Ok(())
}

fn restore_shard<O: Optimizer>(
    srv: &mut ShardServer<O>,
    st: &PsState,
    mine: &Range<usize>,
    me: usize,
) -> Result<()> {
    let (_, opt) = srv.parts_mut();
    for (kind, bufs) in opt.state() {
        let whole = st.opt.iter().find(|(k, _)| k == kind).ok_or_else(|| {
            Error::invalid(format!("parameter-server state: no optimizer {kind}"))
        })?;
        bufs[0] = whole.1[mine.clone()].to_vec();
    }
    for (kind, c) in opt.counters() {
        let v =
            st.counters.iter().find(|(k, _)| k == kind).ok_or_else(|| {
                Error::invalid(format!("parameter-server state: no counter {kind}"))
            })?;
        *c = v.1[me];
    }
    Ok(())
}

/// The worker's loop: pull every shard, compute, push every shard, until it is done.
fn work(
    req: &Mutex<Communicator>,
    rep: &Mutex<Communicator>,
    layout: &[Range<usize>],
    start: u64,
    worker: &mut impl Worker,
) -> Result<u64> {
    let total = layout.last().map_or(0, |r| r.end);
    let mut params = vec![0.0f32; total];
    let mut versions = vec![0u64; layout.len()];
    let mut sent: (Vec<Pending<i64>>, Vec<Pending<f32>>) = (Vec::new(), Vec::new());
    let mut clock = start;
    while worker.wants(clock) {
        let mut replies = Vec::with_capacity(layout.len());
        {
            let c = lock(rep);
            for (j, r) in layout.iter().enumerate() {
                replies.push((
                    c.recv_start(vec![0i64; 2], j, TAG_REPLY)?,
                    c.recv_start(vec![0.0f32; r.len()], j, TAG_PARAMS)?,
                ));
            }
        }
        {
            let c = lock(req);
            for j in 0..layout.len() {
                sent.0
                    .push(c.send_start(vec![PULL, clock as i64, 0, 0], j, TAG_HEAD)?);
            }
        }
        for (j, (head, body)) in replies.into_iter().enumerate() {
            let h = head.wait()?;
            if h[0] != clock as i64 || h[1] < 0 {
                return Err(Error::invalid(format!(
                    "parameter server {j} answered step {} with version {} (asked for step {clock})",
                    h[0], h[1]
                )));
            }
            versions[j] = h[1] as u64;
            params[layout[j].clone()].copy_from_slice(&body.wait()?);
        }
        let (grad, lr) = worker.gradient(clock, &params)?;
        if grad.len() != total {
            return Err(Error::invalid(format!(
                "the worker's gradient has {} elements, the parameters {total}",
                grad.len()
            )));
        }
        // The last step's messages have long left; surface their errors.
        for p in sent.0.drain(..) {
            p.wait()?;
        }
        for p in sent.1.drain(..) {
            p.wait()?;
        }
        let c = lock(req);
        for (j, r) in layout.iter().enumerate() {
            let head = vec![
                PUSH,
                clock as i64,
                versions[j] as i64,
                f64::from(lr).to_bits() as i64,
            ];
            sent.0.push(c.send_start(head, j, TAG_HEAD)?);
            sent.1
                .push(c.send_start(grad[r.clone()].to_vec(), j, TAG_GRAD)?);
        }
        drop(c);
        clock += 1;
    }
    {
        let c = lock(req);
        for j in 0..layout.len() {
            sent.0
                .push(c.send_start(vec![DONE, clock as i64, 0, 0], j, TAG_HEAD)?);
        }
    }
    for p in sent.0 {
        p.wait()?;
    }
    for p in sent.1 {
        p.wait()?;
    }
    Ok(clock)
}

/// The server's loop over shard `me`: poll one header receive per running worker,
/// hand each message to the state machine, send what it admits, until every worker
/// has finished.
fn serve<O: Optimizer>(
    req: &Mutex<Communicator>,
    rep: &Mutex<Communicator>,
    srv: &mut ShardServer<O>,
    layout: &[Range<usize>],
    me: usize,
) -> Result<()> {
    let n = layout.len();
    let len = layout[me].len();
    let post = |w: usize| lock(req).recv_start(vec![0i64; 4], w, TAG_HEAD);
    let mut heads: Vec<Option<Pending<i64>>> = (0..n)
        .map(|w| srv.clocks().running(w).then(|| post(w)).transpose())
        .collect::<ferroccl::Result<_>>()?;
    let mut out: (Vec<Pending<i64>>, Vec<Pending<f32>>) = (Vec::new(), Vec::new());
    let reply = |out: &mut (Vec<Pending<i64>>, Vec<Pending<f32>>),
                 srv: &ShardServer<O>,
                 w: usize,
                 step: u64,
                 v: u64|
     -> Result<()> {
        let c = lock(rep);
        out.0
            .push(c.send_start(vec![step as i64, v as i64], w, TAG_REPLY)?);
        out.1
            .push(c.send_start(srv.params().to_vec(), w, TAG_PARAMS)?);
        Ok(())
    };
    let mut nap = Duration::from_micros(20);
    while !srv.all_finished() {
        let mut moved = false;
        for (w, head) in heads.iter_mut().enumerate() {
            if !head.as_ref().is_some_and(Pending::test) {
                continue;
            }
            moved = true;
            let h = head.take().expect("tested above").wait()?;
            let step = u64::try_from(h[1]).map_err(|_| bad_message(w, &h))?;
            match h[0] {
                PULL => {
                    if let Some(v) = srv.pull(w, step)? {
                        reply(&mut out, srv, w, step, v)?;
                    }
                }
                PUSH => {
                    let g = lock(req).recv_start(vec![0.0f32; len], w, TAG_GRAD)?;
                    let g = g.wait()?;
                    let version = u64::try_from(h[2]).map_err(|_| bad_message(w, &h))?;
                    let lr = f64::from_bits(h[3] as u64) as f32;
                    srv.push(w, step, version, lr, g)?;
                }
                DONE if step == srv.pushed(w) => srv.finish(w)?,
                _ => return Err(bad_message(w, &h)),
            }
            if h[0] != DONE {
                *head = Some(post(w)?);
            }
            for (p, v) in srv.admitted() {
                reply(&mut out, srv, p.worker, p.step, v)?;
            }
        }
        reap(&mut out.0)?;
        reap(&mut out.1)?;
        if moved {
            nap = Duration::from_micros(20);
        } else {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
    for p in out.0 {
        p.wait()?;
    }
    for p in out.1 {
        p.wait()?;
    }
    Ok(())
}

fn bad_message(w: usize, h: &[i64]) -> Error {
    Error::invalid(format!(
        "parameter server: worker {w} sent a message it has no business sending: {h:?}"
    ))
}

/// Waits for the sends that are done (their errors surface here), keeps the rest.
fn reap<T>(v: &mut Vec<Pending<T>>) -> Result<()> {
    let mut i = 0;
    while i < v.len() {
        if v[i].test() {
            v.swap_remove(i).wait()?;
        } else {
            i += 1;
        }
    }
    Ok(())
}

/// Every server's shard, optimizer state, counters, clocks and histogram, on every
/// rank (collective over `comm`).
fn gather<O: Optimizer>(
    comm: &Communicator,
    srv: &mut ShardServer<O>,
    layout: &[Range<usize>],
) -> Result<PsOutcome> {
    let n = layout.len();
    let whole = |comm: &Communicator, part: &[f32]| -> Result<Vec<f32>> {
        let l = layout[0].len();
        let mut mine = part.to_vec();
        mine.resize(l, 0.0);
        let mut all = vec![0.0f32; l * n];
        comm.all_gather(&mine, &mut all)?;
        Ok(layout
            .iter()
            .enumerate()
            .flat_map(|(j, r)| all[j * l..j * l + r.len()].to_vec())
            .collect())
    };
    let params = whole(comm, srv.params())?;
    let clocks: Vec<i64> = srv.clocks().clocks().iter().map(|&c| c as i64).collect();
    let mut every = vec![0i64; n * n];
    comm.all_gather(&clocks, &mut every)?;
    if every.chunks_exact(n).any(|c| c != clocks.as_slice()) {
        return Err(Error::invalid(format!(
            "the parameter servers ended with different worker clocks: {every:?}"
        )));
    }
    let hist = srv.histogram().clone();
    let mut updates = [srv.updates() as i64];
    comm.all_reduce(&mut updates, ReduceOp::Sum)?;
    let (_, opt) = srv.parts_mut();
    let mut bufs = Vec::new();
    for (kind, b) in opt.state() {
        bufs.push((kind.to_string(), whole(comm, &b[0])?));
    }
    let mut counters = Vec::new();
    for (kind, c) in opt.counters() {
        let mut all = vec![0i64; n];
        comm.all_gather(&[*c as i64], &mut all)?;
        counters.push((kind.to_string(), all.iter().map(|&v| v as u64).collect()));
    }
    let mut len = [hist.counts.len() as i64];
    comm.all_reduce(&mut len, ReduceOp::Max)?;
    let mut counts: Vec<i64> = hist.counts.iter().map(|&c| c as i64).collect();
    counts.resize(len[0] as usize, 0);
    comm.all_reduce(&mut counts, ReduceOp::Sum)?;
    Ok(PsOutcome {
        state: PsState {
            params,
            opt: bufs,
            counters,
            clocks: clocks.iter().map(|&c| c as u64).collect(),
        },
        histogram: Histogram {
            counts: counts.iter().map(|&c| c as u64).collect(),
        },
        updates: updates[0] as u64,
    })
}
