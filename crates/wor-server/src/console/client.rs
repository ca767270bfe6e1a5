//! Who is at the other end of a console request, for the per-address sign-in limit.
//!
//! The client is the connecting peer, unless the peer is one of the operator's trusted
//! proxies: then `X-Forwarded-For` is read from the right, skipping trusted proxies, and the
//! first address that is not one is the client. A header from any other peer is ignored, so a
//! client cannot pick the address its failures count against. IPv6 clients are counted by
//! their /64, the smallest block a single host is commonly given.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use axum::extract::ConnectInfo;
use axum::http::HeaderMap;
use axum::http::request::Parts;
use ipnet::IpNet;

/// The header a trusted proxy names the client in.
const FORWARDED_FOR: &str = "x-forwarded-for";

/// A console client's address, as far as the server can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddress(Option<IpAddr>);

impl ClientAddress {
    /// The client of the request in `parts`, trusting `X-Forwarded-For` only from `trusted`.
    pub fn of(parts: &Parts, trusted: &[IpNet]) -> Self {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip());
        Self(peer.map(|peer| resolve(peer, &parts.headers, trusted)))
    }

    /// The address as text, for the audit entry.
    pub fn text(&self) -> String {
        self.0
            .map(|ip| ip.to_string())
            .unwrap_or_else(|| "unknown".to_owned())
    }

    /// What failures are counted against: an IPv4 address, or an IPv6 address's /64.
    pub fn lockout_key(&self) -> String {
        match self.0 {
            Some(IpAddr::V4(v4)) => v4.to_string(),
            Some(IpAddr::V6(v6)) => {
                let [a, b, c, d, ..] = v6.segments();
                format!("{}/64", Ipv6Addr::new(a, b, c, d, 0, 0, 0, 0))
            }
            None => "unknown".to_owned(),
        }
    }
}

/// An IPv4-mapped IPv6 address is its IPv4 address: one client, one key.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn resolve(peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|net| net.contains(&ip));
    let mut client = canonical(peer);
    if !is_trusted(client) {
        return client;
    }
    // Every header line, every comma-separated hop, read from the nearest hop outwards.
    let hops: Vec<&str> = headers
        .get_all(FORWARDED_FOR)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .collect();
    for hop in hops.iter().rev() {
        // A hop that is not an address ends what can be believed: the last proxy is the client.
        let Ok(ip) = hop.trim().parse::<IpAddr>() else {
            break;
        };
        client = canonical(ip);
        if !is_trusted(client) {
            break;
        }
    }
    client
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;
    use axum::http::HeaderValue;

    fn client(peer: &str, forwarded: &[&str], trusted: &[&str]) -> ClientAddress {
        let mut headers = HeaderMap::new();
        for value in forwarded {
            headers.append(FORWARDED_FOR, HeaderValue::from_str(value).unwrap());
        }
        let trusted: Vec<IpNet> = trusted.iter().map(|n| n.parse().unwrap()).collect();
        ClientAddress(Some(resolve(peer.parse().unwrap(), &headers, &trusted)))
    }

    #[test]
    fn the_peer_is_the_client_unless_it_is_a_trusted_proxy() {
        let untrusted = client("203.0.113.9", &["198.51.100.1"], &[]);
        assert_eq!(
            untrusted.text(),
            "203.0.113.9",
            "a client's header is ignored"
        );
        let behind = client("10.0.0.2", &["198.51.100.1"], &["10.0.0.0/8"]);
        assert_eq!(behind.text(), "198.51.100.1");
    }

    #[test]
    fn forwarded_hops_are_read_from_the_right_past_trusted_proxies_only() {
        // The leftmost entry is whatever the client wrote; the proxies appended the rest.
        let chain = client(
            "10.0.0.2",
            &["6.6.6.6, 198.51.100.7", "10.0.0.3"],
            &["10.0.0.0/8"],
        );
        assert_eq!(chain.text(), "198.51.100.7");
        let garbage = client("10.0.0.2", &["6.6.6.6, not-an-address"], &["10.0.0.0/8"]);
        assert_eq!(
            garbage.text(),
            "10.0.0.2",
            "an unreadable hop stops the walk"
        );
        let only_proxies = client("10.0.0.2", &[], &["10.0.0.0/8"]);
        assert_eq!(only_proxies.text(), "10.0.0.2");
    }

    #[test]
    fn ipv6_clients_count_by_their_64_and_mapped_ipv4_as_ipv4() {
        let a = client("2001:db8:1:2:aaaa::1", &[], &[]);
        let b = client("2001:db8:1:2:bbbb::9", &[], &[]);
        let other = client("2001:db8:1:3::1", &[], &[]);
        assert_eq!(a.lockout_key(), "2001:db8:1:2::/64");
        assert_eq!(a.lockout_key(), b.lockout_key());
        assert_ne!(a.lockout_key(), other.lockout_key());
        assert_eq!(
            a.text(),
            "2001:db8:1:2:aaaa::1",
            "the audit keeps the address"
        );
        let mapped = client("::ffff:192.0.2.5", &[], &[]);
        assert_eq!(mapped.lockout_key(), "192.0.2.5");
    }
}
