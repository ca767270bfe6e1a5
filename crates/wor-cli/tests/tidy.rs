//! Tidy rules that hold for the whole workspace, checked from `cargo metadata` and the sources:
//! the dependency directions of ARCHITECTURE.md, and a `//!` paragraph at every crate root.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::collections::BTreeMap;
use std::process::Command;

/// Each workspace crate and the workspace crates it may depend on (normal dependencies).
/// A new crate must be added here, and to ARCHITECTURE.md, before the workspace builds green.
const ALLOWED: &[(&str, &[&str])] = &[
    ("wor-core", &[]),
    ("wor-policy", &["wor-core"]),
    ("wor-secrets", &["wor-core"]),
    ("wor-egress", &["wor-core"]),
    ("wor-sandbox", &["wor-core", "wor-egress"]),
    ("wor-wasm", &["wor-egress"]),
    ("wor-store", &["wor-core", "wor-secrets"]),
    ("wor-models", &["wor-core", "wor-egress", "wor-secrets"]),
    (
        "wor-tools",
        &[
            "wor-core",
            "wor-egress",
            "wor-secrets",
            "wor-sandbox",
            "wor-policy",
        ],
    ),
    (
        "wor-engine",
        &[
            "wor-core",
            "wor-policy",
            "wor-secrets",
            "wor-egress",
            "wor-sandbox",
            "wor-wasm",
            "wor-tools",
            "wor-models",
            "wor-store",
        ],
    ),
    (
        "wor-server",
        &[
            "wor-core",
            "wor-policy",
            "wor-secrets",
            "wor-egress",
            "wor-store",
            "wor-engine",
            "wor-tools",
            "wor-models",
        ],
    ),
    (
        "wor-cli",
        &[
            "wor-core",
            "wor-policy",
            "wor-secrets",
            "wor-egress",
            "wor-sandbox",
            "wor-wasm",
            "wor-store",
            "wor-models",
            "wor-tools",
            "wor-engine",
            "wor-server",
        ],
    ),
];

/// Crates that do no I/O may not depend on any of these.
const IO_FREE: &[&str] = &["wor-core", "wor-policy"];
const IO_CRATES: &[&str] = &[
    "tokio",
    "sqlx",
    "reqwest",
    "hyper",
    "axum",
    "wasmtime",
    "hickory-resolver",
    "rmcp",
];

fn metadata() -> serde_json::Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn dependency_directions_hold() {
    let meta = metadata();
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let packages = meta["packages"].as_array().unwrap();
    assert!(packages.len() >= 4);
    let mut problems = Vec::new();
    for package in packages {
        let name = package["name"].as_str().unwrap();
        let Some(allowed_deps) = allowed.get(name) else {
            problems.push(format!(
                "`{name}` is not in the tidy table (and ARCHITECTURE.md)"
            ));
            continue;
        };
        for dep in package["dependencies"].as_array().unwrap() {
            if !dep["kind"].is_null() {
                continue; // dev- and build-dependencies do not shape the architecture
            }
            let dep_name = dep["name"].as_str().unwrap();
            if dep_name.starts_with("wor-") && !allowed_deps.contains(&dep_name) {
                problems.push(format!("`{name}` must not depend on `{dep_name}`"));
            }
            if IO_FREE.contains(&name) && IO_CRATES.contains(&dep_name) {
                problems.push(format!(
                    "`{name}` does no I/O and must not depend on `{dep_name}`"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_crate_root_says_what_it_is_for() {
    let meta = metadata();
    for package in meta["packages"].as_array().unwrap() {
        for target in package["targets"].as_array().unwrap() {
            let kinds: Vec<&str> = target["kind"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|k| k.as_str())
                .collect();
            if !(kinds.contains(&"lib") || kinds.contains(&"bin")) {
                continue;
            }
            let path = target["src_path"].as_str().unwrap();
            let source = std::fs::read_to_string(path).unwrap();
            assert!(
                source.trim_start().starts_with("//!"),
                "{path} must start with a `//!` paragraph saying what the crate is for"
            );
        }
    }
}

/// The repository's root: two levels above this crate.
fn repository_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Every file below `dir` (skipping build output and installed packages) for which `keep` holds.
fn files_below(
    dir: &std::path::Path,
    keep: &dyn Fn(&std::path::Path) -> bool,
    out: &mut Vec<std::path::PathBuf>,
) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "node_modules" | ".git") {
                files_below(&path, keep, out);
            }
        } else if keep(&path) {
            out.push(path);
        }
    }
}

/// Whether the relative path in `token` (from its first `..` segment on), resolved lexically
/// from `base` (a path relative to the repository's root), leaves the repository.
fn leaves_repository(base: &std::path::Path, token: &str) -> bool {
    let segments: Vec<&str> = token.split('/').collect();
    let Some(first) = segments.iter().position(|s| *s == "..") else {
        return false;
    };
    let mut depth = base.components().count();
    for segment in &segments[first..] {
        match *segment {
            ".." => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return true,
            },
            "" | "." => {}
            _ => depth += 1,
        }
    }
    false
}

/// The words of a line that could be paths: split on characters no path here contains.
fn path_like_tokens(line: &str) -> impl Iterator<Item = &str> {
    line.split(|c: char| c.is_whitespace() || "\"'(),;{}[]<>`|=$".contains(c))
        .filter(|t| t.contains(".."))
}

/// Tests, build scripts and CI scripts need nothing but the repository: a plain clone has no
/// folder beside it. Any relative path in a Rust source that climbs out of the repository —
/// from its crate's directory (`CARGO_MANIFEST_DIR`) or from its own file (`include_str!`) —
/// fails this test, and so does any climb out of `.ci/` other than to the repository's root.
#[test]
fn nothing_reads_a_path_outside_the_repository() {
    let root = repository_root();
    let mut problems = Vec::new();

    let mut sources = Vec::new();
    files_below(
        &root.join("crates"),
        &|p| p.extension().is_some_and(|e| e == "rs"),
        &mut sources,
    );
    assert!(
        sources.len() > 50,
        "found too few sources: {}",
        sources.len()
    );
    for file in &sources {
        let relative = file.strip_prefix(&root).unwrap();
        let file_dir = relative.parent().unwrap();
        let crate_dir = file
            .ancestors()
            .find(|dir| dir.join("Cargo.toml").is_file())
            .unwrap()
            .strip_prefix(&root)
            .unwrap();
        let text = std::fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            for token in path_like_tokens(line) {
                if leaves_repository(crate_dir, token) || leaves_repository(file_dir, token) {
                    problems.push(format!(
                        "{}:{}: `{token}` leaves the repository",
                        relative.display(),
                        number + 1
                    ));
                }
            }
        }
    }

    let mut scripts = Vec::new();
    files_below(&root.join(".ci"), &|_| true, &mut scripts);
    for file in &scripts {
        let relative = file.strip_prefix(&root).unwrap();
        let text = std::fs::read_to_string(file).unwrap();
        for (number, line) in text.lines().enumerate() {
            // `cd "$(dirname "$0")/.."` is the one climb a script may make: to the root.
            let line = line.replace("dirname \"$0\")/..", "");
            for token in path_like_tokens(&line) {
                if token.split('/').any(|s| s == "..") {
                    problems.push(format!(
                        "{}:{}: `{token}` climbs out of `.ci/`",
                        relative.display(),
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_path_rule_catches_a_climb_out_of_the_repository() {
    let crate_dir = std::path::Path::new("crates/wor-egress");
    let up = "..";
    let outside = format!("{{manifest_dir}}/{up}/{up}/{up}/shared/corpora/ssrf/block-urls.json");
    let inside = format!("/{up}/{up}/testdata/ssrf/block-urls.json");
    assert!(leaves_repository(crate_dir, &outside));
    assert!(!leaves_repository(crate_dir, &inside));
    assert!(!leaves_repository(crate_dir, "0..n"));
    assert_eq!(
        path_like_tokens(&format!("let p = format!(\"{outside}\");")).count(),
        1
    );
}
