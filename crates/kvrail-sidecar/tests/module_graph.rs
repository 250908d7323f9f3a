//! The sidecar's modules import each other without a loop (issue #21): each
//! file's `crate::NAME` references, with a directory's files counted as its
//! module, must form a graph without cycles. A loop means two parts can no
//! longer be understood, tested or replaced one without the other.

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

/// `crate::NAME` references in `text`, NAME being a top-level module.
fn references(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            found.insert(name);
        }
    }
    found
}

#[test]
fn no_module_imports_itself_through_others() {
    let src = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(&src).expect("under src");
        let module = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_string())
            .expect("module name");
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(file).expect("read source");
        let edges = graph.entry(module.clone()).or_default();
        edges.extend(references(&text).into_iter().filter(|m| *m != module));
    }
    assert!(
        graph.contains_key("link") && graph.contains_key("daemon"),
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
