//! Pipeline schedules as data: which micro-batch each stage runs forward or backward,
//! in what order. A plan is a pure function of the schedule, the stage count p and the
//! micro-batch count m (like `ferroccl::algo`'s plans): the executor in
//! [`super::Pipeline`] runs it action by action, and the functions here check and time
//! it without a network.
//!
//! * **GPipe**: every stage runs all m forwards, then all m backwards (in micro-batch
//!   order). A stage holds the activations of all m micro-batches at the turn.
//! * **1F1B** (PipeDream-flush): stage s runs min(p − 1 − s, m) forwards to fill the
//!   pipeline, then alternates one forward and one backward, then drains the remaining
//!   backwards. It holds at most p − s micro-batches' activations.
//!
//! Both have the same bubble, (p − 1)/(m + p − 1) of the step when every stage takes
//! the same time per micro-batch: [`simulate`] plays a plan in virtual time and
//! returns it.

use crate::error::{Error, Result};

/// Which schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Schedule {
    /// All forwards, then all backwards.
    #[default]
    GPipe,
    /// One forward, one backward in the steady state.
    OneFOneB,
}

impl Schedule {
    /// Parses `gpipe` or `1f1b`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            _ => Err(Error::invalid(format!(
                "unknown pipeline schedule {s:?}: expected gpipe or 1f1b"
            ))),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

/// One unit of a stage's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of micro-batch k (receive its input from the previous stage, compute,
    /// send the output to the next).
    Forward(usize),
    /// Backward of micro-batch k (receive the gradient at its output from the next
    /// stage, or compute the loss on the last, backpropagate, send the gradient at its
    /// input to the previous stage).
    Backward(usize),
}

/// Every stage's actions in order: `plan[s]` is stage s's list, 2m long.
pub type Plan = Vec<Vec<Action>>;

fn check(stages: usize, micro_batches: usize) -> Result<()> {
    if stages == 0 || micro_batches == 0 {
        return Err(Error::invalid(format!(
            "a pipeline needs at least one stage and one micro-batch (got {stages} stages, \
             {micro_batches} micro-batches)"
        )));
    }
    Ok(())
}

/// The plan of `schedule` for `stages` stages and `micro_batches` micro-batches.
pub fn plan(schedule: Schedule, stages: usize, micro_batches: usize) -> Result<Plan> {
    check(stages, micro_batches)?;
    let m = micro_batches;
    Ok((0..stages)
        .map(|s| match schedule {
            Schedule::GPipe => (0..m)
                .map(Action::Forward)
                .chain((0..m).map(Action::Backward))
                .collect(),
            Schedule::OneFOneB => {
                let warmup = (stages - 1 - s).min(m);
                let mut a: Vec<Action> = (0..warmup).map(Action::Forward).collect();
                for i in 0..m - warmup {
                    a.push(Action::Forward(warmup + i));
                    a.push(Action::Backward(i));
                }
                a.extend((m - warmup..m).map(Action::Backward));
                a
            }
        })
        .collect())
}

/// The micro-batches of `actions`' forwards (`forward`) or backwards, in order: the
/// order of the messages a stage receives in that direction.
pub fn order(actions: &[Action], forward: bool) -> Vec<usize> {
    actions
        .iter()
        .filter_map(|a| match (a, forward) {
            (Action::Forward(k), true) | (Action::Backward(k), false) => Some(*k),
            _ => None,
        })
        .collect()
}

/// The most micro-batches whose activations a stage holds at once under `actions`
/// (a forward adds one, its backward frees it).
pub fn peak_live(actions: &[Action]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for a in actions {
        match a {
            Action::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Action::Backward(_) => live = live.saturating_sub(1),
        }
    }
    peak
}

/// A plan played in virtual time.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per stage, each action with its start and end time, in the stage's order.
    pub stages: Vec<Vec<(Action, f64, f64)>>,
    /// When the last action ends.
    pub makespan: f64,
}

impl Timeline {
    /// Idle time over all stages divided by stages × makespan.
    pub fn bubble_fraction(&self) -> f64 {
        let p = self.stages.len() as f64;
        let busy: f64 = self.stages.iter().flatten().map(|(_, s, e)| e - s).sum();
        if self.makespan <= 0.0 {
            return 0.0;
        }
        1.0 - busy / (p * self.makespan)
    }

    /// Each stage's action at each unit slot (for forward and backward times of 1):
    /// `grid[t][s]`, `None` where the stage idles.
    pub fn slots(&self) -> Vec<Vec<Option<Action>>> {
        let n = self.makespan.ceil() as usize;
        let mut grid = vec![vec![None; self.stages.len()]; n];
        for (s, acts) in self.stages.iter().enumerate() {
            for &(a, start, end) in acts {
                for row in grid
                    .iter_mut()
                    .take(end.ceil() as usize)
                    .skip(start as usize)
                {
                    row[s] = Some(a);
                }
            }
        }
        grid
    }
}

/// The textbook bubble fraction, (p − 1)/(m + p − 1).
pub fn textbook_bubble(stages: usize, micro_batches: usize) -> f64 {
    (stages as f64 - 1.0) / (micro_batches + stages - 1) as f64
}

/// Checks that `plan` is a schedule of `micro_batches` micro-batches: every stage runs
/// each micro-batch's forward exactly once, and its backward exactly once after it.
pub fn validate(plan: &Plan, micro_batches: usize) -> Result<()> {
    for (s, acts) in plan.iter().enumerate() {
        let mut fwd = vec![false; micro_batches];
        let mut bwd = vec![false; micro_batches];
        for a in acts {
            let bad = |why: &str| {
                Err(Error::invalid(format!(
                    "pipeline plan: stage {s}: {a:?} {why}"
                )))
            };
            match *a {
                Action::Forward(k) if k >= micro_batches || fwd[k] => {
                    return bad("is out of range or repeated")
                }
                Action::Forward(k) => fwd[k] = true,
                Action::Backward(k) if k >= micro_batches || bwd[k] => {
                    return bad("is out of range or repeated")
                }
                Action::Backward(k) if !fwd[k] => return bad("comes before its forward"),
                Action::Backward(k) => bwd[k] = true,
            }
        }
        if !fwd.iter().chain(&bwd).all(|&d| d) {
            return Err(Error::invalid(format!(
                "pipeline plan: stage {s} leaves a micro-batch out"
            )));
        }
    }
    Ok(())
}

/// Plays `plan` in virtual time: each stage runs its actions in order, each as soon as
/// the stage is free and its input is there (a forward on stage s > 0 after the same
/// micro-batch's forward on s − 1; a backward on s < p − 1 after the same micro-batch's
/// backward on s + 1; messages take no time). `forward[s]` and `backward[s]` are stage
/// s's times per micro-batch. A plan whose stages would wait for each other forever is
/// an error (it would deadlock when executed).
pub fn simulate(plan: &Plan, forward: &[f64], backward: &[f64]) -> Result<Timeline> {
    let p = plan.len();
    if forward.len() != p || backward.len() != p {
        return Err(Error::invalid(format!(
            "simulate: {p} stages but {} forward and {} backward times",
            forward.len(),
            backward.len()
        )));
    }
    let m = plan
        .iter()
        .flatten()
        .map(|a| match a {
            Action::Forward(k) | Action::Backward(k) => k + 1,
        })
        .max()
        .unwrap_or(0);
    // End times of each (stage, micro-batch)'s forward and backward.
    let mut fdone = vec![vec![None::<f64>; m]; p];
    let mut bdone = vec![vec![None::<f64>; m]; p];
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut out: Vec<Vec<(Action, f64, f64)>> = vec![Vec::new(); p];
    loop {
        let mut progressed = false;
        for s in 0..p {
            while let Some(&a) = plan[s].get(next[s]) {
                let ready = match a {
                    Action::Forward(_) if s == 0 => Some(0.0),
                    Action::Forward(k) => fdone[s - 1][k],
                    Action::Backward(k) if s + 1 == p => fdone[s][k],
                    Action::Backward(k) => bdone[s + 1][k],
                };
                let Some(ready) = ready else { break };
                let start = free[s].max(ready);
                let end = start
                    + match a {
                        Action::Forward(_) => forward[s],
                        Action::Backward(_) => backward[s],
                    };
                match a {
                    Action::Forward(k) => fdone[s][k] = Some(end),
                    Action::Backward(k) => bdone[s][k] = Some(end),
                }
                free[s] = end;
                out[s].push((a, start, end));
                next[s] += 1;
                progressed = true;
            }
        }
        if (0..p).all(|s| next[s] == plan[s].len()) {
            break;
        }
        if !progressed {
            let stuck: Vec<String> = (0..p)
                .filter_map(|s| plan[s].get(next[s]).map(|a| format!("stage {s} at {a:?}")))
                .collect();
            return Err(Error::invalid(format!(
                "pipeline plan deadlocks: {}",
                stuck.join(", ")
            )));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    Ok(Timeline {
        stages: out,
        makespan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::mpsc;
    use std::time::Duration;

    const BOTH: [Schedule; 2] = [Schedule::GPipe, Schedule::OneFOneB];

    #[test]
    fn one_f_one_b_for_four_stages_is_the_textbook_picture() {
        use Action::{Backward as B, Forward as F};
        let p = plan(Schedule::OneFOneB, 4, 4).unwrap();
        assert_eq!(p[0], vec![F(0), F(1), F(2), F(3), B(0), B(1), B(2), B(3)]);
        assert_eq!(p[2], vec![F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]);
        assert_eq!(p[3], vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]);
        // Slot picture with unit times: stage 3 starts at slot 3.
        let t = simulate(&p, &[1.0; 4], &[1.0; 4]).unwrap();
        assert_eq!(t.slots()[3][3], Some(F(0)));
        assert_eq!(t.slots()[3][0], Some(F(3)));
        assert_eq!(t.slots()[0][3], None, "stage 3 idles at slot 0");
    }

    #[test]
    fn zero_stages_or_micro_batches_are_refused() {
        assert!(matches!(
            plan(Schedule::GPipe, 0, 4),
            Err(Error::Comm(ferroccl::Error::InvalidArgument(_)))
        ));
        assert!(matches!(
            plan(Schedule::OneFOneB, 2, 0),
            Err(Error::Comm(ferroccl::Error::InvalidArgument(_)))
        ));
        assert!(Schedule::parse("zigzag").is_err());
        assert_eq!(Schedule::parse("1F1B").unwrap(), Schedule::OneFOneB);
    }

    #[test]
    fn a_backward_before_its_forward_is_caught_and_a_cycle_deadlocks() {
        use Action::{Backward as B, Forward as F};
        assert!(validate(&vec![vec![B(0), F(0)]], 1).is_err());
        assert!(validate(&vec![vec![F(0)]], 1).is_err());
        // Stage 0 wants micro-batch 0's backward before it sends micro-batch 1's
        // forward; stage 1 wants micro-batch 1 first: neither moves.
        let bad = vec![vec![F(0), B(0), F(1), B(1)], vec![F(1), F(0), B(0), B(1)]];
        assert!(simulate(&bad, &[1.0; 2], &[1.0; 2]).is_err());
    }

    /// Runs a plan on one thread per stage with channels between neighbours (sends
    /// never block, as the pipeline's sends do not); true when every stage finished
    /// within the deadline, false when one waited for a message that never came.
    fn runs_on_threads(plan: &Plan) -> bool {
        let p = plan.len();
        let (mut fwd_tx, mut fwd_rx) = (Vec::new(), Vec::new());
        let (mut bwd_tx, mut bwd_rx) = (Vec::new(), Vec::new());
        for _ in 0..p {
            let (t, r) = mpsc::channel::<usize>();
            fwd_tx.push(Some(t));
            fwd_rx.push(Some(r));
            let (t, r) = mpsc::channel::<usize>();
            bwd_tx.push(Some(t));
            bwd_rx.push(Some(r));
        }
        let handles: Vec<_> = (0..p)
            .map(|s| {
                let acts = plan[s].clone();
                // Stage s receives forwards on fwd[s] and backwards on bwd[s]; sends to
                // fwd[s + 1] and bwd[s − 1].
                let my_f = fwd_rx[s].take().expect("once");
                let my_b = bwd_rx[s].take().expect("once");
                let to_next = (s + 1 < p).then(|| fwd_tx[s + 1].clone().expect("sender"));
                let to_prev = (s > 0).then(|| bwd_tx[s - 1].clone().expect("sender"));
                std::thread::spawn(move || {
                    let wait = Duration::from_secs(10);
                    for a in acts {
                        match a {
                            Action::Forward(k) => {
                                if s > 0 && my_f.recv_timeout(wait) != Ok(k) {
                                    return false;
                                }
                                if let Some(t) = &to_next {
                                    let _ = t.send(k);
                                }
                            }
                            Action::Backward(k) => {
                                if s + 1 < p && my_b.recv_timeout(wait) != Ok(k) {
                                    return false;
                                }
                                if let Some(t) = &to_prev {
                                    let _ = t.send(k);
                                }
                            }
                        }
                    }
                    true
                })
            })
            .collect();
        drop((fwd_tx, bwd_tx));
        handles.into_iter().all(|h| h.join().unwrap_or(false))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_plan_is_a_schedule_runs_on_threads_and_meets_the_textbook(
            p in 1usize..=8, m in 1usize..=32
        ) {
            for schedule in BOTH {
                let pl = plan(schedule, p, m).unwrap();
                prop_assert_eq!(pl.len(), p);
                validate(&pl, m).unwrap();
                prop_assert!(runs_on_threads(&pl), "{:?} p={} m={} deadlocked", schedule, p, m);
                let t = simulate(&pl, &vec![1.0; p], &vec![2.0; p]).unwrap();
                let want = textbook_bubble(p, m);
                prop_assert!((t.bubble_fraction() - want).abs() < 1e-9,
                    "{:?} p={} m={}: bubble {} vs {}", schedule, p, m, t.bubble_fraction(), want);
                for (s, acts) in pl.iter().enumerate() {
                    let peak = peak_live(acts);
                    match schedule {
                        Schedule::GPipe => prop_assert_eq!(peak, m),
                        Schedule::OneFOneB => {
                            prop_assert!(peak <= p, "stage {} holds {} > p", s, peak);
                            prop_assert_eq!(peak, (p - s).min(m));
                        }
                    }
                }
            }
        }
    }
}
