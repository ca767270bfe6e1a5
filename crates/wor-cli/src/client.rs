//! The client side of the HTTP API, used by the client subcommands.

use anyhow::{Context, bail};
use reqwest::Method;
use serde_json::Value;

use crate::env;
use crate::usage;

/// Where the server is and which key to present.
#[derive(Debug, Clone, clap::Args)]
pub struct ClientArgs {
    /// Base URL of the Work on Repeat server.
    #[arg(long, env = env::SERVER, default_value = "http://127.0.0.1:8080", value_name = "URL")]
    pub server: String,
    /// Print the server's JSON instead of a summary.
    #[arg(long)]
    pub json: bool,
    /// A PEM file of certificates to trust for an `https` server beside the system's: a
    /// private CA, or the server's own self-signed certificate (one that is not a CA)
    /// [env: WOR_CA_CERT].
    #[arg(long, value_name = "FILE")]
    pub ca_cert: Option<std::path::PathBuf>,
}

/// The error of an answer with `status` and error `code`, told as `said`. A refused key
/// (`401 unauthenticated`) is one the command cannot use: a usage error, exit 2, as for a
/// malformed one.
fn answer_error(status: reqwest::StatusCode, code: &str, said: String) -> anyhow::Error {
    if status == reqwest::StatusCode::UNAUTHORIZED && code == "unauthenticated" {
        usage(format!(
            "{said}: check {}: it may be revoked, or a key of another server",
            env::API_KEY
        ))
    } else {
        anyhow::Error::msg(said)
    }
}

/// The certificates of the PEM file at `path`, to trust beside the system's; a file
/// [`crate::config::pem_certificates`] refuses is a [`UsageError`](crate::UsageError) that
/// names where the path came from (`named_by`).
fn trusted_certificates(
    path: Option<&std::path::Path>,
    named_by: &str,
) -> anyhow::Result<Vec<reqwest::Certificate>> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let refused = |reason: String| {
        usage(format!(
            "{named_by} `{}` is refused: {reason}",
            path.display()
        ))
    };
    crate::config::pem_certificates(path)
        .map_err(refused)?
        .iter()
        .map(|certificate| {
            reqwest::Certificate::from_der(certificate).map_err(|e| refused(e.to_string()))
        })
        .collect()
}

/// The `--ca-cert` file given, else `WOR_CA_CERT` when it is set and not empty.
fn ca_cert_file(given: Option<&std::path::Path>) -> Option<std::path::PathBuf> {
    given.map(std::path::Path::to_path_buf).or_else(|| {
        std::env::var_os(env::CA_CERT)
            .filter(|path| !path.is_empty())
            .map(std::path::PathBuf::from)
    })
}

/// How a client is given certificates to trust beside the system's, and whether it was.
#[derive(Debug, Clone, Copy)]
struct Trust {
    /// The flag or variable that gives them: a worker has no flag.
    by: &'static str,
    given: bool,
}

/// How a client command's, or an enrolment's, file of certificates is named when refused.
const GIVEN: &str = "--ca-cert (WOR_CA_CERT)";
/// A client command's, or an enrolment's, way to be given certificates.
const BY_FLAG_OR_VARIABLE: &str = "--ca-cert or WOR_CA_CERT";
/// A worker's.
const BY_VARIABLE: &str = "WOR_CA_CERT, else the ca_cert its enrolment recorded,";

/// Why a request to `base` got no answer: as reqwest says, and, when TLS or HTTP itself is
/// what stopped it (a refused certificate, a server that speaks the other scheme), what to do
/// about it (`trust`: how this client is given certificates, and whether it was).
fn unreachable(base: &url::Url, error: reqwest::Error, trust: Trust) -> anyhow::Error {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    let mut hint = None;
    while let Some(current) = cause {
        hint = match current.downcast_ref::<rustls::Error>() {
            Some(rustls::Error::InvalidCertificate(reason)) => {
                Some(certificate_hint(reason, trust))
            }
            Some(rustls::Error::InvalidMessage(_)) => Some(
                "it did not answer in TLS: if it serves plain HTTP, give an http:// URL".to_owned(),
            ),
            _ => current
                .downcast_ref::<hyper::Error>()
                .filter(|error| error.is_parse())
                .map(|_| {
                    "its answer is not HTTP: if it serves TLS, give an https:// URL".to_owned()
                }),
        };
        if hint.is_some() {
            break;
        }
        // An I/O error hides the error it wraps from `source`, so it is opened here.
        cause = match current.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => current.source(),
        };
    }
    let hint = hint.map(|hint| format!(": {hint}")).unwrap_or_default();
    anyhow::Error::new(error).context(format!("cannot reach the server at {base}{hint}"))
}

/// What to do about a server certificate refused for `reason`.
fn certificate_hint(reason: &rustls::CertificateError, trust: Trust) -> String {
    use rustls::CertificateError as Refused;
    match reason {
        // A trusted certificate with the issuer's name whose key did not sign it is refused as
        // a bad signature: the same case.
        Refused::UnknownIssuer | Refused::BadSignature if trust.given => format!(
            "its TLS certificate is signed by none of the certificates {} gave, nor by one the \
             system trusts",
            trust.by
        ),
        Refused::UnknownIssuer | Refused::BadSignature => format!(
            "its TLS certificate is not trusted here; give the certificate of its CA (or its own) \
             with {}",
            trust.by
        ),
        Refused::Expired | Refused::ExpiredContext { .. } => {
            "its TLS certificate has expired".to_owned()
        }
        Refused::NotValidYet | Refused::NotValidYetContext { .. } => {
            "its TLS certificate is not valid yet (or this host's clock is behind)".to_owned()
        }
        Refused::NotValidForName | Refused::NotValidForNameContext { .. } => {
            "its TLS certificate is for another name than the one it was reached at (its \
             subjectAltName must name that host or address)"
                .to_owned()
        }
        // rustls names this one only through the verifier's own error.
        other if format!("{other:?}").contains("CaUsedAsEndEntity") => {
            "its TLS certificate is a CA certificate, which TLS does not accept as a server's own \
             (`openssl req -x509` makes one unless told `-addext basicConstraints=critical,CA:FALSE`): \
             give the server a certificate that is not a CA, or one signed by a CA whose \
             certificate --ca-cert gives"
                .to_owned()
        }
        other => format!("its TLS certificate is refused ({other:?})"),
    }
}

/// The most of an answer the client reads: a larger one is refused rather than held in memory.
const MAX_ANSWER_BYTES: usize = 64 << 20;
/// The most of a control plane's answer a worker reads: a claim carries every step of its
/// run, so only a bound against a link gone wrong.
const MAX_CONTROL_PLANE_ANSWER_BYTES: usize = 1 << 30;
/// The longest line, and the longest data of one event, an event stream may send.
const MAX_EVENT_BYTES: usize = 16 << 20;

/// The body of `response`, at most `max` bytes of it.
async fn read_capped(
    mut response: reqwest::Response,
    base: &reqwest::Url,
    max: usize,
) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .with_context(|| format!("the answer of {base} broke off"))?
    {
        if body.len().saturating_add(chunk.len()) > max {
            bail!(
                "the answer of {base} is larger than {} MiB: is it a Work on Repeat server?",
                max >> 20
            );
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// How long a request waits for its answer.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug)]
pub struct ApiClient {
    base: url::Url,
    /// `None` for the internal API, which takes no bearer credential.
    api_key: Option<String>,
    http: reqwest::Client,
    /// Certificates trusted beside the system's, for the event streams' own client too.
    trusted: Vec<reqwest::Certificate>,
    /// How this client is given them (`BY_FLAG_OR_VARIABLE` or `BY_VARIABLE`).
    trust_by: &'static str,
}

impl ApiClient {
    /// A client of `--server` presenting `WOR_API_KEY`; a key or URL it cannot use is a
    /// [`UsageError`].
    pub fn new(args: &ClientArgs) -> anyhow::Result<Self> {
        let api_key = match std::env::var(env::API_KEY) {
            Ok(key) => key,
            Err(std::env::VarError::NotPresent) => {
                return Err(usage(format!(
                    "{} is not set: export the key `wor init` printed",
                    env::API_KEY
                )));
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(usage(format!(
                    "{} is not a key: it holds bytes that are not text; export the key `wor init` printed",
                    env::API_KEY
                )));
            }
        };
        // A key is one token of visible ASCII; anything else cannot be sent as a header, and
        // would fail later as if the server could not be reached.
        if api_key.is_empty() || !api_key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(usage(format!(
                "{} is not a key: it is empty or holds spaces, line breaks or other characters a key never has",
                env::API_KEY
            )));
        }
        Self::build(
            &args.server,
            Some(api_key),
            REQUEST_TIMEOUT,
            trusted_certificates(ca_cert_file(args.ca_cert.as_deref()).as_deref(), GIVEN)?,
            BY_FLAG_OR_VARIABLE,
        )
    }

    /// A client of the server at `server` presenting `api_key`, trusting the system's
    /// certificates only.
    pub fn with_key(server: &str, api_key: String) -> anyhow::Result<Self> {
        Self::build(
            server,
            Some(api_key),
            REQUEST_TIMEOUT,
            Vec::new(),
            BY_FLAG_OR_VARIABLE,
        )
    }

    /// A client that sends no key: for the internal API's enrolment, proven by its token;
    /// trusting the certificates of `ca_cert` (else `WOR_CA_CERT`) beside the system's.
    pub fn without_key(server: &str, ca_cert: Option<&std::path::Path>) -> anyhow::Result<Self> {
        Self::build(
            server,
            None,
            REQUEST_TIMEOUT,
            trusted_certificates(ca_cert_file(ca_cert).as_deref(), GIVEN)?,
            BY_FLAG_OR_VARIABLE,
        )
    }

    /// A client for a worker's signed requests: no key, and answers awaited for `timeout`, well
    /// within a run's lease; trusting the certificates of `WOR_CA_CERT`, else of `recorded`
    /// (the file its enrolment trusted), beside the system's.
    pub fn for_worker(
        server: &str,
        timeout: std::time::Duration,
        recorded: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        let trusted = match ca_cert_file(None) {
            Some(path) => trusted_certificates(Some(&path), env::CA_CERT)?,
            None => trusted_certificates(
                recorded,
                "the ca_cert the worker's enrolment recorded (worker-enrolment.json)",
            )?,
        };
        Self::build(server, None, timeout, trusted, BY_VARIABLE)
    }

    /// The file of certificates an enrolment trusts: `ca_cert`, else `WOR_CA_CERT`; as an
    /// absolute path, to be recorded for the worker.
    pub fn enrolment_ca_cert(
        ca_cert: Option<&std::path::Path>,
    ) -> anyhow::Result<Option<std::path::PathBuf>> {
        ca_cert_file(ca_cert)
            .map(|path| {
                std::path::absolute(&path)
                    .with_context(|| format!("cannot make {} an absolute path", path.display()))
            })
            .transpose()
    }

    fn build(
        server: &str,
        api_key: Option<String>,
        timeout: std::time::Duration,
        trusted: Vec<reqwest::Certificate>,
        trust_by: &'static str,
    ) -> anyhow::Result<Self> {
        let base = url::Url::parse(server)
            .map_err(|err| usage(format!("--server `{server}` is not a URL: {err}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(usage(
                "--server must be an http:// or https:// URL".to_owned(),
            ));
        }
        // A user name or password in the URL would go out as basic credentials, which the
        // server does not take: the API key is the one credential.
        if !base.username().is_empty() || base.password().is_some() {
            return Err(usage(
                "--server must not carry a user name or password: give the API key in WOR_API_KEY"
                    .to_owned(),
            ));
        }
        // The CLI talks to the operator's own server, at an address the operator typed; it is
        // not egress chosen by a routine, so it does not go through the egress guard.
        #[expect(
            clippy::disallowed_methods,
            reason = "the API client reaches the operator's own server, not a routine-chosen destination"
        )]
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timeout)
            .tls_certs_merge(trusted.iter().cloned())
            .build()
            .context("cannot build the HTTP client")?;
        Ok(ApiClient {
            base,
            api_key,
            http,
            trusted,
            trust_by,
        })
    }

    /// `path` (from `/`, with its query) under the server's URL, whose own path is kept: a
    /// server a proxy serves at `https://host/wor/` is asked at `/wor/v1/…`. The URL is set
    /// part by part, never parsed again: a path of the server's that begins `//` must not
    /// read as another host.
    fn url(&self, path: &str) -> url::Url {
        let (path, query) = match path.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (path, None),
        };
        let mut url = self.base.clone();
        let prefix = self.base.path().trim_end_matches('/');
        url.set_path(&format!("{prefix}{path}"));
        url.set_query(query);
        url.set_fragment(None);
        url
    }

    /// How this client is given certificates to trust, and whether it was.
    fn trust(&self) -> Trust {
        Trust {
            by: self.trust_by,
            given: !self.trusted.is_empty(),
        }
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.send(Method::GET, path, None, None)
            .await
            .map(|(_, value)| value)
    }

    pub async fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        self.send(Method::POST, path, Some(body), None)
            .await
            .map(|(_, value)| value)
    }

    /// POSTs `body` to `path` under idempotency key `key`, and says whether the answer is what
    /// an earlier request under the key did (status 200) rather than something new.
    pub async fn post_idempotent(
        &self,
        path: &str,
        body: &Value,
        key: &str,
    ) -> anyhow::Result<(Value, bool)> {
        let (status, value) = self.send(Method::POST, path, Some(body), Some(key)).await?;
        Ok((value, status == reqwest::StatusCode::OK))
    }

    /// POSTs `body` as JSON to `path` with `headers` (a worker's signature) and returns the
    /// answer's status and body as they are, for the caller to read.
    pub async fn post_bytes(
        &self,
        path: &str,
        body: Vec<u8>,
        headers: &[(&'static str, String)],
    ) -> anyhow::Result<(u16, Vec<u8>)> {
        let url = self.url(path);
        let mut request = self
            .http
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let response = request
            .send()
            .await
            .map_err(|error| unreachable(&self.base, error, self.trust()))?;
        let status = response.status().as_u16();
        Ok((
            status,
            read_capped(response, &self.base, MAX_CONTROL_PLANE_ANSWER_BYTES).await?,
        ))
    }

    pub async fn put(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        self.send(Method::PUT, path, Some(body), None)
            .await
            .map(|(_, value)| value)
    }

    pub async fn patch(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        self.send(Method::PATCH, path, Some(body), None)
            .await
            .map(|(_, value)| value)
    }

    pub async fn delete(&self, path: &str) -> anyhow::Result<Value> {
        self.send(Method::DELETE, path, None, None)
            .await
            .map(|(_, value)| value)
    }

    /// Reads a server-sent event stream to its end, calling `on_event` with each event's name
    /// and JSON data.
    pub async fn events(
        &self,
        path: &str,
        mut on_event: impl FnMut(&str, Value),
    ) -> anyhow::Result<()> {
        let url = self.url(path);
        // The event stream lives as long as the run: no total timeout, only the connect one.
        #[expect(
            clippy::disallowed_methods,
            reason = "the API client reaches the operator's own server, not a routine-chosen destination"
        )]
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(std::time::Duration::from_secs(10))
            .tls_certs_merge(self.trusted.iter().cloned())
            .build()
            .context("cannot build the HTTP client")?;
        let mut request = http.get(url);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let mut response = request
            .send()
            .await
            .map_err(|error| unreachable(&self.base, error, self.trust()))?;
        if !response.status().is_success() {
            let status = response.status();
            let value: Value = read_capped(response, &self.base, MAX_ANSWER_BYTES)
                .await
                .ok()
                .and_then(|body| serde_json::from_slice(&body).ok())
                .unwrap_or(Value::Null);
            let message = value
                .pointer("/error/message")
                .and_then(|v| v.as_str())
                .unwrap_or("no message");
            let code = value
                .pointer("/error/code")
                .and_then(|v| v.as_str())
                .unwrap_or("unknown");
            return Err(answer_error(
                status,
                code,
                format!("{message} (HTTP {})", status.as_u16()),
            ));
        }
        // Bytes until a whole line is in: a chunk may end inside a multi-byte character.
        let mut buffer: Vec<u8> = Vec::new();
        let (mut name, mut data) = (String::new(), String::new());
        while let Some(chunk) = response.chunk().await.with_context(|| {
            format!(
                "the event stream from {} broke off (the server may be stopping); follow again \
                 with `wor run follow`",
                self.base
            )
        })? {
            buffer.extend_from_slice(&chunk);
            if buffer.len() > MAX_EVENT_BYTES || data.len() > MAX_EVENT_BYTES {
                bail!(
                    "the event stream from {} sent an event larger than {} MiB",
                    self.base,
                    MAX_EVENT_BYTES >> 20
                );
            }
            while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
                let raw: Vec<u8> = buffer.drain(..=end).collect();
                let text = String::from_utf8_lossy(&raw);
                let line = text.trim_end_matches(['\r', '\n']);
                if line.is_empty() {
                    if !data.is_empty() {
                        on_event(&name, serde_json::from_str(&data).unwrap_or(Value::Null));
                    }
                    name.clear();
                    data.clear();
                } else if let Some(value) = line.strip_prefix("event:") {
                    name = value.trim().to_owned();
                } else if let Some(value) = line.strip_prefix("data:") {
                    data.push_str(value.trim_start());
                }
            }
        }
        Ok(())
    }

    /// Sends one request, with `idempotency_key` as its `Idempotency-Key` when given, and
    /// returns a successful answer's status and body.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        idempotency_key: Option<&str>,
    ) -> anyhow::Result<(reqwest::StatusCode, Value)> {
        let url = self.url(path);
        let mut request = self.http.request(method, url.clone());
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body.filter(|b| !b.is_null()) {
            request = request.json(body);
        }
        if let Some(key) = idempotency_key {
            request = request.header(wor_server::routes::runs::IDEMPOTENCY_KEY, key);
        }
        let response = request
            .send()
            .await
            .map_err(|error| unreachable(&self.base, error, self.trust()))?;
        let status = response.status();
        let body = read_capped(response, &self.base, MAX_ANSWER_BYTES).await?;
        // Every answer of the API, success or error, is a JSON body: one without is not from
        // a Work on Repeat server (a wrong --server, a proxy's page), whatever its status.
        let value: Value = serde_json::from_slice(&body).map_err(|_| {
            anyhow::anyhow!(
                "{} answered {status} without a JSON body: is --server ({}) a Work on Repeat server?",
                self.base,
                env::SERVER
            )
        })?;
        if status.is_success() {
            return Ok((status, value));
        }
        let code = value
            .pointer("/error/code")
            .and_then(|v| v.as_str())
            .unwrap_or("unknown");
        let message = value
            .pointer("/error/message")
            .and_then(|v| v.as_str())
            .unwrap_or("no message");
        Err(answer_error(
            status,
            code,
            format!("{message} ({code}, HTTP {})", status.as_u16()),
        ))
    }
}
