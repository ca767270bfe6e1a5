//! `wor egress check` as an operator runs it: every SSRF corpus entry is refused with a reason
//! naming the address class or the URL problem; exit codes are 0 / 1 / 2.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::process::{Command, Output, Stdio};

const WOR: &str = env!("CARGO_BIN_EXE_wor");

fn check(args: &[&str]) -> Output {
    Command::new(WOR)
        .args(["egress", "check"])
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The SSRF corpus, from the repository (`testdata/SOURCES.md` names its source).
const SSRF_CORPUS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/ssrf/block-urls.json"
));

fn corpus() -> Vec<String> {
    let json: serde_json::Value = serde_json::from_str(SSRF_CORPUS).unwrap();
    json["urls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap().to_owned())
        .collect()
}

/// Words that name an address class or a URL problem in a denial.
const REASONS: &[&str] = &[
    "loopback",
    "private",
    "link-local",
    "this network",
    "unspecified",
    "shared",
    "reserved",
    "multicast",
    "broadcast",
    "documentation",
    "ipv4-mapped",
    "url",
    "scheme",
    "credentials",
    "port",
    "host",
];

#[test]
fn every_corpus_url_is_refused_with_a_named_reason() {
    // Public names in the corpus resolve, in the wild, to internal addresses; a stub answer
    // stands in for that (no real DNS is asked: with --resolve, nothing else resolves).
    let internal = [
        "127.0.0.1",
        "10.0.0.7",
        "169.254.169.254",
        "192.168.1.1",
        "::1",
    ];
    let urls = corpus();
    assert!(urls.len() >= 50, "the corpus has {} entries", urls.len());
    for (i, url) in urls.iter().enumerate() {
        let mut args = vec![url.clone()];
        if let Ok(parsed) = url::Url::parse(url)
            && let Some(url::Host::Domain(name)) = parsed.host()
        {
            let addr = internal[i % internal.len()];
            let entry = if addr.contains(':') {
                format!("{name}:[{addr}]")
            } else {
                format!("{name}:{addr}")
            };
            args.extend(["--resolve".to_owned(), entry]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = check(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(1),
            "{url}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.starts_with("deny: "), "{url}: {stdout}");
        let lower = stdout.to_lowercase();
        assert!(
            REASONS.iter().any(|r| lower.contains(r)),
            "{url}: the reason names nothing: {stdout}"
        );
    }
}

#[test]
fn an_allowed_destination_and_bad_usage() {
    let allowed = check(&[
        "https://api.example.com/v1",
        "--resolve",
        "api.example.com:93.184.215.14",
    ]);
    assert_eq!(allowed.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&allowed.stdout).trim(), "allow");

    let off_list = check(&[
        "https://api.example.com/v1",
        "--resolve",
        "api.example.com:93.184.215.14",
        "--allow-host",
        "*.other.org",
    ]);
    assert_eq!(off_list.status.code(), Some(1));

    let unlisted_name = check(&[
        "https://elsewhere.example/",
        "--resolve",
        "api.example.com:93.184.215.14",
    ]);
    assert_eq!(
        unlisted_name.status.code(),
        Some(1),
        "with --resolve nothing else resolves"
    );

    assert_eq!(
        check(&["http://x.test", "--resolve", "nonsense"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        check(&["http://x.test", "--allow-host", "a b"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(check(&[]).status.code(), Some(2));
}

#[test]
fn operator_cidrs_come_from_the_config_file_and_production_narrows_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("wor.toml");
    std::fs::write(&config, "[egress]\nallowed_cidrs = [\"10.20.0.0/16\"]\n").unwrap();
    let config = config.display().to_string();
    let listed = check(&["http://10.20.3.4/", "--config", &config]);
    assert_eq!(
        listed.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
    let unlisted = check(&["http://10.21.3.4/", "--config", &config]);
    assert_eq!(unlisted.status.code(), Some(1));

    std::fs::write(
        dir.path().join("wide.toml"),
        "[egress]\nallowed_cidrs = [\"0.0.0.0/0\"]\n",
    )
    .unwrap();
    let wide = dir.path().join("wide.toml").display().to_string();
    let refused = check(&["http://10.20.3.4/", "--config", &wide, "--production"]);
    assert_eq!(
        refused.status.code(),
        Some(2),
        "production refuses a list that disables the guard"
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("too broad"));

    // An IPv6 range that embeds IPv4 is judged by the IPv4 range it reaches: all of IPv4, or
    // cloud metadata spelt as IPv4-mapped.
    for (cidr, says) in [
        ("::ffff:0:0/96", "reaches the IPv4 range 0.0.0.0/0"),
        ("::ffff:169.254.0.0/112", "link-local"),
        ("2001::/32", "Teredo"),
    ] {
        std::fs::write(
            dir.path().join("mapped.toml"),
            format!("[egress]\nallowed_cidrs = [\"{cidr}\"]\n"),
        )
        .unwrap();
        let mapped = dir.path().join("mapped.toml").display().to_string();
        let refused = check(&[
            "http://[::ffff:169.254.169.254]/latest/meta-data/",
            "--config",
            &mapped,
            "--production",
        ]);
        assert_eq!(refused.status.code(), Some(2), "{cidr}");
        assert!(
            String::from_utf8_lossy(&refused.stderr).contains(says),
            "{cidr}: {}",
            String::from_utf8_lossy(&refused.stderr)
        );
    }

    // `wor serve` refuses a section it cannot use before the data dir gets a database or a key.
    std::fs::write(
        dir.path().join("garbage.toml"),
        "[egress]\nallowed_cidrs = [\"garbage\"]\n",
    )
    .unwrap();
    let fresh = dir.path().join("fresh");
    std::fs::create_dir(&fresh).unwrap();
    let served = Command::new(WOR)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&fresh)
        .arg("--config")
        .arg(dir.path().join("garbage.toml"))
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(served.status.code(), Some(2), "{served:?}");
    assert!(String::from_utf8_lossy(&served.stderr).contains("[egress]"));
    let left: Vec<_> = std::fs::read_dir(&fresh)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
