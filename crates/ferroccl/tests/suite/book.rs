//! The book (docs/book) and the README stay true to the code they show:
//!
//! - every page is in `SUMMARY.md` and every entry there is a page;
//! - every relative link and image of a page names a file that exists;
//! - every `{{#include path:anchor}}` names a file that exists and, with an anchor, a
//!   region `ANCHOR: anchor` … `ANCHOR_END: anchor` in it; every anchor in an example is
//!   shown by some page (no region left to rot);
//! - Rust code appears only through includes of compiled examples (a ```rust,ignore
//!   fence holds one include and nothing else), so no page shows code that does not
//!   build;
//! - the README's Rust lines are the quickstart example's, verbatim, and its links
//!   into the book resolve.
//!
//! The same rules mdbook applies when it builds the book (`mdbook build docs/book`), so a
//! broken include fails here, in `cargo test`, without mdbook installed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn src() -> PathBuf {
    root().join("docs/book/src")
}

/// Every page under docs/book/src, relative to it.
fn pages() -> Vec<String> {
    fn walk(dir: &Path, base: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).expect("the book's folder") {
            let p = e.expect("an entry").path();
            if p.is_dir() {
                walk(&p, base, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                let rel = p.strip_prefix(base).expect("under src");
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let mut out = Vec::new();
    walk(&src(), &src(), &mut out);
    out.sort();
    out
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The `(target)` of every `[text](target)` and `![alt](target)` outside code fences
/// and inline code, without a `#fragment`; web links left out.
fn relative_links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans, where `](` is code, not a link.
        let plain: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split('#').next().unwrap_or("");
            if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
                out.push(target.to_string());
            }
            rest = &rest[end..];
        }
    }
    out
}

/// Every `{{#include path[:anchor]}}` of a page: (path, anchor).
fn includes(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("{{#include ") {
        rest = &rest[i + "{{#include ".len()..];
        let end = rest.find("}}").expect("an include closes with }}");
        let spec = rest[..end].trim();
        let (path, anchor) = match spec.rsplit_once(':') {
            Some((p, a)) if !a.chars().all(|c| c.is_ascii_digit()) => {
                (p.to_string(), Some(a.to_string()))
            }
            _ => (spec.to_string(), None),
        };
        out.push((path, anchor));
        rest = &rest[end..];
    }
    out
}

/// Whether `file` has the region `anchor`, and how many lines it holds.
fn region_lines(file: &str, anchor: &str) -> Option<usize> {
    let begin = format!("ANCHOR: {anchor}");
    let end = format!("ANCHOR_END: {anchor}");
    let mut lines = file.lines().skip_while(|l| !l.trim_end().ends_with(&begin));
    lines.next()?;
    lines.position(|l| l.trim_end().ends_with(&end))
}

#[test]
fn the_summary_lists_every_page_and_only_pages() {
    let summary = read(&src().join("SUMMARY.md"));
    let listed: BTreeSet<String> = relative_links(&summary).into_iter().collect();
    let all: BTreeSet<String> = pages().into_iter().filter(|p| p != "SUMMARY.md").collect();
    let missing: Vec<_> = all.difference(&listed).collect();
    let dangling: Vec<_> = listed.difference(&all).collect();
    assert!(missing.is_empty(), "pages not in SUMMARY.md: {missing:?}");
    assert!(
        dangling.is_empty(),
        "SUMMARY.md names no such page: {dangling:?}"
    );
    assert!(all.len() >= 15, "the book lost pages: {all:?}");
}

#[test]
fn every_link_image_and_include_of_the_book_resolves() {
    let mut bad = Vec::new();
    let mut shown = BTreeSet::new();
    for page in pages() {
        let path = src().join(&page);
        let dir = path.parent().expect("a folder").to_path_buf();
        let text = read(&path);
        for link in relative_links(&text) {
            if !dir.join(&link).exists() {
                bad.push(format!("{page}: link to {link}: no such file"));
            }
        }
        for (inc, anchor) in includes(&text) {
            let file = dir.join(&inc);
            let Ok(body) = std::fs::read_to_string(&file) else {
                bad.push(format!("{page}: includes {inc}: no such file"));
                continue;
            };
            if let Some(a) = anchor {
                match region_lines(&body, &a) {
                    Some(n) if n > 0 => {
                        let canon = file.canonicalize().expect("it exists");
                        shown.insert((canon, a));
                    }
                    _ => bad.push(format!("{page}: {inc} has no region {a}")),
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    // Every example region is shown somewhere.
    for dir in [
        "crates/ferroccl/examples",
        "crates/ferroccl-candle/examples",
    ] {
        for e in std::fs::read_dir(root().join(dir)).expect("examples") {
            let p = e.expect("an entry").path();
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            for line in read(&p).lines() {
                if let Some((_, a)) = line.split_once("// ANCHOR: ") {
                    let canon = p.canonicalize().expect("it exists");
                    assert!(
                        shown.contains(&(canon, a.trim().to_string())),
                        "{}: region {a} is shown by no page of the book",
                        p.display()
                    );
                }
            }
        }
    }
}

#[test]
fn rust_in_the_book_is_only_included_from_compiled_examples() {
    for page in pages() {
        let text = read(&src().join(&page));
        let mut lines = text.lines().enumerate();
        while let Some((i, l)) = lines.next() {
            if !l.trim_start().starts_with("```rust") {
                continue;
            }
            // mdbook would wrap other Rust in a `fn main` and `mdbook test` compile it
            // alone; the examples are compiled (and run) by cargo test instead.
            assert_eq!(
                l.trim(),
                "```rust,ignore",
                "{page}:{}: an included example's block is rust,ignore",
                i + 1
            );
            let body: Vec<&str> = lines
                .by_ref()
                .map(|(_, l)| l)
                .take_while(|l| l.trim_start() != "```")
                .collect();
            assert!(
                body.len() == 1 && body[0].starts_with("{{#include ../"),
                "{page}:{}: a rust block holds code instead of an include of an example: {body:?}",
                i + 1
            );
        }
    }
}

#[test]
fn the_readme_shows_the_quickstart_and_links_into_the_book() {
    let readme = read(&root().join("README.md"));
    let quickstart = read(&root().join("crates/ferroccl/examples/quickstart.rs"));
    let region: String = {
        let (_, rest) = quickstart
            .split_once("// ANCHOR: quickstart\n")
            .expect("the quickstart region");
        rest.split_once("// ANCHOR_END: quickstart")
            .expect("its end")
            .0
            .to_string()
    };
    let block = readme
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .map(|(b, _)| b)
        .expect("a rust block in the README");
    assert_eq!(
        block, region,
        "the README's Rust differs from examples/quickstart.rs"
    );
    let links = relative_links(&readme);
    assert!(
        links.iter().any(|l| l.starts_with("docs/book/src/")),
        "the README links no book page"
    );
    for link in links {
        assert!(
            root().join(&link).exists(),
            "README: link to {link}: no such file"
        );
    }
}

#[test]
fn the_checkers_catch_what_they_are_for() {
    // A link inside code is not a link; a web link is not checked; a fragment is cut.
    assert_eq!(
        relative_links("see [a](a.md#x) `[b](b.md)` [c](https://x/y.md)\n```\n[d](d.md)\n```"),
        vec!["a.md"]
    );
    assert_eq!(
        includes("{{#include ../x.rs:book}} {{#include y.txt}} {{#include z.rs:10}}"),
        vec![
            ("../x.rs".to_string(), Some("book".to_string())),
            ("y.txt".to_string(), None),
            ("z.rs:10".to_string(), None),
        ]
    );
    let file = "a\n// ANCHOR: r\nb\nc\n// ANCHOR_END: r\n// ANCHOR: open\nd\n";
    assert_eq!(region_lines(file, "r"), Some(2));
    assert_eq!(region_lines(file, "open"), None);
    assert_eq!(region_lines(file, "none"), None);
}
