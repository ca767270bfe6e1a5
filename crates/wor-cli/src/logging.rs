//! Structured logs on stderr. Work on Repeat's own components log at `WOR_LOG` (default
//! `info`); every dependency stays at `warn`, so no HTTP library can log a header or body.

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

use crate::env;

const OWN_TARGETS: &[&str] = &[
    "wor",
    "wor_cli",
    "wor_core",
    "wor_server",
    "wor_store",
    "wor_secrets",
    "wor_egress",
];

pub fn init() -> anyhow::Result<()> {
    let level = std::env::var(env::LOG).unwrap_or_else(|_| "info".to_owned());
    let level = level.trim().to_ascii_lowercase();
    if !["error", "warn", "info", "debug", "trace", "off"].contains(&level.as_str()) {
        anyhow::bail!(
            "{} must be one of error, warn, info, debug, trace, off; got `{level}`",
            env::LOG
        );
    }
    let mut filter = EnvFilter::new("warn");
    for target in OWN_TARGETS {
        filter = filter.add_directive(format!("{target}={level}").parse()?);
    }
    let format = std::env::var(env::LOG_FORMAT).unwrap_or_else(|_| "json".to_owned());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::NONE)
        .with_target(true);
    let result = match format.as_str() {
        "json" => builder.json().flatten_event(true).try_init(),
        "text" => builder.try_init(),
        other => anyhow::bail!(
            "{} must be `json` or `text`; got `{other}`",
            env::LOG_FORMAT
        ),
    };
    result.map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))
}
