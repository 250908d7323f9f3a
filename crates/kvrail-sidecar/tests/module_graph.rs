//! The sidecar's modules import each other without a loop: each file's
//! `crate::NAME` references, and inside a directory module (`link/`) each
//! file's `super::` references and its mod.rs's `mod` declarations, must
//! form a graph without cycles. A loop means two parts can no longer be
//! understood, tested or replaced one without the other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The word after each `prefix` in `text` ("" where none follows, as in
/// `super::{...}` or `super::*`).
fn words_after(text: &str, prefix: &str) -> BTreeSet<String> {
    text.split(prefix)
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// `crate::NAME` references in `text`, NAME being a top-level module.
fn references(text: &str) -> BTreeSet<String> {
    words_after(text, "crate::")
        .into_iter()
        .filter(|name| name.chars().next().is_some_and(|c| c.is_ascii_lowercase()))
        .collect()
}

/// What each `super::` reference in a directory module's file names, its
/// tests left out (there `super` is the file itself).
fn super_references(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]").next().unwrap_or(text);
    words_after(code, "super::")
}

/// `mod NAME;` declarations.
fn declared_modules(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

/// The import graph: each top-level module a node, and each file of a
/// directory module its own node (`link`: its mod.rs, `link::reader`...),
/// so that the rooms of a directory are held to the same rule.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(src).expect("under src");
        let parts: Vec<String> = rel
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_string()
            })
            .collect();
        let top = parts[0].clone();
        if top == "lib" || top == "main" {
            continue;
        }
        // Files deeper than one directory count as their directory's file.
        let node = match parts.get(1) {
            Some(file) if file != "mod" && parts.len() == 2 => format!("{top}::{file}"),
            _ => top.clone(),
        };
        let text = std::fs::read_to_string(file).expect("read source");
        let edges = graph.entry(node.clone()).or_default();
        edges.extend(references(&text).into_iter().filter(|m| *m != node));
        if parts.len() == 2 {
            if node == top {
                edges.extend(
                    declared_modules(&text)
                        .into_iter()
                        .map(|m| format!("{top}::{m}")),
                );
            } else {
                // A sibling file by name; anything else is the mod.rs's.
                let dir = src.join(&top);
                edges.extend(super_references(&text).into_iter().map(|m| {
                    if !m.is_empty() && dir.join(format!("{m}.rs")).is_file() {
                        format!("{top}::{m}")
                    } else {
                        top.clone()
                    }
                }));
            }
        }
        edges.remove(&node);
    }
    graph
}

#[test]
fn no_module_imports_itself_through_others() {
    let src = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo")).join("src");
    let graph = module_graph(&src);
    assert!(
        graph.contains_key("link")
            && graph.contains_key("daemon")
            && graph.contains_key("link::reader")
            && graph["link"].contains("link::reader"),
        "{graph:?}"
    );
    // Depth-first search for a back edge; report the loop it closes.
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, &graph, &mut Vec::new(), &mut done) {
            panic!("import loop: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn references_are_read_by_name() {
    let r =
        references("use crate::link::{PeerLink};\nlet x = crate::daemon::watch(); crate::Daemon");
    assert_eq!(r.into_iter().collect::<Vec<_>>(), ["daemon", "link"]);
}

#[test]
fn a_room_that_reaches_back_into_its_mod_rs_is_a_loop() {
    let dir = tempfile::tempdir().expect("tempdir");
    let link = dir.path().join("link");
    std::fs::create_dir(&link).expect("mkdir");
    std::fs::write(link.join("mod.rs"), "mod reader;\nmod frames;\n").expect("write");
    std::fs::write(
        link.join("reader.rs"),
        "use super::frames::Outgoing;\n#[cfg(test)]\nmod tests { use super::*; }\n",
    )
    .expect("write");
    std::fs::write(link.join("frames.rs"), "pub struct Outgoing;\n").expect("write");
    let graph = module_graph(dir.path());
    assert_eq!(graph["link"].len(), 2, "{graph:?}");
    assert_eq!(
        graph["link::reader"].iter().collect::<Vec<_>>(),
        ["link::frames"],
        "a test module's `super` is its own file"
    );
    std::fs::write(link.join("frames.rs"), "use super::PeerLink;\n").expect("write");
    let graph = module_graph(dir.path());
    assert!(graph["link::frames"].contains("link"), "{graph:?}");
}
