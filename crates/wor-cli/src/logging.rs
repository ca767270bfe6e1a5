//! Structured logs on stderr. Work on Repeat's own components log at `WOR_LOG` (default
//! `info`; `warn` for `wor demo`, whose output is its narrative); every dependency stays at `warn`, so no HTTP library can log a header or body.
//! A command that is only a client of a server leaves out the certificate verifier's own lines:
//! its error says why a certificate was refused, once.
//! Every line passes through shape redaction on its way out (S4), as a last line of defence:
//! log fields are fixed categories, ids, counters and timings in the first place.

use std::io::Write;

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

/// Installs the logger; `default_level` applies when `WOR_LOG` is not set, and
/// `certificate_refusals` says whether the certificate verifier's own lines are kept (a
/// server's are: they are the only record of why one of its outbound connections failed).
pub fn init(default_level: &str, certificate_refusals: bool) -> anyhow::Result<()> {
    let level = std::env::var(env::LOG).unwrap_or_else(|_| default_level.to_owned());
    let level = level.trim().to_ascii_lowercase();
    if !["error", "warn", "info", "debug", "trace", "off"].contains(&level.as_str()) {
        anyhow::bail!(
            "{} must be one of error, warn, info, debug, trace, off; got `{level}`",
            env::LOG
        );
    }
    let mut filter = EnvFilter::new("warn");
    if !certificate_refusals {
        filter = filter.add_directive("rustls_platform_verifier=off".parse()?);
    }
    for target in OWN_TARGETS {
        filter = filter.add_directive(format!("{target}={level}").parse()?);
    }
    let format = std::env::var(env::LOG_FORMAT).unwrap_or_else(|_| "json".to_owned());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| RedactedLine(Vec::new()))
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

/// One formatted log event, buffered and written redacted when the formatter drops it.
struct RedactedLine(Vec<u8>);

impl Write for RedactedLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RedactedLine {
    fn drop(&mut self) {
        let line = redact_line(&self.0);
        // Nowhere to report a failure to write to stderr.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

fn redact_line(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    wor_secrets::redact_shapes(&text).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_lose_secret_shapes() {
        let token = ["ghp_", "0123456789abcdefghijABCDEFGHIJ012345"].concat();
        let line = format!("{{\"message\":\"upstream said {token}\",\"category\":\"http\"}}\n");
        let out = redact_line(line.as_bytes());
        assert!(!out.contains(&token), "{out}");
        assert!(out.contains("\"category\":\"http\""), "{out}");
        assert_eq!(redact_line(b"plain line\n"), "plain line\n");
    }
}
