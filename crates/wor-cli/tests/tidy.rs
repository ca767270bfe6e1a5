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
            "wor-wasm",
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

/// The modules of one crate that `source` (one module's text) refers to as `crate::NAME`.
fn module_references(source: &str, modules: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in source.match_indices("crate::") {
        let rest = &source[at + "crate::".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if modules.contains(&name) && !found.contains(&name) {
            found.push(name);
        }
        // `use crate::{a::X, b}` names several.
        if rest.starts_with('{') {
            let group: String = rest.chars().take_while(|c| *c != '}').collect();
            for part in group.trim_start_matches('{').split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if modules.contains(&name) && !found.contains(&name) {
                    found.push(name);
                }
            }
        }
    }
    found
}

/// A cycle in `edges`, if there is one, as the modules along it.
fn find_cycle(edges: &BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
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
    let mut done = std::collections::BTreeSet::new();
    edges
        .keys()
        .find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

/// The modules of each crate (one file each, below `src/`, the crate root aside) refer to
/// each other in one direction only: a circle means two modules that are really one, or a
/// shared piece that belongs in a module of its own.
#[test]
fn no_crate_has_a_circle_of_modules() {
    let crates = repository_root().join("crates");
    for krate in std::fs::read_dir(&crates).unwrap() {
        let src = krate.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        files_below(
            &src,
            &|p| p.extension().is_some_and(|e| e == "rs"),
            &mut files,
        );
        let module_of = |path: &std::path::Path| {
            let relative = path.strip_prefix(&src).unwrap();
            let first = relative.components().next().unwrap();
            first
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_owned()
        };
        let modules: Vec<String> = files
            .iter()
            .map(|p| module_of(p))
            .filter(|m| !matches!(m.as_str(), "lib" | "main" | "bin"))
            .collect();
        let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for file in &files {
            let module = module_of(file);
            if !modules.contains(&module) {
                continue;
            }
            let source = std::fs::read_to_string(file).unwrap();
            // What only its tests use does not make a module depend on another, nor does a
            // comment that links to one.
            let source: String = source
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .lines()
                .map(|line| line.split("//").next().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n");
            let source = source.as_str();
            let entry = edges.entry(module.clone()).or_default();
            for target in module_references(source, &modules) {
                if target != module && !entry.contains(&target) {
                    entry.push(target);
                }
            }
        }
        assert_eq!(
            find_cycle(&edges),
            None,
            "modules of {} refer to each other in a circle",
            src.display()
        );
    }
}

#[test]
fn the_circle_rule_finds_a_circle() {
    let modules: Vec<String> = ["driver", "pipeline", "call"].map(str::to_owned).into();
    assert_eq!(
        module_references(
            "use crate::{pipeline::X, call};\nlet a = crate::driver::Y;",
            &modules
        ),
        ["pipeline", "call", "driver"].map(str::to_owned)
    );
    let edges = BTreeMap::from([
        ("driver".to_owned(), vec!["pipeline".to_owned()]),
        ("pipeline".to_owned(), vec!["call".to_owned()]),
        ("call".to_owned(), vec!["driver".to_owned()]),
    ]);
    assert!(find_cycle(&edges).is_some());
    let acyclic = BTreeMap::from([
        (
            "driver".to_owned(),
            vec!["pipeline".to_owned(), "call".to_owned()],
        ),
        ("pipeline".to_owned(), vec!["call".to_owned()]),
    ]);
    assert_eq!(find_cycle(&acyclic), None);
}

/// A run's steps are read and written as `wor_core::step::Step` only: outside its module no
/// library code names a step kind as a string or looks a key up in a step's payload.
#[test]
fn steps_are_typed_outside_the_step_module() {
    let kinds = [
        "\"model_turn\"",
        "\"tool_call\"",
        "\"tool_result\"",
        "\"approval_used\"",
    ];
    let mut files = Vec::new();
    files_below(
        &repository_root().join("crates"),
        &|p| {
            p.extension().is_some_and(|e| e == "rs")
                && p.components().any(|c| c.as_os_str() == "src")
                && !p.ends_with("wor-core/src/step.rs")
                // Providers' wire formats have block types of the same names.
                && !p.components().any(|c| c.as_os_str() == "wor-models")
        },
        &mut files,
    );
    let mut found = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).unwrap();
        let library = source.split("#[cfg(test)]").next().unwrap_or_default();
        for (n, line) in library.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if kinds.iter().any(|k| code.contains(k))
                || code.contains(".payload.get(")
                || code.contains(".payload.pointer(")
                || code.contains("s.kind ==")
            {
                found.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "untyped step handling:\n{}",
        found.join("\n")
    );
}

/// The writes in `source` (a file of `wor-store`) made on the pool without this process's
/// turn to write: a statement that inserts, updates or deletes run on `pool()` rather than on
/// `write_pool()` or a transaction, and a connection taken from `pool()` (only writes take
/// one). Each as `line: text` of the line where its statement begins.
fn writes_outside_the_turn(source: &str) -> Vec<String> {
    let library = source.split("#[cfg(test)]").next().unwrap_or_default();
    let line_of = |at: usize| library[..at].matches('\n').count() + 1;
    let mut found = Vec::new();
    for (at, _) in library.match_indices("sqlx::query") {
        let statement = library[at..].split(".await").next().unwrap_or_default();
        let writes = ["INSERT ", "REPLACE INTO", "DELETE FROM", "UPDATE "]
            .iter()
            .any(|w| statement.contains(w));
        let on_pool = ["self.pool()", "&self.pool)", "store.pool()"]
            .iter()
            .any(|p| statement.contains(p));
        if writes && on_pool {
            found.push(format!(
                "{}: {}",
                line_of(at),
                statement.lines().next().unwrap_or_default().trim()
            ));
        }
    }
    for (at, _) in library.match_indices("pool().acquire()") {
        found.push(format!("{}: a connection taken from the pool", line_of(at)));
    }
    found
}

/// On SQLite, every write of the process waits for its turn to write (`Store::write_pool`,
/// `Store::begin_write`), in order, instead of for the database's lock in SQLite's busy
/// handler, which a steady stream of transactions can keep from it until it fails.
#[test]
fn the_store_writes_only_in_its_turn() {
    let mut files = Vec::new();
    files_below(
        &repository_root().join("crates/wor-store/src"),
        &|p| p.extension().is_some_and(|e| e == "rs"),
        &mut files,
    );
    let found: Vec<String> = files
        .iter()
        .flat_map(|file| {
            let source = std::fs::read_to_string(file).unwrap();
            writes_outside_the_turn(&source)
                .into_iter()
                .map(move |f| format!("{}:{f}", file.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "writes outside the turn to write:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_turn_rule_finds_a_write_on_the_pool() {
    let source = r#"
        let n = sqlx::query("SELECT 1").fetch_one(self.pool()).await?;
        sqlx::query("UPDATE runs SET x = 1 WHERE id = $1")
            .bind(id)
            .execute(self.pool())
            .await?;
        sqlx::query("DELETE FROM t").execute(&*self.write_pool().await?).await?;
        let mut connection = self.pool().acquire().await?;
        sqlx::query("INSERT OR IGNORE INTO t VALUES (1)").execute(store.pool()).await?;
        sqlx::query("DELETE FROM t").fetch_optional(&self.pool).await?;
    "#;
    assert_eq!(
        writes_outside_the_turn(source),
        [
            "3: sqlx::query(\"UPDATE runs SET x = 1 WHERE id = $1\")",
            "9: sqlx::query(\"INSERT OR IGNORE INTO t VALUES (1)\").execute(store.pool())",
            "10: sqlx::query(\"DELETE FROM t\").fetch_optional(&self.pool)",
            "8: a connection taken from the pool"
        ]
    );
}

/// The dependency diagram of ARCHITECTURE.md, as `cargo metadata` has it: each crate, the
/// crates it depends on (normal dependencies only), those that depend on nothing last.
fn dependency_diagram() -> String {
    let meta = metadata();
    let mut edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for package in meta["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap().to_owned();
        let mut deps: Vec<String> = package["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|d| d.starts_with("wor-"))
            .map(str::to_owned)
            .collect();
        deps.sort();
        deps.dedup();
        edges.insert(name, deps);
    }
    // Most dependencies first: the composition root at the top, `wor-core` at the bottom.
    let mut order: Vec<(&String, &Vec<String>)> = edges.iter().collect();
    order.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
    order
        .iter()
        .map(|(name, deps)| {
            if deps.is_empty() {
                format!("{name} (depends on no other crate)")
            } else {
                format!("{name} ──> {}", deps.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// ARCHITECTURE.md draws exactly the dependencies the crates have.
#[test]
fn the_architecture_diagram_matches_the_crates() {
    let text = std::fs::read_to_string(repository_root().join("ARCHITECTURE.md")).unwrap();
    let start = "<!-- dependencies: generated, checked by crates/wor-cli/tests/tidy.rs -->\n```\n";
    let drawn = text
        .split_once(start)
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .map(|(block, _)| block)
        .expect("ARCHITECTURE.md has the generated dependency block");
    let actual = dependency_diagram();
    assert_eq!(
        drawn, actual,
        "ARCHITECTURE.md's dependency block is out of date; it should read:\n{actual}"
    );
}

/// ARCHITECTURE.md is written one sentence per line, so a change to one sentence is one line of
/// its diff: no prose line holds the end of one sentence and the start of the next.
#[test]
fn the_architecture_has_one_sentence_per_line() {
    let text = std::fs::read_to_string(repository_root().join("ARCHITECTURE.md")).unwrap();
    let mut in_code = false;
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || line.starts_with('|') || line.starts_with('#') {
            continue;
        }
        let chars: Vec<char> = line.chars().collect();
        let joined = chars.windows(3).any(|w| {
            matches!(w[0], '.' | '!' | '?')
                && w[1] == ' '
                && (w[2].is_ascii_uppercase() || matches!(w[2], '`' | '*' | '('))
        });
        if joined {
            found.push(format!("ARCHITECTURE.md:{}: {line}", n + 1));
        }
    }
    assert!(
        found.is_empty(),
        "two sentences on one line:\n{}",
        found.join("\n")
    );
}

/// Every file below `testdata/` that a source names is in git: a file the ignore rules keep out
/// (a `*.db` fixture, say) is on the machine that wrote it and missing from every clone.
#[test]
fn test_data_named_by_the_sources_is_in_git() {
    let root = repository_root();
    let tracked = Command::new("git")
        .args(["ls-files", "testdata"])
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        tracked.status.success(),
        "the tests run in a git checkout: {}",
        String::from_utf8_lossy(&tracked.stderr)
    );
    let tracked = String::from_utf8(tracked.stdout).unwrap();
    let tracked: std::collections::BTreeSet<&str> = tracked.lines().collect();
    let mut sources = Vec::new();
    files_below(
        &root.join("crates"),
        &|p| p.extension().is_some_and(|e| e == "rs"),
        &mut sources,
    );
    let mut missing = Vec::new();
    for file in sources {
        let text = std::fs::read_to_string(&file).unwrap();
        for (at, _) in text.match_indices("testdata/") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "/._-".contains(*c))
                .collect();
            // A path to a file (with an extension), not a folder or prose.
            let is_file = name
                .rsplit('/')
                .next()
                .is_some_and(|last| last.contains('.') && !last.ends_with('.'));
            if is_file && !tracked.contains(name.as_str()) {
                missing.push(format!("{}: {name}", file.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named by the sources but not in git:\n{}",
        missing.join("\n")
    );
}

/// The names the sources define with `fn` or `mod`, by the directory of the file defining them.
struct Definitions {
    by_directory: BTreeMap<std::path::PathBuf, std::collections::BTreeSet<String>>,
}

impl Definitions {
    fn read(root: &std::path::Path) -> Definitions {
        let mut files = Vec::new();
        files_below(
            &root.join("crates"),
            &|p| p.extension().is_some_and(|e| e == "rs"),
            &mut files,
        );
        let mut by_directory: BTreeMap<_, std::collections::BTreeSet<String>> = BTreeMap::new();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let names = by_directory
                .entry(file.parent().unwrap().to_path_buf())
                .or_default();
            for line in text.lines() {
                let mut words = line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
                while let Some(word) = words.next() {
                    if word == "fn" || word == "mod" {
                        match words.next() {
                            Some(name) if !name.is_empty() => {
                                names.insert(name.to_owned());
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        Definitions { by_directory }
    }

    /// Whether a file in `dir` or below it defines `name`.
    fn below(&self, dir: &std::path::Path, name: &str) -> bool {
        self.by_directory
            .iter()
            .any(|(at, names)| at.starts_with(dir) && names.contains(name))
    }
}

/// The references to tests and test files in `doc` that name nothing in the sources: a
/// `` `wor-x/tests/file.rs::name` `` (the file must exist and its directory define `name`), a
/// `` `wor-x/tests/file.rs` ``, a `` `wor-x` `module::tests::name` `` (defined in the crate's
/// `src`), and when `bare_names_are_tests` a bare `` `long_snake_case_name` `` of five words or
/// more (defined anywhere).
fn unresolved_test_references(
    root: &std::path::Path,
    definitions: &Definitions,
    doc: &str,
    bare_names_are_tests: bool,
) -> Vec<String> {
    let crates = root.join("crates");
    let pieces: Vec<&str> = doc.split('`').collect();
    let mut unresolved = Vec::new();
    // The module path after a crate's name is read with the name, not again on its own.
    let mut read_with_crate = None;
    for (at, span) in pieces.iter().enumerate().skip(1).step_by(2) {
        if read_with_crate == Some(at) {
            continue;
        }
        let span = span.trim();
        let is_name = |text: &str| {
            !text.is_empty()
                && text
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        if let Some((file, names)) = span.split_once(".rs::") {
            let file = crates.join(format!("{}.rs", file.trim_start_matches("crates/")));
            let name = names.rsplit("::").next().unwrap_or_default();
            let found =
                file.is_file() && is_name(name) && definitions.below(file.parent().unwrap(), name);
            if !found {
                unresolved.push(span.to_owned());
            }
        } else if span.ends_with(".rs")
            && (span.starts_with("wor-") || span.starts_with("crates/wor-"))
        {
            if !crates.join(span.trim_start_matches("crates/")).is_file() {
                unresolved.push(span.to_owned());
            }
        } else if span.starts_with("wor-")
            && is_name(&span.replace('-', "_"))
            && pieces.get(at + 1) == Some(&" ")
            && let Some(path) = pieces.get(at + 2)
            && path.split("::").all(is_name)
        {
            read_with_crate = Some(at + 2);
            let name = path.rsplit("::").next().unwrap_or_default();
            if !definitions.below(&crates.join(span).join("src"), name) {
                unresolved.push(format!("{span} {path}"));
            }
        } else if bare_names_are_tests
            && is_name(span)
            && span.split('_').count() >= 5
            && !definitions.below(&crates, span)
        {
            unresolved.push(span.to_owned());
        }
    }
    unresolved
}

/// Every test and test file the documents cite exists: a renamed or moved test fails here
/// rather than leaving docs/SECURITY.md pointing at nothing.
#[test]
fn the_tests_the_documents_cite_exist() {
    let root = repository_root();
    let definitions = Definitions::read(&root);
    let mut docs = vec![
        root.join("ARCHITECTURE.md"),
        root.join("README.md"),
        root.join("BENCHMARKS.md"),
    ];
    files_below(
        &root.join("docs"),
        &|p| p.extension().is_some_and(|e| e == "md"),
        &mut docs,
    );
    let mut problems = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(&doc).unwrap();
        let bare_names_are_tests = doc.ends_with("docs/SECURITY.md");
        for reference in
            unresolved_test_references(&root, &definitions, &text, bare_names_are_tests)
        {
            problems.push(format!("{}: `{reference}`", doc.display()));
        }
    }
    assert!(
        problems.is_empty(),
        "cited but not found in the sources:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_citation_rule_finds_what_is_missing() {
    let root = repository_root();
    let definitions = Definitions::read(&root);
    let doc = "`wor-cli/tests/tidy.rs::dependency_directions_hold`, \
               `wor-cli/tests/tidy.rs::no_test_is_called_this`, `wor-cli/tests/nowhere.rs`, \
               `wor-cli/tests/tidy.rs`, `wor-store` `audit`, `wor-store` `no_module_is_called_this`, \
               `the_citation_rule_finds_what_is_missing`, `no_test_is_called_this_either`, \
               `wor_audit_log_syncs_total`";
    assert_eq!(
        unresolved_test_references(&root, &definitions, doc, true),
        [
            "wor-cli/tests/tidy.rs::no_test_is_called_this",
            "wor-cli/tests/nowhere.rs",
            "wor-store no_module_is_called_this",
            "no_test_is_called_this_either",
            "wor_audit_log_syncs_total",
        ]
    );
    // Outside docs/SECURITY.md a bare name is a word of prose (a metric, a setting).
    assert_eq!(
        unresolved_test_references(
            &root,
            &definitions,
            "`no_test_is_called_this_either`",
            false
        ),
        Vec::<String>::new()
    );
}
