//! Tests of the launcher: messages, exit codes, environment.

use super::*;

#[test]
fn messages_and_exit_codes() {
    let e = LaunchError::RankFailed {
        rank: 1,
        status: RankExit::Code(3),
        stopped: vec![0, 2, 3],
    };
    assert_eq!(
        e.to_string(),
        "rank 1 failed (exit status 3); stopped ranks 0, 2, 3"
    );
    assert_eq!(e.exit_code(), 3);
    let e = LaunchError::RankFailed {
        rank: 0,
        status: RankExit::Signal(libc::SIGKILL),
        stopped: vec![1],
    };
    assert_eq!(
        e.to_string(),
        "rank 0 failed (killed by signal 9 SIGKILL); stopped rank 1"
    );
    assert_eq!(e.exit_code(), 137);
    let e = LaunchError::RankFailed {
        rank: 2,
        status: RankExit::Signal(64),
        stopped: vec![],
    };
    assert_eq!(e.to_string(), "rank 2 failed (killed by signal 64)");
    let e = LaunchError::Interrupted {
        signal: libc::SIGINT,
        stopped: vec![0, 1],
    };
    assert_eq!(
        e.to_string(),
        "interrupted by signal 2 SIGINT; stopped ranks 0, 1"
    );
    assert_eq!(e.exit_code(), 130);
    assert_eq!(LaunchError::NoRanks(0).exit_code(), 2);
}
