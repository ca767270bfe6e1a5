//! The sandbox's way out: a tiny HTTP `CONNECT` proxy applying the guard's rules.
//!
//! A sandboxed process has no route anywhere; its `HTTPS_PROXY` points at a listener inside
//! its own network namespace that this proxy accepts on. Each `CONNECT host:port` is vetted
//! exactly like a request of [`crate::EgressClient`] ([`crate::check`]: URL shape, the
//! connection's [`HostAllowlist`], every resolved address against the policy, pinned by the
//! [`GuardedResolver`]); only then is one of the validated addresses dialled, and bytes are
//! copied both ways. Anything else (other methods, malformed requests, refusals) gets an
//! error status and the connection is closed: a refused destination is never dialled.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::check::{EgressDecision, check};
use crate::policy::{EgressDenial, HostAllowlist};
use crate::resolver::GuardedResolver;

/// Largest request head accepted.
const MAX_HEAD: usize = 8 * 1024;

/// What became of one proxied connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyOutcome {
    /// The tunnel ran to this validated address until either side closed.
    Tunnelled(SocketAddr),
    /// The guard refused the destination; nothing was dialled.
    Refused(EgressDenial),
    /// Not a well-formed `CONNECT host:port` request; nothing was dialled.
    BadRequest(String),
    /// Every validated address refused the connection or timed out.
    Unreachable(String),
}

/// The proxy for one sandboxed process: its allowlist and the server's guarded resolver.
#[derive(Debug, Clone)]
pub struct ConnectProxy {
    resolver: Arc<GuardedResolver>,
    allowlist: HostAllowlist,
    connect_timeout: Duration,
    head_timeout: Duration,
    tunnels: Arc<Semaphore>,
}

impl ConnectProxy {
    /// A proxy allowing only `allowlist`, resolving through `resolver`.
    pub fn new(resolver: Arc<GuardedResolver>, allowlist: HostAllowlist) -> Self {
        Self {
            resolver,
            allowlist,
            connect_timeout: Duration::from_secs(10),
            head_timeout: Duration::from_secs(10),
            tunnels: Arc::new(Semaphore::new(64)),
        }
    }

    /// Accepts connections until the task is dropped or the listener fails.
    pub async fn serve(self, listener: TcpListener) {
        let proxy = Arc::new(self);
        while let Ok((stream, _)) = listener.accept().await {
            let Ok(permit) = proxy.tunnels.clone().acquire_owned().await else {
                return;
            };
            let proxy = proxy.clone();
            tokio::spawn(async move {
                let _ = proxy.handle(stream).await;
                drop(permit);
            });
        }
    }

    /// Serves one client connection.
    pub async fn handle(&self, mut client: TcpStream) -> std::io::Result<ProxyOutcome> {
        let (authority, leftover) =
            match tokio::time::timeout(self.head_timeout, read_head(&mut client)).await {
                Ok(Ok(parsed)) => parsed,
                Ok(Err(reason)) => {
                    let status = if reason.starts_with("method") {
                        "405 Method Not Allowed"
                    } else {
                        "400 Bad Request"
                    };
                    respond(&mut client, status, &reason).await?;
                    return Ok(ProxyOutcome::BadRequest(reason));
                }
                Err(_) => return Ok(ProxyOutcome::BadRequest("request head timed out".into())),
            };
        let Some(port) = authority
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
        else {
            let reason = "connect target must be host:port".to_owned();
            respond(&mut client, "400 Bad Request", &reason).await?;
            return Ok(ProxyOutcome::BadRequest(reason));
        };
        let addrs = match check(
            &format!("http://{authority}/"),
            Some(&self.allowlist),
            &self.resolver,
        )
        .await
        {
            EgressDecision::Allow(addrs) => addrs,
            EgressDecision::Deny(denial) => {
                crate::metrics::denied(&denial);
                respond(&mut client, "403 Forbidden", &denial.to_string()).await?;
                return Ok(ProxyOutcome::Refused(denial));
            }
        };
        let Some((mut upstream, addr)) = self.dial(&addrs, port).await else {
            let reason = format!("`{authority}` did not accept a connection");
            respond(&mut client, "502 Bad Gateway", &reason).await?;
            return Ok(ProxyOutcome::Unreachable(reason));
        };
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await?;
        upstream.write_all(&leftover).await?;
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        Ok(ProxyOutcome::Tunnelled(addr))
    }

    /// Dials the validated addresses in order.
    async fn dial(&self, addrs: &[IpAddr], port: u16) -> Option<(TcpStream, SocketAddr)> {
        for &ip in addrs {
            let addr = SocketAddr::new(ip, port);
            #[expect(
                clippy::disallowed_methods,
                reason = "the proxy dials only addresses the guard just validated"
            )]
            let connect = TcpStream::connect(addr);
            if let Ok(Ok(stream)) = tokio::time::timeout(self.connect_timeout, connect).await {
                return Some((stream, addr));
            }
        }
        None
    }
}

/// Reads `CONNECT authority HTTP/1.x` and the rest of the head; returns the authority and any
/// bytes read past the head.
async fn read_head(client: &mut TcpStream) -> Result<(String, Vec<u8>), String> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let end = loop {
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        if head.len() > MAX_HEAD {
            return Err("request head too large".into());
        }
        let read = client
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the request: {e}"))?;
        if read == 0 {
            return Err("connection closed before the request head ended".into());
        }
        head.extend_from_slice(chunk.get(..read).unwrap_or_default());
    };
    let text = std::str::from_utf8(head.get(..end).unwrap_or_default())
        .map_err(|_| "request head is not utf-8".to_owned())?;
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(authority), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("malformed request line".into());
    };
    if method != "CONNECT" {
        return Err(format!("method `{method}` is not supported, only CONNECT"));
    }
    if !version.starts_with("HTTP/1.") {
        return Err("only HTTP/1.x is supported".into());
    }
    if authority.is_empty()
        || authority
            .chars()
            .any(|c| matches!(c, '/' | '\\' | '@' | '?' | '#' | '%') || c.is_whitespace())
    {
        return Err("connect target must be a plain host:port".into());
    }
    let leftover = head
        .get(end.saturating_add(4)..)
        .unwrap_or_default()
        .to_vec();
    Ok((authority.to_owned(), leftover))
}

async fn respond(client: &mut TcpStream, status: &str, reason: &str) -> std::io::Result<()> {
    let body = format!("{reason}\n");
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    client.write_all(response.as_bytes()).await?;
    client.shutdown().await
}
