//! [`EgressClient`]: the one outbound HTTP client, and the checks every request passes.
//!
//! Before a request leaves: the URL is parsed and vetted ([`crate::url`]), the connection's
//! allowlist consulted, an IP literal checked against the policy, a name resolved through the
//! [`GuardedResolver`]. The reqwest client resolves names only through that same guarded
//! resolver (pinned answers), so it connects to an address that was validated. It uses rustls,
//! no system proxy, follows no redirect (a 3xx comes back as the response), and enforces a
//! connect timeout, a total timeout and a response size cap while streaming the body.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::HeaderMap;
use reqwest::{Method, StatusCode};

use crate::policy::{EgressDenial, EgressPolicy, HostAllowlist};
use crate::resolver::{
    GuardedLookupError, GuardedResolver, NameResolver, ResolveError, SystemResolver,
};
use crate::url::{EgressHost, EgressUrl};

/// Total timeout for run webhook deliveries.
pub const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// Timeouts and size cap applied to every request unless the request overrides them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EgressLimits {
    /// Time allowed to open the TCP (and TLS) connection.
    pub connect_timeout: Duration,
    /// Time allowed from the start of the request to the end of the response body.
    pub total_timeout: Duration,
    /// Largest response body accepted.
    pub max_response_bytes: u64,
}

impl Default for EgressLimits {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            total_timeout: Duration::from_secs(60),
            max_response_bytes: 16 * 1024 * 1024,
        }
    }
}

impl EgressLimits {
    /// Run webhook delivery: 10 s total, a small response.
    pub fn webhook() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            total_timeout: WEBHOOK_TIMEOUT,
            max_response_bytes: 64 * 1024,
        }
    }
}

/// Something went wrong sending a request. A policy refusal is [`EgressError::Denied`].
#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    /// The guard refused the destination (boxed: denials carry the host and range).
    #[error("egress denied: {0}")]
    Denied(Box<EgressDenial>),
    /// The host name did not resolve.
    #[error("could not resolve `{host}`: {source}")]
    Resolve {
        /// The name.
        host: String,
        /// What went wrong.
        source: ResolveError,
    },
    /// The system resolver configuration could not be read.
    #[error("could not set up the system resolver: {0}")]
    ResolverSetup(ResolveError),
    /// No complete response within the total timeout.
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
    /// The response body is larger than allowed.
    #[error("response body exceeds the limit of {limit} bytes")]
    ResponseTooLarge {
        /// The limit that was exceeded.
        limit: u64,
    },
    /// The HTTP exchange failed (connection refused, TLS, protocol error). The URL is stripped
    /// from the message: it may carry credentials.
    #[error("request failed: {0}")]
    Request(#[source] reqwest::Error),
    /// The reqwest client could not be built.
    #[error("could not build the outbound client: {0}")]
    Build(#[source] reqwest::Error),
    /// No validated address of the host accepted a TCP connection in time.
    #[error("`{authority}` did not accept a connection")]
    Unreachable {
        /// `host:port`.
        authority: String,
    },
}

/// Why a model connection may not go without an API key.
#[derive(Debug, thiserror::Error)]
pub enum KeylessModelRefusal {
    /// The base URL is refused (outside every listed range) or cannot be resolved.
    #[error(
        "a model connection without an API key must reach an address the operator listed in `[egress] model_cidrs`: {0}"
    )]
    Egress(EgressError),
    /// The host is, or resolves to, an address outside `[egress] model_cidrs`.
    #[error(
        "a model connection without an API key must reach an address the operator listed in `[egress] model_cidrs`; `{host}` is {ip}"
    )]
    OutsideModelRange {
        /// The base URL's host.
        host: EgressHost,
        /// The first address outside the model ranges.
        ip: IpAddr,
    },
}

/// One request for [`EgressClient::send`].
#[derive(Debug, Clone)]
pub struct EgressRequest<'a> {
    /// The HTTP method.
    pub method: Method,
    /// The URL, vetted before anything else happens.
    pub url: &'a str,
    /// Headers, credentials included; never logged.
    pub headers: HeaderMap,
    /// The body, if any.
    pub body: Option<Vec<u8>>,
    /// The connection's host allowlist; `None` allows any host the policy allows.
    pub allowlist: Option<&'a HostAllowlist>,
    /// Overrides the client's total timeout.
    pub timeout: Option<Duration>,
    /// Overrides the client's response size cap.
    pub max_response_bytes: Option<u64>,
}

impl<'a> EgressRequest<'a> {
    /// A request with no headers, body, allowlist or overrides.
    pub fn new(method: Method, url: &'a str) -> Self {
        Self {
            method,
            url,
            headers: HeaderMap::new(),
            body: None,
            allowlist: None,
            timeout: None,
            max_response_bytes: None,
        }
    }

    /// A `GET`.
    pub fn get(url: &'a str) -> Self {
        Self::new(Method::GET, url)
    }

    /// A `POST` of `body`.
    pub fn post(url: &'a str, body: Vec<u8>) -> Self {
        Self {
            body: Some(body),
            ..Self::new(Method::POST, url)
        }
    }

    /// A run webhook delivery: a `POST` of `body` with the 10 s [`WEBHOOK_TIMEOUT`].
    pub fn webhook(url: &'a str, body: Vec<u8>) -> Self {
        Self {
            timeout: Some(WEBHOOK_TIMEOUT),
            ..Self::post(url, body)
        }
    }

    /// Restricts the request to `allowlist`.
    pub fn with_allowlist(self, allowlist: &'a HostAllowlist) -> Self {
        Self {
            allowlist: Some(allowlist),
            ..self
        }
    }
}

/// A complete response, body read up to the cap. Redirects arrive here as 3xx.
#[derive(Debug, Clone)]
pub struct EgressResponse {
    /// The status code.
    pub status: StatusCode,
    /// The response headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Vec<u8>,
}

/// The one outbound HTTP client. Cheap to clone; clones share the connection pool and pins.
#[derive(Debug, Clone)]
pub struct EgressClient {
    http: reqwest::Client,
    resolver: Arc<GuardedResolver>,
    limits: EgressLimits,
}

impl EgressClient {
    /// The client for `policy`, resolving through the system configuration, default limits.
    pub fn new(policy: EgressPolicy) -> Result<Self, EgressError> {
        let system = SystemResolver::from_system_conf().map_err(EgressError::ResolverSetup)?;
        Self::with_resolver(policy, Arc::new(system), EgressLimits::default())
    }

    /// The webhook-delivery client: system resolver, [`EgressLimits::webhook`].
    pub fn webhook(policy: EgressPolicy) -> Result<Self, EgressError> {
        let system = SystemResolver::from_system_conf().map_err(EgressError::ResolverSetup)?;
        Self::with_resolver(policy, Arc::new(system), EgressLimits::webhook())
    }

    /// The client for `policy`, resolving names through `resolver` (behind the guard).
    pub fn with_resolver(
        policy: EgressPolicy,
        resolver: Arc<dyn NameResolver>,
        limits: EgressLimits,
    ) -> Result<Self, EgressError> {
        let resolver = Arc::new(GuardedResolver::new(resolver, Arc::new(policy)));
        Self::with_guarded_resolver(resolver, limits)
    }

    /// The client for an already built guard (shares its pins).
    pub fn with_guarded_resolver(
        resolver: Arc<GuardedResolver>,
        limits: EgressLimits,
    ) -> Result<Self, EgressError> {
        let http = build_http(Arc::clone(&resolver), &limits).map_err(EgressError::Build)?;
        Ok(Self {
            http,
            resolver,
            limits,
        })
    }

    /// The limits applied when a request does not override them.
    pub fn limits(&self) -> EgressLimits {
        self.limits
    }

    /// The guarded resolver every connection resolves through.
    pub fn resolver(&self) -> &Arc<GuardedResolver> {
        &self.resolver
    }

    /// Vets `url` for a connection with `allowlist`: the shape of the URL, the allowlist, and
    /// every address the host is or resolves to. Makes no connection.
    pub async fn vet(
        &self,
        url: &str,
        allowlist: Option<&HostAllowlist>,
    ) -> Result<EgressUrl, EgressError> {
        vet(url, allowlist, &self.resolver)
            .await
            .map(|(url, _)| url)
    }

    /// Vets a destination saved now and reached later (a routine's `notify.url`) as far as can
    /// be done without a DNS lookup: the shape of the URL, and the address when the host is an
    /// IP literal or a localhost name, against this client's policy (with the operator's
    /// allowed CIDRs). Any other name is resolved and checked each time it is sent to.
    pub fn vet_destination(&self, url: &str) -> Result<EgressUrl, Box<EgressDenial>> {
        let url = EgressUrl::parse(url).map_err(|refusal| Box::new(refusal.into()))?;
        let addrs = match url.host() {
            EgressHost::Ip(ip) => vec![*ip],
            // What the resolver answers for them, whatever DNS says (RFC 6761).
            EgressHost::Name(name) if crate::resolver::is_localhost(name) => vec![
                IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
                IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            ],
            EgressHost::Name(_) => Vec::new(),
        };
        for ip in addrs {
            self.resolver.policy().check_address(ip).map_err(|range| {
                Box::new(EgressDenial::Address {
                    host: url.host().clone(),
                    ip,
                    range,
                })
            })?;
        }
        Ok(url)
    }

    /// Vets `url` as the base URL of a model connection that has no API key: it must pass this
    /// client's policy (the one for models) and the host must be, or resolve only to, addresses
    /// in the operator's `[egress] model_cidrs`. Makes no connection.
    pub async fn vet_keyless_model(&self, url: &str) -> Result<EgressUrl, KeylessModelRefusal> {
        let (url, addrs) = vet(url, None, &self.resolver)
            .await
            .map_err(KeylessModelRefusal::Egress)?;
        let policy = self.resolver.policy();
        match addrs.iter().find(|ip| !policy.is_model_address(**ip)) {
            Some(ip) => Err(KeylessModelRefusal::OutsideModelRange {
                host: url.host().clone(),
                ip: *ip,
            }),
            None => Ok(url),
        }
    }

    /// Opens a TCP connection to `host:port` for a protocol other than HTTP (SMTP): the
    /// destination is vetted exactly as a request's would be (the shape of the host, every
    /// address it resolves to against the policy, pinned by the guarded resolver), and only a
    /// validated address is dialled, within the connect timeout. Returns the stream and the
    /// address it reached. What is spoken over it, TLS included, is the caller's.
    pub async fn connect_tcp(
        &self,
        host: &str,
        port: u16,
    ) -> Result<(tokio::net::TcpStream, SocketAddr), EgressError> {
        let authority = match host.parse::<std::net::Ipv6Addr>() {
            Ok(_) => format!("[{host}]:{port}"),
            Err(_) => format!("{host}:{port}"),
        };
        let (_, addrs) = vet(&format!("https://{authority}/"), None, &self.resolver).await?;
        for ip in addrs {
            let addr = SocketAddr::new(ip, port);
            #[expect(
                clippy::disallowed_methods,
                reason = "the one dial of a non-HTTP protocol, to an address the guard just validated"
            )]
            let connect = tokio::net::TcpStream::connect(addr);
            if let Ok(Ok(stream)) = tokio::time::timeout(self.limits.connect_timeout, connect).await
            {
                return Ok((stream, addr));
            }
        }
        Err(EgressError::Unreachable { authority })
    }

    /// Sends `request` after vetting it, and reads the whole response body up to the cap.
    pub async fn send(&self, request: EgressRequest<'_>) -> Result<EgressResponse, EgressError> {
        let timeout = request.timeout.unwrap_or(self.limits.total_timeout);
        let limit = request
            .max_response_bytes
            .unwrap_or(self.limits.max_response_bytes);
        let exchange = async {
            let url = self.vet(request.url, request.allowlist).await?;
            let mut builder = self
                .http
                .request(request.method, url.as_url().clone())
                .headers(request.headers)
                .timeout(timeout);
            if let Some(body) = request.body {
                builder = builder.body(body);
            }
            let mut response = builder.send().await.map_err(|e| from_reqwest(e, timeout))?;
            if response.content_length().is_some_and(|len| len > limit) {
                return Err(EgressError::ResponseTooLarge { limit });
            }
            let mut body = Vec::new();
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| from_reqwest(e, timeout))?
            {
                let len = u64::try_from(body.len().saturating_add(chunk.len())).unwrap_or(u64::MAX);
                if len > limit {
                    return Err(EgressError::ResponseTooLarge { limit });
                }
                body.extend_from_slice(&chunk);
            }
            Ok(EgressResponse {
                status: response.status(),
                headers: response.headers().clone(),
                body,
            })
        };
        let sent = tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or(Err(EgressError::Timeout(timeout)));
        sent.inspect_err(count_denial)
    }

    /// A request builder for streaming use (SSE, MCP over streamable HTTP), after vetting
    /// `url` exactly as [`EgressClient::send`] does. The builder's client is the guarded one
    /// (same resolver and pins, no redirects, no proxy, connect timeout); the total timeout and
    /// the size cap are the caller's to apply to the stream.
    pub async fn streaming_request(
        &self,
        method: Method,
        url: &str,
        allowlist: Option<&HostAllowlist>,
    ) -> Result<reqwest::RequestBuilder, EgressError> {
        let url = self.vet(url, allowlist).await.inspect_err(count_denial)?;
        Ok(self.http.request(method, url.as_url().clone()))
    }
}

/// Counts `error` in the metrics when it is the guard's refusal.
fn count_denial(error: &EgressError) {
    if let EgressError::Denied(denial) = error {
        crate::metrics::denied(denial);
    }
}

/// The URL, allowlist and address checks, in that order.
pub(crate) async fn vet(
    url: &str,
    allowlist: Option<&HostAllowlist>,
    resolver: &GuardedResolver,
) -> Result<(EgressUrl, Vec<IpAddr>), EgressError> {
    let url =
        EgressUrl::parse(url).map_err(|refusal| EgressError::Denied(Box::new(refusal.into())))?;
    if let Some(allowlist) = allowlist
        && !allowlist.allows(url.host(), url.port())
    {
        return Err(EgressError::Denied(Box::new(
            EgressDenial::HostNotAllowed {
                host: url.host().clone(),
                port: url.port(),
            },
        )));
    }
    let addrs = match url.host() {
        EgressHost::Ip(ip) => {
            resolver.policy().check_address(*ip).map_err(|range| {
                EgressError::Denied(Box::new(EgressDenial::Address {
                    host: url.host().clone(),
                    ip: *ip,
                    range,
                }))
            })?;
            vec![*ip]
        }
        EgressHost::Name(name) => resolver.resolve(name).await.map_err(from_lookup)?,
    };
    Ok((url, addrs))
}

fn from_lookup(error: GuardedLookupError) -> EgressError {
    match error {
        GuardedLookupError::Denied(denial) => EgressError::Denied(Box::new(denial)),
        GuardedLookupError::Resolve { host, source } => EgressError::Resolve { host, source },
    }
}

/// Maps a reqwest error, recovering a guard refusal raised inside reqwest's resolver.
fn from_reqwest(error: reqwest::Error, timeout: Duration) -> EgressError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(current) = source {
        if let Some(lookup) = current.downcast_ref::<GuardedLookupError>() {
            return from_lookup(lookup.clone());
        }
        source = current.source();
    }
    if error.is_timeout() {
        return EgressError::Timeout(timeout);
    }
    EgressError::Request(error.without_url())
}

/// reqwest's view of the guarded resolver.
#[derive(Debug)]
struct GuardedDns(Arc<GuardedResolver>);

impl reqwest::dns::Resolve for GuardedDns {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = Arc::clone(&self.0);
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = guard
                .resolve(&host)
                .await
                .map_err(|error| Box::new(error) as Box<dyn std::error::Error + Send + Sync>)?;
            // Port 0 is replaced by the URL's port.
            let addrs: reqwest::dns::Addrs =
                Box::new(addrs.into_iter().map(|ip| SocketAddr::new(ip, 0)));
            Ok(addrs)
        })
    }
}

#[expect(
    clippy::disallowed_methods,
    reason = "the egress guard is the one place that builds an outbound client"
)]
fn build_http(
    resolver: Arc<GuardedResolver>,
    limits: &EgressLimits,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .referer(false)
        .connect_timeout(limits.connect_timeout)
        .timeout(limits.total_timeout)
        .dns_resolver(GuardedDns(resolver))
        .build()
}
