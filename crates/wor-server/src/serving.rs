//! Serving a router on a listener's connections, with the bounds a public listener needs that
//! `axum::serve` does not set: a connection must send its request's headers within
//! [`HEADER_READ_TIMEOUT`], and at most [`MAX_CONNECTIONS`] are open at once (further ones
//! wait to be accepted). Open connections finish their requests when shutdown begins.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::serve::Listener;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{Semaphore, watch};

/// How long a connection may take to send a request's headers, the first or the next on a
/// connection kept alive: a client that sends them a byte at a time, or not at all, holds a
/// connection no longer.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a request's body may go without a byte arriving once its headers are in (a gap,
/// not a total: a body is also held to `MAX_BODY_BYTES`).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The most connections served at once; one more waits until one closes. Well below the
/// open-file limit the server's unit sets, so the database and tool connections always have
/// room.
pub const MAX_CONNECTIONS: usize = 8_192;

/// The bounds on a listener's connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Serves `router` on `listener`'s connections within `limits` until `shutdown` completes,
/// each request with its peer's address as [`ConnectInfo`]; then stops accepting, asks every
/// open connection to close once its request in flight is answered, and returns when all
/// have.
pub async fn serve_connections<L>(
    mut listener: L,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (closing, closed) = watch::channel(false);
    // Each connection's task, aborted with the set when this future is dropped (the drain's
    // grace having run out).
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                // The semaphore is never closed.
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let router = router.clone();
        let service =
            hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let mut request = request.map(axum::body::Body::new);
                request.extensions_mut().insert(ConnectInfo(peer));
                let router = router.clone();
                async move {
                    Ok::<_, Infallible>(
                        tower::ServiceExt::oneshot(router, request)
                            .await
                            .unwrap_or_else(|never| match never {}),
                    )
                }
            });
        let mut closing = closed.clone();
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            let connection = builder
                .serve_connection(TokioIo::new(io), service)
                .with_upgrades();
            tokio::pin!(connection);
            let mut asked = false;
            loop {
                tokio::select! {
                    served = connection.as_mut() => {
                        if let Err(error) = served {
                            tracing::debug!(category = "http", %error, "a connection ended with an error");
                        }
                        break;
                    }
                    changed = closing.changed(), if !asked => {
                        asked = true;
                        if changed.is_ok() {
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop(permit);
            drop(closing);
        });
    }
    drop(listener);
    let _ = closing.send(true);
    drop(closed);
    while connections.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::disallowed_methods,
        reason = "tests fail loudly, and talk to their own server on loopback"
    )]

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    async fn served(limits: ConnectionLimits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        tokio::spawn(serve_connections(
            listener,
            router,
            limits,
            std::future::pending(),
        ));
        addr
    }

    /// What the server sends on `stream` until it closes it, or `None` if it has not within
    /// `within`.
    async fn read_to_close(stream: &mut TcpStream, within: Duration) -> Option<String> {
        let mut got = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut got))
            .await
            .ok()
            .map(|_| String::from_utf8_lossy(&got).into_owned())
    }

    #[tokio::test]
    async fn a_connection_that_does_not_finish_its_headers_is_closed() {
        let addr = served(ConnectionLimits {
            header_read_timeout: Duration::from_millis(300),
            max_connections: 16,
        })
        .await;
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let closed = read_to_close(&mut stalled, Duration::from_secs(5)).await;
        assert!(
            closed.is_some(),
            "a connection stalled in its headers stays open"
        );
        // A request that finishes its headers is answered.
        let mut prompt = TcpStream::connect(addr).await.unwrap();
        prompt
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_to_close(&mut prompt, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn connections_past_the_limit_wait_for_one_to_close() {
        let addr = served(ConnectionLimits {
            header_read_timeout: Duration::from_secs(30),
            max_connections: 2,
        })
        .await;
        let first = TcpStream::connect(addr).await.unwrap();
        let _second = TcpStream::connect(addr).await.unwrap();
        let mut third = TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        assert!(
            read_to_close(&mut third, Duration::from_millis(500))
                .await
                .is_none(),
            "a third connection was served beside two"
        );
        drop(first);
        let answer = read_to_close(&mut third, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
