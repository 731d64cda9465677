//! The layer rules of the book's Internals chapter (docs/book/src/internals.md), checked
//! on the source: every module of the library a file names — `crate::X`, a grouped
//! `crate::{X, Y::..}`, a `super::` path that climbs to the crate root (`super::X` in
//! `src/wire.rs`, `super::super::X` in `src/engine/pull.rs`, inline `mod`s counted), and
//! items of the crate root that
//! re-export a module's (`crate::Result` is `error`'s) — must be a layer it may use.
//! Comments, strings and character literals are skipped. A new import that breaks a
//! rule fails here, naming the file, the line and the rule. The same holds for the
//! `ferroccl-candle` package's floors, whose root may only declare modules and
//! re-export (`candle_*` below).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Which top-level modules each top-level module may name, besides itself. Mirrors the
/// table in docs/book/src/internals.md.
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    let mut m: BTreeMap<&'static str, &'static [&'static str]> = BTreeMap::new();
    // The element types and operators sit at the very bottom: the error enum names
    // them (UnsupportedOp), and `reduce` gives them meaning.
    m.insert("dtype", &[]);
    m.insert("error", &["dtype"]);
    m.insert("sync", &[]);
    m.insert("sys", &["error"]);
    m.insert("reduce", &["error", "dtype"]);
    m.insert("algo", &[]);
    m.insert("trace", &["error", "sync"]);
    m.insert("rendezvous", &["error", "sync", "sys"]);
    m.insert("config", &["error", "rendezvous", "algo"]);
    m.insert("order", &["error", "sync"]);
    m.insert("cuda", &["error", "sync", "reduce", "dtype", "order"]);
    m.insert(
        "transport",
        &[
            "error",
            "sync",
            "sys",
            "config",
            "reduce",
            "dtype",
            "rendezvous",
            "cuda",
        ],
    );
    m.insert("wire", &["error", "algo", "reduce", "dtype", "transport"]);
    m.insert(
        "engine",
        &[
            "error",
            "sync",
            "sys",
            "config",
            "reduce",
            "dtype",
            "algo",
            "transport",
            "wire",
            "trace",
        ],
    );
    m.insert(
        "comm",
        &[
            "error",
            "sync",
            "sys",
            "config",
            "reduce",
            "dtype",
            "algo",
            "transport",
            "wire",
            "engine",
            "rendezvous",
            "cuda",
            "order",
            "trace",
        ],
    );
    m.insert("ddp", &["error", "sync", "reduce", "dtype", "comm"]);
    m
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file (`src/engine/pull.rs` → `["engine", "pull"]`,
/// `src/engine/mod.rs` → `["engine"]`, `src/lib.rs` → `[]`).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !["mod", "lib", "main"].contains(&stem) {
        parts.push(stem.to_string());
    }
    parts
}

/// A token of Rust source, enough to follow paths: identifiers, `::`, braces, commas,
/// `;` and anything else as one character. Comments, strings and character literals
/// are dropped; each token keeps its line number.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Open,
    Close,
    Comma,
    Other(char),
}

fn tokens(text: &str) -> Vec<(Tok, usize)> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(b[i] == '\n');
                    i += 1;
                }
            }
        } else if c == '"' || (c == 'b' && next == Some('"')) {
            i += if c == 'b' { 2 } else { 1 };
            while i < b.len() && b[i] != '"' {
                line += usize::from(b[i] == '\n');
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if (c == 'r' || c == 'b') && matches!(next, Some('#') | Some('"') | Some('r')) && {
            // A raw string: r"..", r#".."#, br#".."#.
            let mut j = i + 1;
            if c == 'b' && b.get(j) == Some(&'r') {
                j += 1;
            }
            while b.get(j) == Some(&'#') {
                j += 1;
            }
            b.get(j) == Some(&'"') && (c == 'r' || b.get(i + 1) == Some(&'r'))
        } {
            let mut j = i + 1 + usize::from(c == 'b');
            let mut hashes = 0;
            while b[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                if b[j] == '"' && (1..=hashes).all(|k| b.get(j + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                line += usize::from(b[j] == '\n');
                j += 1;
            }
            i = j;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a): a literal closes
            // within a few characters.
            let close = (i + 2..(i + 12).min(b.len())).find(|&j| b[j] == '\'');
            let is_char = next == Some('\\') || close == Some(i + 2);
            if is_char {
                let mut j = i + 1;
                while j < b.len() && b[j] != '\'' {
                    j += if b[j] == '\\' { 2 } else { 1 };
                }
                i = j + 1;
            } else {
                out.push((Tok::Other('\''), line));
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(b[s..i].iter().collect()), line));
        } else if c == ':' && next == Some(':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((
                match c {
                    '{' => Tok::Open,
                    '}' => Tok::Close,
                    ',' => Tok::Comma,
                    _ => Tok::Other(c),
                },
                line,
            ));
            i += 1;
        }
    }
    out
}

/// Every top-level module `text` (the source of module `module`) names, with its
/// line: the first segment after the crate root, however the path reaches it.
/// Items of the root itself (`crate::Result`) are mapped through `root_items`.
fn named_layers(
    text: &str,
    module: &[String],
    root_items: &BTreeMap<String, String>,
) -> Vec<(String, usize)> {
    let toks = tokens(text);
    let mut out = Vec::new();
    // Inline modules open here: (name, brace depth inside them).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut pending_mod: Option<String> = None;
    let mut i = 0;
    let ident = |k: usize| match toks.get(k) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let path_at = |k: usize| matches!(toks.get(k), Some((Tok::Path, _)));
    while i < toks.len() {
        match &toks[i].0 {
            Tok::Open => {
                depth += 1;
                if let Some(name) = pending_mod.take() {
                    inline.push((name, depth));
                }
            }
            Tok::Close => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Tok::Ident(s) if s == "mod" => {
                // `mod name {` opens an inline module; `mod name;` does not.
                if let Some(name) = ident(i + 1) {
                    if matches!(toks.get(i + 2), Some((Tok::Open, _))) {
                        pending_mod = Some(name.to_string());
                    }
                }
            }
            Tok::Ident(s) if (s == "crate" || s == "super") && path_at(i + 1) => {
                // A path from the root, or climbing from here. Skip one preceded by
                // `::` (a segment of another path, e.g. `$crate`-less macros).
                let after_path = i > 0 && matches!(toks[i - 1].0, Tok::Path);
                if !after_path {
                    let line = toks[i].1;
                    let mut here: Vec<String> = module
                        .iter()
                        .cloned()
                        .chain(inline.iter().map(|(n, _)| n.clone()))
                        .collect();
                    let mut k = i;
                    let mut at_root = false;
                    if s == "crate" {
                        at_root = true;
                        k += 2;
                    } else {
                        while ident(k) == Some("super") && path_at(k + 1) {
                            here.pop();
                            k += 2;
                        }
                        if here.is_empty() {
                            at_root = true;
                        }
                    }
                    if at_root {
                        let mut names = Vec::new();
                        if let Some(n) = ident(k) {
                            names.push((n.to_string(), line));
                        } else if matches!(toks.get(k), Some((Tok::Open, _))) {
                            // A group: the names at its top level.
                            let mut d = 0;
                            let mut expect_name = true;
                            let mut j = k;
                            while j < toks.len() {
                                match &toks[j].0 {
                                    Tok::Open => d += 1,
                                    Tok::Close => {
                                        d -= 1;
                                        if d == 0 {
                                            break;
                                        }
                                    }
                                    Tok::Comma if d == 1 => expect_name = true,
                                    Tok::Ident(n) if d == 1 && expect_name => {
                                        names.push((n.clone(), toks[j].1));
                                        expect_name = false;
                                    }
                                    _ => {}
                                }
                                j += 1;
                            }
                        }
                        for (n, at) in names {
                            let layer = root_items.get(&n).cloned().unwrap_or(n);
                            if layer != "self" {
                                out.push((layer, at));
                            }
                        }
                    }
                    i = k;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The crate root's re-exported items and the module each comes from, read from
/// `lib.rs`'s `pub use module::{..}` lines (`Result` → `error`).
fn root_items(lib: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let toks = tokens(lib);
    let mut i = 0;
    while i + 2 < toks.len() {
        if toks[i].0 == Tok::Ident("use".into()) {
            if let (Tok::Ident(module), Tok::Path) = (&toks[i + 1].0, &toks[i + 2].0) {
                let mut j = i + 3;
                let mut d = 0;
                let mut last = None;
                while j < toks.len() {
                    match &toks[j].0 {
                        Tok::Open => d += 1,
                        Tok::Close => d -= 1,
                        Tok::Ident(n) => last = Some(n.clone()),
                        Tok::Comma if d >= 1 => {
                            if let Some(n) = last.take() {
                                m.insert(n, module.clone());
                            }
                        }
                        Tok::Other(_) => break, // `;`
                        _ => {}
                    }
                    j += 1;
                }
                if let Some(n) = last {
                    m.insert(n, module.clone());
                }
                i = j;
                continue;
            }
        }
        i += 1;
    }
    m
}

/// Every rule broken in `text` (module `module`, layer `module[0]`), as messages.
fn broken_in(
    text: &str,
    module: &[String],
    rules: &BTreeMap<&str, &[&str]>,
    roots: &BTreeMap<String, String>,
    file: &str,
) -> Vec<String> {
    let layer = module.first().map_or("lib", String::as_str);
    let Some(ok) = rules.get(layer) else {
        return Vec::new();
    };
    named_layers(text, module, roots)
        .into_iter()
        .filter(|(used, _)| used != layer && !ok.contains(&used.as_str()))
        .map(|(used, line)| {
            format!("{file}:{line}: {layer} uses crate::{used} ({layer} may use {ok:?})")
        })
        .collect()
}

/// Every rule of `rules` broken in the package whose sources are `src` (more than
/// `min_files` of them), with its crate root's re-exports `roots`: the modules in
/// `exempt` (the root, test helpers) see everything, any other module without a row
/// fails.
fn broken_in_tree(
    src: &Path,
    min_files: usize,
    rules: &BTreeMap<&str, &[&str]>,
    roots: &BTreeMap<String, String>,
    exempt: &[&str],
) -> Vec<String> {
    let mut files = Vec::new();
    sources(src, &mut files);
    assert!(
        files.len() > min_files,
        "found the sources ({} files)",
        files.len()
    );
    let mut broken = Vec::new();
    for f in &files {
        let module = module_of(src, f);
        let layer = module.first().map_or("lib", String::as_str);
        if !rules.contains_key(layer) {
            assert!(
                exempt.contains(&layer),
                "{}: module {layer} has no row in the layer table",
                f.display()
            );
            continue;
        }
        let text = std::fs::read_to_string(f).expect("read source");
        let name = f.strip_prefix(src).unwrap_or(f).display().to_string();
        broken.extend(broken_in(&text, &module, rules, roots, &name));
    }
    broken
}

#[test]
fn no_module_uses_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rules = allowed();
    let roots = root_items(&std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
    assert_eq!(roots.get("Result").map(String::as_str), Some("error"));
    // lib.rs and testing.rs see everything.
    let broken = broken_in_tree(&src, 30, &rules, &roots, &["lib", "testing"]);
    assert!(
        broken.is_empty(),
        "layer rules broken:\n{}",
        broken.join("\n")
    );
}

/// The rules of `rules` that `text` breaks as the source of `module` (a path such as
/// `engine/pull`, in a file `f.rs`), its crate root re-exporting `roots` (item,
/// module): what the mutation tests ask.
fn found_in(
    text: &str,
    module: &str,
    rules: &BTreeMap<&str, &[&str]>,
    roots: &[(&str, &str)],
) -> Vec<String> {
    let roots: BTreeMap<String, String> = roots
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    let module: Vec<String> = module.split('/').map(String::from).collect();
    broken_in(text, &module, rules, &roots, "f.rs")
}

#[test]
fn the_checker_sees_a_violation() {
    let rules = allowed();
    let roots = [("Result", "error"), ("Communicator", "comm")];
    let found = |text: &str, module: &str| found_in(text, module, &rules, &roots);
    // Paths wherever they are on a line.
    assert_eq!(
        found(
            "use crate::comm::Communicator; let x = crate::engine::Engine::new();",
            "wire"
        )
        .len(),
        2
    );
    // Grouped imports, over several lines and nested; each top-level name counts.
    let grouped =
        "use crate::{\n    error::Result,\n    comm::{Communicator, Scope},\n    trace,\n};";
    let e = found(grouped, "engine");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("f.rs:3: engine uses crate::comm"), "{e:?}");
    // `super::` climbing to the root: one level from a top-level file, two from a
    // file of a folder, one more inside an inline module.
    assert_eq!(found("use super::comm::Communicator;", "wire").len(), 1);
    assert_eq!(found("use super::super::comm::X;", "engine/pull").len(), 1);
    assert!(found("use super::super::comm::X;", "engine/pull/deep").is_empty());
    assert!(found("use super::stream::Data;", "engine/pull").is_empty());
    assert_eq!(
        found(
            "mod tests {\n use super::super::super::comm::X;\n}",
            "engine/pull"
        )
        .len(),
        1
    );
    assert!(found("mod tests {\n use super::super::comm::X;\n}", "engine/pull").is_empty());
    // Items of the root count as the module they come from.
    assert_eq!(
        found("fn f() -> crate::Result<()> { todo!() }", "algo").len(),
        1
    );
    assert!(found("fn f() -> crate::Result<()> { todo!() }", "transport").is_empty());
    assert_eq!(
        found("use crate::{Communicator, Result};", "engine").len(),
        1
    );
    // Comments, strings and char literals are not code.
    assert!(found(
        "// crate::comm\n/* crate::comm */ let s = \"crate::comm\";",
        "wire"
    )
    .is_empty());
    assert!(found("let c = '{'; let s = r#\"crate::comm\"#;", "wire").is_empty());
    // The rules themselves.
    assert!(!rules["engine"].contains(&"comm"));
    assert!(!rules["transport"].contains(&"algo") && !rules["transport"].contains(&"comm"));
    assert!(!rules["cuda"].contains(&"transport"));
    assert!(!rules["algo"].contains(&"engine"));
    assert!(!rules["dtype"].contains(&"error") && !rules["error"].contains(&"reduce"));
}

/// The floors of the `ferroccl-candle` package: which of its top-level modules each
/// may name, besides itself. Mirrors its table in docs/book/src/internals.md.
fn candle_allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    let mut m: BTreeMap<&'static str, &'static [&'static str]> = BTreeMap::new();
    m.insert("error", &[]);
    m.insert("data", &["error"]);
    m.insert("model", &["error"]);
    m.insert("ddp", &["error"]);
    m.insert("tensor_parallel", &["error"]);
    m.insert("zero", &["error", "ddp", "tensor_parallel"]);
    m.insert("pipeline", &["error", "ddp", "zero", "tensor_parallel"]);
    m.insert("ps", &["error", "ddp"]);
    m.insert(
        "trainer",
        &[
            "error",
            "data",
            "model",
            "ddp",
            "tensor_parallel",
            "zero",
            "pipeline",
            "ps",
        ],
    );
    m
}

/// The lines of a crate root's items that are neither a module declaration
/// (`mod x;`, `pub mod x;`) nor a re-export (`pub use ..;`), attributes aside: what a
/// root that is a table of contents does not hold.
fn root_code(lib: &str) -> Vec<usize> {
    let toks = tokens(lib);
    let word = |k: usize, w: &str| matches!(toks.get(k), Some((Tok::Ident(s), _)) if s == w);
    let other = |k: usize, c: char| matches!(toks.get(k), Some((Tok::Other(x), _)) if *x == c);
    let mut bad = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if other(i, '#') {
            // An attribute, `#[..]` or `#![..]`: skipped, brackets balanced.
            i += 1 + usize::from(other(i + 1, '!'));
            let mut d = 0;
            while i < toks.len() {
                d += i32::from(other(i, '[')) - i32::from(other(i, ']'));
                i += 1;
                if d == 0 {
                    break;
                }
            }
            continue;
        }
        let start = i;
        if word(i, "pub") {
            i += 1;
            if other(i, '(') {
                while i < toks.len() && !other(i, ')') {
                    i += 1;
                }
                i += 1;
            }
        }
        let module = word(i, "mod")
            && matches!(toks.get(i + 1), Some((Tok::Ident(_), _)))
            && other(i + 2, ';');
        let reexport = word(i, "use") && word(start, "pub");
        if !(module || reexport) {
            bad.push(toks[start].1);
        }
        // On to the item's end: its `;` outside braces, or its closing brace.
        let mut d = 0;
        while i < toks.len() {
            match toks[i].0 {
                Tok::Open => d += 1,
                Tok::Close => {
                    d -= 1;
                    if d == 0 && !(module || reexport) {
                        break;
                    }
                }
                Tok::Other(';') if d == 0 => break,
                _ => {}
            }
            i += 1;
        }
        i += 1;
    }
    bad
}

#[test]
fn no_candle_module_uses_a_floor_above_it_and_its_root_only_declares_and_reexports() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ferroccl-candle/src");
    let rules = candle_allowed();
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let roots = root_items(&lib);
    assert_eq!(roots.get("Result").map(String::as_str), Some("error"));
    assert_eq!(
        roots.get("TrainConfig").map(String::as_str),
        Some("trainer")
    );
    let broken = broken_in_tree(&src, 20, &rules, &roots, &["lib"]);
    assert!(
        broken.is_empty(),
        "ferroccl-candle's floors broken:\n{}",
        broken.join("\n")
    );
    let code = root_code(&lib);
    assert!(
        code.is_empty(),
        "ferroccl-candle's lib.rs holds more than modules and re-exports, at lines {code:?}"
    );
}

#[test]
fn the_candle_checks_see_a_violation() {
    let rules = candle_allowed();
    let roots = [("Result", "error"), ("TrainConfig", "trainer")];
    let found = |text: &str, module: &str| found_in(text, module, &rules, &roots);
    // Up a floor: the pipeline reaching for the trainer, directly or through the root.
    assert_eq!(
        found("use crate::trainer::config::Trainer;", "pipeline").len(),
        1
    );
    assert_eq!(
        found("fn f(c: &crate::TrainConfig) {}", "pipeline/train").len(),
        1
    );
    assert_eq!(found("use super::super::trainer::X;", "ps/ssp").len(), 1);
    assert_eq!(
        found(
            "use crate::pipeline::mlp::even_split;",
            "tensor_parallel/mlp"
        )
        .len(),
        1
    );
    // Down a floor, or within a module: allowed.
    assert!(found(
        "use crate::{error::Result, ddp::Sgd, zero::Zero};",
        "pipeline"
    )
    .is_empty());
    assert!(found("use crate::pipeline::mlp::mlp_stage;", "trainer/mlp").is_empty());
    assert!(found("use super::layers::TpMlp;", "tensor_parallel/mlp").is_empty());
    // The rules themselves: nothing below the trainer names it, the tensor-parallel
    // layers sit below the pipeline, the error at the bottom.
    assert!(rules.values().all(|r| !r.contains(&"trainer")));
    assert!(!rules["tensor_parallel"].contains(&"pipeline"));
    assert!(rules["error"].is_empty());
    // A root that is a table of contents, and what is not.
    let toc = "//! docs\n#![deny(missing_docs)]\npub mod a;\nmod b;\n/// c\npub use c;\n\
               pub use a::{B, C as D};\npub(crate) use b::E;\n#[doc(hidden)]\npub mod f;\n";
    assert!(root_code(toc).is_empty(), "{:?}", root_code(toc));
    let code = "pub mod a;\nuse a::B;\nfn f() -> u8 { 1 }\npub struct S { x: u8 }\n\
                mod t { }\nconst X: u8 = 1;\npub use a::C;\nimpl S {}\n";
    assert_eq!(root_code(code), vec![2, 3, 4, 5, 6, 8]);
}
