//! The library's modules form layers: no import loop between top-level modules, and none between
//! the modules inside one of them. This test reads the source, so a change that makes a loop
//! fails here, naming it.
//!
//! What counts as an import: every `crate::a::b` path in a file (in `use` lines, grouped
//! `use crate::{a, b::c}` included, in code and in doc links), and `super::x` in a child module;
//! a name a module re-exports (`pub use child::X`, lib.rs's included) counts as its child's. A file
//! `src/a/b.rs` belongs to module `a`; the loops checked are between top-level modules, and between
//! the children of one module (a child naming its parent, or a parent its children, is ownership,
//! not a loop). Left out: `check` (the checker, compiled for tests only, reaches into `store` to
//! inject faults) and this file. Not seen: a dependency only through a method whose `impl` lives in
//! another module (`impl Store` in `protocol::call`), and paths built by macros.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The module path of a file under src/: `worker/slot.rs` → ["worker", "slot"], `worker/mod.rs`
/// → ["worker"], `lib.rs` → [].
fn module_of(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> =
        relative.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// Every absolute module path a file names: `crate::a::b::C` gives ["a", "b", "C"]; a group
/// `crate::{a::b, c}` gives both; `super::x` in module `m::n` gives ["m", "x"], and
/// `super::super::x` there gives ["x"].
fn imports(text: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for prefix in ["crate::", "super::"] {
        let mut rest = text;
        while let Some(at) = rest.find(prefix) {
            let before = &rest[..at];
            rest = &rest[at + prefix.len()..];
            let joined =
                before.chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$');
            if joined {
                continue; // `$crate::`, `foo_crate::`
            }
            let mut up = 0;
            if prefix == "super::" {
                up = 1;
                while let Some(next) = rest.strip_prefix("super::") {
                    (rest, up) = (next, up + 1); // past every `super::` of `super::super::`
                }
            }
            let tail = rest;
            let base = &module[..module.len().saturating_sub(up)];
            let base = if prefix == "crate::" { &[][..] } else { base };
            for path in expand(tail) {
                found.push([base, &path[..]].concat());
            }
        }
    }
    found
}

/// The names a module re-exports from its children (`pub use child::{A, b::C}` in module `m`:
/// `m::A` is `m::child::A`), so that an import of the re-exported name counts as one of the child.
fn reexports(
    text: &str,
    module: &[String],
    is_module: impl Fn(&[String]) -> bool,
) -> Vec<(Vec<String>, Vec<String>)> {
    let mut found = Vec::new();
    for statement in text.split("pub use ").skip(1).chain(text.split("pub(crate) use ").skip(1)) {
        let statement = &statement[..statement.find(';').unwrap_or(statement.len())];
        for path in expand(statement) {
            if path.len() >= 2 && is_module(&[module, &path[..1]].concat()) {
                let name = path.last().expect("two segments or more").clone();
                found.push(([module, &[name]].concat(), [module, &path[..]].concat()));
            }
        }
    }
    found
}

/// The paths at the start of `text`, which follows a `crate::`: `a::b::C`, or a brace group.
fn expand(text: &str) -> Vec<Vec<String>> {
    if let Some(group) = text.strip_prefix('{') {
        let mut depth = 1;
        let mut end = group.len();
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = i;
                break;
            }
        }
        let mut paths = Vec::new();
        let (mut depth, mut start) = (0, 0);
        let body = &group[..end];
        for (i, c) in body.char_indices().chain([(body.len(), ',')]) {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    let item = body[start..i].trim();
                    if !item.is_empty() {
                        paths.extend(expand(item));
                    }
                    start = i + 1;
                }
                _ => {}
            }
        }
        return paths;
    }
    let mut path = Vec::new();
    let mut rest = text;
    loop {
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if end == 0 {
            if rest.starts_with('{') {
                return expand(rest).into_iter().map(|tail| [path.clone(), tail].concat()).collect();
            }
            break;
        }
        path.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    vec![path]
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// One loop in `edges` if there is any, as the modules along it.
fn find_loop(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|start| visit(start, edges, &mut Vec::new(), &mut done))
}

#[test]
fn the_modules_import_each_other_without_a_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut modules = BTreeSet::new();
    let mut texts = Vec::new();
    for file in &files {
        let module = module_of(file.strip_prefix(&src).expect("under src/"));
        if module.first().is_some_and(|top| top == "check" || top == "layering") {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("a readable source file");
        if !module.is_empty() {
            modules.insert(module.clone());
        }
        texts.push((module, text));
    }
    // `crate::Admin` names `admin::Admin`, through lib.rs's `pub use admin::{Admin, ..}`; likewise
    // `super::Finished` in a child of `protocol` names `protocol::finish::Finished`.
    let exported: BTreeMap<Vec<String>, Vec<String>> = texts
        .iter()
        .flat_map(|(module, text)| reexports(text, module, |path| modules.contains(path)))
        .collect();
    let mut uses = Vec::new();
    for (module, text) in &texts {
        for mut path in imports(text, module) {
            if let Some(k) = (1..=path.len()).find(|&k| exported.contains_key(&path[..k])) {
                path = [&exported[&path[..k]][..], &path[k..]].concat();
            }
            uses.push((module.clone(), path));
        }
    }
    let is_module = |path: &[String]| modules.contains(path);

    // Between top-level modules.
    let mut top: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    // Between the children of one module, keyed by the parent.
    let mut inner: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, to) in &uses {
        let (Some(from_top), Some(to_top)) = (from.first(), to.first()) else { continue };
        if from_top == "check" || !is_module(&to[..1]) {
            continue;
        }
        if from_top != to_top {
            top.entry(from_top.clone()).or_default().insert(to_top.clone());
        } else if from.len() >= 2 && to.len() >= 2 && from[1] != to[1] && is_module(&to[..2]) {
            inner
                .entry(from_top.clone())
                .or_default()
                .entry(from[1].clone())
                .or_default()
                .insert(to[1].clone());
        }
    }
    assert!(top.len() > 5, "the scan found too few imports to mean anything: {top:?}");
    if let Some(cycle) = find_loop(&top) {
        panic!("an import loop between top-level modules: {}", cycle.join(" -> "));
    }
    for (parent, edges) in &inner {
        if let Some(cycle) = find_loop(edges) {
            panic!("an import loop inside `{parent}`: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_scan_reads_grouped_and_relative_imports() {
    let module = ["worker".to_owned(), "slot".to_owned()];
    let text = "use crate::{error::{Error, Result}, keys};\nuse super::recovery::x; let y = crate::shards::arm(); $crate::z; super::super::store::S";
    let found: BTreeSet<String> = imports(text, &module).into_iter().map(|p| p.join("::")).collect();
    let expected =
        ["error::Error", "error::Result", "keys", "worker::recovery::x", "shards::arm", "store::S"];
    assert_eq!(found, expected.into_iter().map(str::to_owned).collect());
    let cyclic: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(from, to)| (from.to_owned(), BTreeSet::from([to.to_owned()])))
        .collect();
    assert_eq!(find_loop(&cyclic).map(|c| c.len()), Some(4));

    let protocol = ["protocol".to_owned()];
    let children =
        |path: &[String]| matches!(path, [p, c] if p == "protocol" && (c == "finish" || c == "library"));
    let text = "pub(crate) use finish::Finished;\npub use library::{acl_rules, Func};\npub use fred::Value;";
    let found: BTreeSet<(String, String)> =
        reexports(text, &protocol, children).into_iter().map(|(n, p)| (n.join("::"), p.join("::"))).collect();
    let expected = [
        ("protocol::Finished", "protocol::finish::Finished"),
        ("protocol::acl_rules", "protocol::library::acl_rules"),
        ("protocol::Func", "protocol::library::Func"),
    ];
    assert_eq!(found, expected.into_iter().map(|(n, p)| (n.to_owned(), p.to_owned())).collect());
}
