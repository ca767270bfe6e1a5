//! Fuzzing the egress guard's URL and address checks with proptest, against an independent
//! oracle: arbitrary strings never panic the guard, and a URL whose literal or resolved address
//! is special-use by `std::net`'s and `ipnet`'s reckoning is always refused, whatever spelling
//! reaches it (IPv4 in decimal, octal, hex and short forms; IPv6 full, compressed, with a dotted
//! tail, IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo; userinfo, ports, percent-encoding).
//! When the guard allows a literal, it allows exactly the address the spelling means.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use ipnet::{Ipv4Net, Ipv6Net};
use proptest::prelude::*;
use wor_egress::{
    EgressDecision, EgressDenial, EgressPolicy, EgressUrl, GuardedResolver, StaticResolver,
    UrlRefusal, check,
};

// ---------------------------------------------------------------------------------------------
// The oracle: special-use by the standard library's own predicates and a few well-known blocks,
// written without looking at the guard's table.

fn v4net(text: &str) -> Ipv4Net {
    text.parse().unwrap()
}

fn v6net(text: &str) -> Ipv6Net {
    text.parse().unwrap()
}

fn oracle_special_v4(ip: Ipv4Addr) -> bool {
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_documentation()
        || ip.is_multicast()
        || [
            "0.0.0.0/8",      // this network
            "100.64.0.0/10",  // shared address space (carrier-grade NAT)
            "192.0.0.0/24",   // IETF protocol assignments
            "198.18.0.0/15",  // benchmarking
            "240.0.0.0/4",    // reserved
            "192.88.99.0/24", // 6to4 relay anycast
        ]
        .iter()
        .any(|net| v4net(net).contains(&ip))
}

fn oracle_special(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(ip) => oracle_special_v4(ip),
        IpAddr::V6(ip) => oracle_special_v6(ip),
    }
}

fn oracle_special_v6(ip: Ipv6Addr) -> bool {
    if let Some(inner) = ip.to_ipv4_mapped() {
        return oracle_special_v4(inner);
    }
    let bits = ip.to_bits();
    if v6net("64:ff9b::/96").contains(&ip) {
        return oracle_special_v4(Ipv4Addr::from_bits(bits as u32));
    }
    if v6net("2002::/16").contains(&ip) {
        return oracle_special_v4(Ipv4Addr::from_bits((bits >> 80) as u32));
    }
    ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || ip.is_unique_local()
        || ip.is_unicast_link_local()
        // IPv4-compatible (deprecated), NAT64 local use, IETF assignments (Teredo inside),
        // documentation, site-local; and everything outside global unicast 2000::/3.
        || [
            "::/96",
            "64:ff9b:1::/48",
            "2001::/23",
            "2001::/32",
            "2001:db8::/32",
            "3fff::/20",
            "fec0::/10",
        ]
        .iter()
        .any(|net| v6net(net).contains(&ip))
        || !v6net("2000::/3").contains(&ip)
}

#[test]
fn the_oracle_knows_the_obvious_cases() {
    for special in [
        "127.0.0.1",
        "10.1.2.3",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "::1",
        "::ffff:127.0.0.1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::",
        "2001::1",
        "fe80::1",
        "fd00::1",
    ] {
        assert!(oracle_special(special.parse().unwrap()), "{special}");
    }
    for public in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
        assert!(!oracle_special(public.parse().unwrap()), "{public}");
    }
}

// ---------------------------------------------------------------------------------------------
// The guard, as `wor egress check` and every send use it (development policy, nothing listed).

fn resolver(names: &[(String, IpAddr)]) -> GuardedResolver {
    let mut table = StaticResolver::new();
    for (name, ip) in names {
        table.insert(name, *ip);
    }
    GuardedResolver::new(Arc::new(table), Arc::new(EgressPolicy::development()))
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
}

fn decide(url: &str, names: &[(String, IpAddr)]) -> EgressDecision {
    RUNTIME.with(|runtime| runtime.block_on(check(url, None, &resolver(names))))
}

// ---------------------------------------------------------------------------------------------
// Generators.

/// IPv4 addresses, half of them in blocks an attacker aims at.
fn ipv4() -> impl Strategy<Value = Ipv4Addr> {
    let aimed = prop::sample::select(vec![
        ("127.0.0.0", 8),
        ("10.0.0.0", 8),
        ("172.16.0.0", 12),
        ("192.168.0.0", 16),
        ("169.254.0.0", 16),
        ("100.64.0.0", 10),
        ("0.0.0.0", 8),
        ("224.0.0.0", 4),
        ("240.0.0.0", 4),
        ("192.0.0.0", 24),
        ("198.18.0.0", 15),
        ("192.0.2.0", 24),
    ]);
    prop_oneof![
        any::<u32>().prop_map(Ipv4Addr::from_bits),
        (aimed, any::<u32>()).prop_map(|((base, len), host)| {
            let base = base.parse::<Ipv4Addr>().unwrap().to_bits();
            let mask = u32::MAX.checked_shr(len).unwrap_or(0);
            Ipv4Addr::from_bits(base | (host & mask))
        }),
        Just(Ipv4Addr::new(169, 254, 169, 254)),
        Just(Ipv4Addr::new(8, 8, 8, 8)),
    ]
}

/// One number in the radix an IPv4 spelling may use: decimal, octal (`0` prefix), hex (`0x`).
fn number(value: u64, radix: u8, extra_zeros: usize, upper: bool) -> String {
    match radix {
        0 => value.to_string(),
        1 => format!("0{}{value:o}", "0".repeat(extra_zeros)),
        _ => {
            let digits = format!("{}{value:x}", "0".repeat(extra_zeros));
            if upper {
                format!("0X{}", digits.to_uppercase())
            } else {
                format!("0x{digits}")
            }
        }
    }
}

/// A spelling of `ip` as a WHATWG URL host: 1 to 4 parts, the last taking the remaining bytes,
/// each part in its own radix; maybe a trailing dot.
fn ipv4_spelling(ip: Ipv4Addr) -> impl Strategy<Value = String> {
    (
        1usize..=4,
        prop::collection::vec((0u8..3, 0usize..3, any::<bool>()), 4),
        any::<bool>(),
    )
        .prop_map(move |(parts, radixes, trailing_dot)| {
            let octets = ip.octets();
            let mut out = Vec::new();
            for (index, (radix, zeros, upper)) in radixes.iter().take(parts).enumerate() {
                let value = if index + 1 < parts {
                    u64::from(octets[index])
                } else {
                    octets[index..]
                        .iter()
                        .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte))
                };
                out.push(number(value, *radix, *zeros, *upper));
            }
            let mut host = out.join(".");
            if trailing_dot {
                host.push('.');
            }
            host
        })
}

/// IPv6 addresses: random, and every form that carries an IPv4 address, plus Teredo and the
/// local ranges.
fn ipv6() -> impl Strategy<Value = Ipv6Addr> {
    let with_v4 =
        |prefix: u128| move |v4: Ipv4Addr| Ipv6Addr::from_bits(prefix | u128::from(v4.to_bits()));
    prop_oneof![
        any::<u128>().prop_map(Ipv6Addr::from_bits),
        ipv4().prop_map(with_v4(0xffff_0000_0000)),
        ipv4().prop_map(with_v4(0)),
        ipv4().prop_map(with_v4(0x0064_ff9b_u128 << 96)),
        (ipv4(), any::<u128>()).prop_map(|(v4, rest)| Ipv6Addr::from_bits(
            (0x2002_u128 << 112) | (u128::from(v4.to_bits()) << 80) | (rest & ((1 << 80) - 1))
        )),
        (any::<u32>(), any::<u64>()).prop_map(|(server, client)| Ipv6Addr::from_bits(
            (0x2001_0000_u128 << 96) | (u128::from(server) << 64) | u128::from(client)
        )),
        (
            prop::sample::select(vec![
                (0xfc00_u128, 7u32),
                (0xfe80, 10),
                (0xff00, 8),
                (0xfec0, 10)
            ]),
            any::<u128>()
        )
            .prop_map(|((top, len), rest)| {
                let prefix = top << 112;
                let mask = u128::MAX >> len;
                Ipv6Addr::from_bits(prefix | (rest & mask))
            }),
        Just(Ipv6Addr::LOCALHOST),
        Just(Ipv6Addr::UNSPECIFIED),
    ]
}

/// A spelling of `ip` inside brackets: compressed, full with leading zeros, either case, or
/// with the last 32 bits as a dotted IPv4 tail.
fn ipv6_spelling(ip: Ipv6Addr) -> impl Strategy<Value = String> {
    (0u8..3, any::<bool>()).prop_map(move |(form, upper)| {
        let text = match form {
            0 => ip.to_string(),
            1 => ip
                .segments()
                .iter()
                .map(|s| format!("{s:04x}"))
                .collect::<Vec<_>>()
                .join(":"),
            _ => {
                let s = ip.segments();
                let tail = Ipv4Addr::from_bits(ip.to_bits() as u32);
                format!(
                    "{:x}:{:x}:{:x}:{:x}:{:x}:{:x}:{tail}",
                    s[0], s[1], s[2], s[3], s[4], s[5]
                )
            }
        };
        let text = if upper { text.to_uppercase() } else { text };
        format!("[{text}]")
    })
}

/// Percent-encodes the characters of `host` chosen by `mask` (the WHATWG parser decodes a
/// host before reading it as an address).
fn percent_encode(host: &str, mask: u64) -> String {
    host.chars()
        .enumerate()
        .map(|(index, c)| {
            if mask >> (index % 64) & 1 == 1 && c.is_ascii_alphanumeric() {
                format!("%{:02X}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The rest of a URL around a host: scheme in any case, maybe a port, a path, a query, a
/// fragment (which may hold `@`, not userinfo there).
#[derive(Debug, Clone)]
struct Around {
    scheme: &'static str,
    port: Option<u16>,
    tail: String,
}

fn around() -> impl Strategy<Value = Around> {
    (
        prop::sample::select(vec!["http", "https", "HTTP", "hTTpS"]),
        prop::option::of(1u16..),
        "(/[a-z0-9@%.]{0,8}){0,3}(\\?[a-z=&@]{0,8})?(#[a-z@]{0,6})?",
    )
        .prop_map(|(scheme, port, tail)| Around { scheme, port, tail })
}

impl Around {
    fn url(&self, host: &str) -> String {
        let port = self.port.map(|p| format!(":{p}")).unwrap_or_default();
        format!("{}://{host}{port}{}", self.scheme, self.tail)
    }
}

// ---------------------------------------------------------------------------------------------
// The verdicts.

/// Whatever a URL is, an allowed one goes only to addresses the oracle finds ordinary.
fn assert_allowed_only_public(url: &str, decision: &EgressDecision) -> Result<(), TestCaseError> {
    if let EgressDecision::Allow(addrs) = decision {
        for ip in addrs {
            prop_assert!(
                !oracle_special(*ip),
                "`{url}` was allowed to `{ip}`, a special-use address"
            );
        }
    }
    Ok(())
}

/// A literal host: special means refused; allowed means exactly this address; an address
/// refusal names this address.
fn assert_literal_verdict(
    url: &str,
    ip: IpAddr,
    decision: &EgressDecision,
) -> Result<(), TestCaseError> {
    match decision {
        EgressDecision::Allow(addrs) => {
            prop_assert!(!oracle_special(ip), "`{url}` ({ip}) was allowed");
            prop_assert_eq!(addrs, &vec![ip], "`{}` was allowed to another address", url);
        }
        EgressDecision::Deny(EgressDenial::Address { ip: refused, .. }) => {
            prop_assert_eq!(*refused, ip, "`{}` was read as another address", url);
        }
        EgressDecision::Deny(_) => {}
    }
    Ok(())
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(2000))]

    /// Any text at all: the parser and the guard answer, never panic, and never allow a
    /// special-use address.
    #[test]
    fn arbitrary_text_never_panics_the_guard(input in any::<String>()) {
        let _ = EgressUrl::parse(&input);
        let decision = decide(&input, &[]);
        assert_allowed_only_public(&input, &decision)?;
    }

    /// Text shaped like a URL, with the characters that matter to authority parsing.
    #[test]
    fn url_shaped_text_never_allows_a_special_address(
        input in "(?i)(https?|ftp|file|gopher|x)?:[/\\\\]{0,3}[a-z0-9.:@%\\[\\]\\\\/?#x-]{0,40}"
    ) {
        let decision = decide(&input, &[]);
        assert_allowed_only_public(&input, &decision)?;
    }

    /// Every IPv4 spelling: decimal, octal, hex, short forms, trailing dot, upper case.
    #[test]
    fn every_ipv4_spelling_is_judged_by_the_address_it_means(
        (ip, host) in ipv4().prop_flat_map(|ip| (Just(ip), ipv4_spelling(ip))),
        around in around(),
    ) {
        let url = around.url(&host);
        let decision = decide(&url, &[]);
        assert_literal_verdict(&url, IpAddr::V4(ip), &decision)?;
        if !oracle_special_v4(ip) {
            // A valid spelling of an ordinary address is read, not refused as malformed.
            prop_assert!(
                !matches!(decision, EgressDecision::Deny(EgressDenial::Url(_))),
                "`{url}` ({ip}) was refused as a url: {decision}"
            );
        }
    }

    /// The same with parts of the host percent-encoded.
    #[test]
    fn percent_encoded_ipv4_hosts_are_judged_by_the_address_they_mean(
        (ip, host) in ipv4().prop_flat_map(|ip| (Just(ip), ipv4_spelling(ip))),
        mask in any::<u64>(),
        around in around(),
    ) {
        let url = around.url(&percent_encode(&host, mask));
        let decision = decide(&url, &[]);
        assert_literal_verdict(&url, IpAddr::V4(ip), &decision)?;
    }

    /// Every IPv6 form, those carrying an IPv4 address included.
    #[test]
    fn every_ipv6_form_is_judged_by_the_address_it_means(
        (ip, host) in ipv6().prop_flat_map(|ip| (Just(ip), ipv6_spelling(ip))),
        around in around(),
    ) {
        let url = around.url(&host);
        let decision = decide(&url, &[]);
        assert_literal_verdict(&url, IpAddr::V6(ip), &decision)?;
        if !oracle_special_v6(ip) {
            prop_assert!(
                !matches!(decision, EgressDecision::Deny(EgressDenial::Url(_))),
                "`{url}` ({ip}) was refused as a url: {decision}"
            );
        }
    }

    /// Userinfo of any shape in front of any host is refused, whatever follows it.
    #[test]
    fn userinfo_is_always_refused(
        user in "[a-z0-9.:%@]{0,8}",
        ip in ipv4(),
        around in around(),
    ) {
        let url = around.url(&format!("{user}@{ip}"));
        let decision = decide(&url, &[]);
        prop_assert!(
            matches!(decision, EgressDecision::Deny(EgressDenial::Url(_))),
            "`{url}` was not refused as a url: {decision}"
        );
    }

    /// A name resolving to several answers is refused when any one of them is special.
    #[test]
    fn a_name_is_refused_when_any_answer_is_special(
        answers in prop::collection::vec(
            prop_oneof![ipv4().prop_map(IpAddr::V4), ipv6().prop_map(IpAddr::V6)], 1..4),
        around in around(),
    ) {
        let name = "service.example".to_owned();
        let table: Vec<(String, IpAddr)> = answers.iter().map(|ip| (name.clone(), *ip)).collect();
        let url = around.url(&name);
        let decision = decide(&url, &table);
        if answers.iter().any(|ip| oracle_special(*ip)) {
            prop_assert!(
                matches!(decision, EgressDecision::Deny(EgressDenial::Address { .. })),
                "`{url}` resolving to {answers:?} was not refused: {decision}"
            );
        }
        assert_allowed_only_public(&url, &decision)?;
    }
}

/// Port 0 and ports past 65535 are refused, not wrapped.
#[test]
fn out_of_range_ports_are_refused() {
    for url in [
        "http://8.8.8.8:0/",
        "http://8.8.8.8:65536/",
        "http://8.8.8.8:4294967376/",
    ] {
        assert!(
            matches!(
                decide(url, &[]),
                EgressDecision::Deny(EgressDenial::Url(
                    UrlRefusal::PortZero | UrlRefusal::Invalid(_)
                ))
            ),
            "{url}"
        );
    }
}
