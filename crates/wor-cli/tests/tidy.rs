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
