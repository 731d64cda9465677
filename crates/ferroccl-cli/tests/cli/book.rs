//! The book's "The command line" pages (docs/book/src/cli/<command>.md) show every
//! subcommand's `--help` from docs/book/src/cli/<command>.txt: each file must be what the
//! binary prints now. After a deliberate change to a flag or its text,
//! `FERROCCL_BLESS=1 cargo test -p ferroccl-cli --test cli book::` rewrites them.

use std::path::Path;
use std::time::Duration;

use crate::common::proc::ferroccl;

#[test]
fn every_subcommands_help_is_the_books() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/book/src/cli");
    let mut commands = vec![
        "bench",
        "launch",
        "plan",
        "plot",
        "simulate",
        "trace",
        "gpu-check",
    ];
    if cfg!(feature = "candle") {
        commands.push("train");
    }
    let bless = std::env::var_os("FERROCCL_BLESS").is_some();
    let mut stale = Vec::new();
    for c in commands {
        let out = ferroccl(&[c, "--help"], Duration::from_secs(30));
        assert!(out.status.success(), "{c} --help failed");
        let help = out.stdout;
        let file = dir.join(format!("{c}.txt"));
        let page = std::fs::read_to_string(dir.join(format!("{c}.md")))
            .unwrap_or_else(|e| panic!("the book has no page for {c}: {e}"));
        assert!(
            page.contains(&format!("{{{{#include {c}.txt}}}}")),
            "cli/{c}.md does not show {c}'s help"
        );
        if bless {
            std::fs::write(&file, &help).expect("write the help");
        } else if std::fs::read_to_string(&file).ok().as_deref() != Some(help.as_str()) {
            stale.push(c);
        }
    }
    assert!(
        stale.is_empty(),
        "the book's help of {stale:?} is not what the binary prints: \
         FERROCCL_BLESS=1 cargo test -p ferroccl-cli --test cli book:: rewrites it"
    );
}
