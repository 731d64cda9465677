//! ferroccl-candle's test suite: the data-parallel trainer on real ranks.

mod ddp;
mod pipeline;
mod ps;
mod tensor_parallel;
mod tensor_parallel_checks;
mod trainer;

use ferroccl::ddp::TrainError;
use ferroccl::testing::{Net, RunError};
use ferroccl::{Communicator, Config};
use ferroccl_candle::{Error, Result};
use std::time::Duration;

/// `ferroccl::testing::run` for a body that returns this crate's error, as the crate's
/// functions do: every rank's result in rank order, or the first failure (as
/// ferroccl's error, from which the harness tells a root cause from its echoes), under
/// `deadline`.
fn run<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> std::result::Result<Vec<R>, RunError>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    ferroccl::testing::run(n, net, base, deadline, move |c| {
        body(c).map_err(ferroccl::Error::from)
    })
}

/// `ferroccl::testing::run_all` with every rank's outcome typed as this crate's error.
fn run_all<R, F>(
    n: usize,
    net: Net,
    base: &Config,
    deadline: Duration,
    body: F,
) -> Vec<Option<Result<R>>>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    ferroccl::testing::run_all(n, net, base, deadline, move |c| Ok(body(c)))
        .into_iter()
        .map(|o| o.map(|r| r.map_err(Error::from).and_then(|r| r)))
        .collect()
}

/// Rank 0's [`TrainError::Checkpoint`] as (path, why), once rank 1's error has been
/// checked to name rank 0's failure to load it.
#[track_caller]
fn refused_on_rank0(errs: &[Error]) -> (&std::path::Path, &str) {
    assert!(
        errs[1]
            .to_string()
            .contains("rank 0 failed to load the checkpoint"),
        "{}",
        errs[1]
    );
    match &errs[0] {
        Error::Train(TrainError::Checkpoint { path, why }) => (path, why),
        e => panic!("rank 0: {e}"),
    }
}

/// The lines of `example` (a path in this package) between `ANCHOR: anchor` and
/// `ANCHOR_END: anchor`, as the book shows them, after checking that the book's `page`
/// (under docs/book/src) includes exactly that region with `{{#include ...}}`.
#[track_caller]
fn book_shows(page: &str, example: &str, anchor: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let book = root.join("../../docs/book/src");
    let text = std::fs::read_to_string(book.join(page)).expect("the book's page");
    // The include path is relative to the page's folder.
    let depth = page.matches('/').count() + 3;
    let include = format!(
        "{{{{#include {}crates/ferroccl-candle/{example}:{anchor}}}}}",
        "../".repeat(depth)
    );
    assert!(
        text.contains(&include),
        "{page} lacks {include}: it no longer shows {example}"
    );
    let src = std::fs::read_to_string(root.join(example)).expect("the example");
    let (_, rest) = src
        .split_once(&format!("// ANCHOR: {anchor}\n"))
        .expect("the begin anchor");
    let (region, _) = rest
        .split_once(&format!("// ANCHOR_END: {anchor}"))
        .expect("the end anchor");
    assert!(region.lines().count() > 10, "{example}: a short region");
    region.to_string()
}

/// Largest |a − b| over the largest |b|, per tensor; the worst tensor (weights by
/// name, in the same order).
#[track_caller]
fn rel_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            assert_eq!(va.len(), vb.len(), "{na}");
            let d = va
                .iter()
                .zip(vb)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            let s = vb.iter().map(|y| y.abs()).fold(0.0, f32::max);
            d / s.max(1e-6)
        })
        .fold(0.0, f32::max)
}
