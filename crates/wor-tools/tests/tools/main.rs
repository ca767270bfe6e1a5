//! End-to-end tests of the tool library, loopback only: the reference MCP server
//! (`@modelcontextprotocol/server-everything`, installed by `.ci/mcp-servers.sh`), a small
//! rmcp server of our own that changes its tools on demand, and plain HTTP servers that
//! record what reached them.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod everything;
mod http_tools;
mod mcp_fuzz;
mod oauth;
mod openapi;
mod own_server;
mod schemas;
mod stdio;

use std::net::SocketAddr;

use wor_egress::HostAllowlist;

/// The egress client every test uses.
pub use wor_egress::testing::loopback_egress;

/// An allowlist of exactly `addr`.
pub fn allow(addr: SocketAddr) -> HostAllowlist {
    HostAllowlist::parse([addr.to_string()]).unwrap()
}

/// Serves `router` on a fresh loopback port, its connections sending each write at once
/// (`TCP_NODELAY`), as `wor`'s own servers do.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(sending_at_once(listener), router)
            .await
            .unwrap();
    });
    addr
}

/// `listener`, its connections sending each write at once. A connection that cannot (its
/// peer already gone) is served all the same: a panic here would end the whole server.
#[expect(
    clippy::print_stderr,
    reason = "the test's output says why a connection may be slow"
)]
pub fn sending_at_once(
    listener: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    use axum::serve::ListenerExt as _;
    let tap: fn(&mut tokio::net::TcpStream) = |connection| {
        if let Err(error) = connection.set_nodelay(true) {
            eprintln!("a test server's connection cannot send at once: {error}");
        }
    };
    listener.tap_io(tap)
}
