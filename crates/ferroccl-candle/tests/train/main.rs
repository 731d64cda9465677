//! ferroccl-candle's test suite: the data-parallel trainer on real ranks.

mod ddp;
mod pipeline;
mod trainer;

/// Rank 0's [`ferroccl::Error::Checkpoint`] as (path, why), once rank 1's error has been
/// checked to name rank 0's failure to load it.
#[track_caller]
fn refused_on_rank0(errs: &[ferroccl::Error]) -> (&std::path::Path, &str) {
    assert!(
        errs[1]
            .to_string()
            .contains("rank 0 failed to load the checkpoint"),
        "{}",
        errs[1]
    );
    match &errs[0] {
        ferroccl::Error::Checkpoint { path, why } => (path, why),
        e => panic!("rank 0: {e}"),
    }
}
