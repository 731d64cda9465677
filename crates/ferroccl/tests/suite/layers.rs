//! The layer rules of docs/ARCHITECTURE.md, checked on the source: every `crate::X`
//! a module of the library names (outside comments) must be a layer it may use. A new
//! import that breaks a rule fails here, naming the file, the line and the rule.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Which top-level modules each top-level module may name, besides itself. Mirrors the
/// table in docs/ARCHITECTURE.md.
fn allowed() -> BTreeMap<&'static str, &'static [&'static str]> {
    let mut m: BTreeMap<&'static str, &'static [&'static str]> = BTreeMap::new();
    // The error enum names the element type and operator it refuses (UnsupportedOp):
    // error and reduce's types sit at the bottom together.
    m.insert("error", &["reduce"]);
    m.insert("sync", &[]);
    m.insert("sys", &["error"]);
    m.insert("reduce", &["error"]);
    m.insert("algo", &[]);
    m.insert("trace", &["error", "sync"]);
    m.insert("rendezvous", &["error", "sync", "sys"]);
    m.insert("config", &["error", "rendezvous"]);
    m.insert("cuda", &["error", "sync", "reduce"]);
    m.insert(
        "transport",
        &[
            "error",
            "sync",
            "sys",
            "config",
            "reduce",
            "rendezvous",
            "cuda",
        ],
    );
    m.insert("wire", &["error", "algo", "reduce", "transport"]);
    m.insert(
        "engine",
        &[
            "error",
            "sync",
            "config",
            "reduce",
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
            "algo",
            "transport",
            "wire",
            "engine",
            "rendezvous",
            "cuda",
            "trace",
        ],
    );
    m.insert("ddp", &["error", "sync", "reduce", "comm"]);
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

/// The top-level module a source file belongs to (`src/engine/pull.rs` → `engine`).
fn layer_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component");
    first
        .as_os_str()
        .to_string_lossy()
        .trim_end_matches(".rs")
        .to_string()
}

/// Every `crate::name` in `line`, as `name`.
fn crate_paths(line: &str) -> Vec<String> {
    let mut v = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        let tail = &rest[i + "crate::".len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &tail[name.len()..];
        if !name.is_empty() {
            v.push(name);
        }
    }
    v
}

#[test]
fn no_module_uses_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(
        files.len() > 30,
        "found the sources ({} files)",
        files.len()
    );
    let rules = allowed();
    // Items of lib.rs every layer may name: the crate's Result and Error, re-exported.
    let root_items = ["Result", "Error"];
    let mut broken = Vec::new();
    for f in &files {
        let layer = layer_of(&src, f);
        let Some(ok) = rules.get(layer.as_str()) else {
            // lib.rs and testing.rs see everything.
            assert!(
                ["lib", "testing"].contains(&layer.as_str()),
                "{}: module {layer} has no row in the layer table",
                f.display()
            );
            continue;
        };
        let text = std::fs::read_to_string(f).expect("read source");
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for used in crate_paths(code) {
                if used == layer
                    || ok.contains(&used.as_str())
                    || root_items.contains(&used.as_str())
                {
                    continue;
                }
                broken.push(format!(
                    "{}:{}: {layer} uses crate::{used} ({layer} may use {ok:?})",
                    f.strip_prefix(&src).unwrap_or(f).display(),
                    n + 1
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "layer rules broken:\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_checker_sees_a_violation() {
    // The scanner finds paths wherever they are on a line.
    assert_eq!(
        crate_paths("use crate::comm::Communicator; let x = crate::engine::Engine::new();"),
        ["comm", "engine"]
    );
    let rules = allowed();
    assert!(!rules["engine"].contains(&"comm"));
    assert!(!rules["transport"].contains(&"algo") && !rules["transport"].contains(&"comm"));
    assert!(!rules["cuda"].contains(&"transport"));
    assert!(!rules["algo"].contains(&"engine"));
}
