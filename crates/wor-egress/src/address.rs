//! Classification of IP addresses against the IANA special-purpose address registries.
//!
//! One table holds every entry of the IANA IPv4 and IPv6 special-purpose address registries,
//! plus the multicast, reserved and deprecated blocks that sit outside them. The guard refuses
//! every address in the table, including the few entries the registry marks "globally
//! reachable" (anycast services such as AS112, AMT, PCP and TURN): none of them is a
//! destination an HTTP tool has any business reaching.
//!
//! IPv6 forms that carry an IPv4 address (IPv4-mapped, IPv4-compatible, NAT64, 6to4) are
//! classified by the IPv4 address they carry, so `::ffff:127.0.0.1` is named as loopback.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// A named range from the special-purpose registries, as matched by [`classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialRange {
    name: &'static str,
    net: IpNet,
    /// The IPv6 range that carried the IPv4 address, when the match came from an embedded
    /// IPv4 address (`::ffff:10.0.0.1` is "private-use 10.0.0.0/8 inside IPv4-mapped ...").
    carrier: Option<(&'static str, Ipv6Net)>,
}

impl SpecialRange {
    /// The registry's name for the range, lowercase (`loopback`, `private-use`, ...).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The range itself.
    pub fn net(&self) -> IpNet {
        self.net
    }

    /// When the address was an IPv6 form carrying an IPv4 address: that IPv6 range's name
    /// and prefix.
    pub fn carrier(&self) -> Option<(&'static str, Ipv6Net)> {
        self.carrier
    }
}

impl fmt::Display for SpecialRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.name, self.net)?;
        if let Some((name, net)) = self.carrier {
            write!(f, " (embedded in {name} {net})")?;
        }
        Ok(())
    }
}

struct Entry<N> {
    name: &'static str,
    net: N,
}

const fn v4(name: &'static str, a: u8, b: u8, c: u8, d: u8, len: u8) -> Entry<Ipv4Net> {
    Entry {
        name,
        net: Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len),
    }
}

const fn v6(name: &'static str, segments: [u16; 8], len: u8) -> Entry<Ipv6Net> {
    let [a, b, c, d, e, f, g, h] = segments;
    Entry {
        name,
        net: Ipv6Net::new_assert(Ipv6Addr::new(a, b, c, d, e, f, g, h), len),
    }
}

/// Where an IPv6 range carries an IPv4 address.
#[derive(Clone, Copy)]
enum Embedded {
    /// The last 32 bits (IPv4-mapped, IPv4-compatible, NAT64 with a /96 prefix).
    Last32 { public_ok: bool },
    /// Bits 16 to 48 (6to4, RFC 3056).
    SixToFour,
}

struct V6Entry {
    entry: Entry<Ipv6Net>,
    embedded: Option<Embedded>,
}

const fn plain(entry: Entry<Ipv6Net>) -> V6Entry {
    V6Entry {
        entry,
        embedded: None,
    }
}

const fn carrying(entry: Entry<Ipv6Net>, embedded: Embedded) -> V6Entry {
    V6Entry {
        entry,
        embedded: Some(embedded),
    }
}

/// The IANA IPv4 special-purpose address registry, with multicast (224.0.0.0/4) added.
const IPV4_TABLE: &[Entry<Ipv4Net>] = &[
    v4("this network", 0, 0, 0, 0, 8),
    v4("this host on this network", 0, 0, 0, 0, 32),
    v4("private-use", 10, 0, 0, 0, 8),
    v4("shared address space", 100, 64, 0, 0, 10),
    v4("loopback", 127, 0, 0, 0, 8),
    v4("link-local", 169, 254, 0, 0, 16),
    v4("private-use", 172, 16, 0, 0, 12),
    v4("ietf protocol assignments", 192, 0, 0, 0, 24),
    v4("ipv4 service continuity prefix", 192, 0, 0, 0, 29),
    v4("ipv4 dummy address", 192, 0, 0, 8, 32),
    v4("port control protocol anycast", 192, 0, 0, 9, 32),
    v4("turn anycast", 192, 0, 0, 10, 32),
    v4("nat64/dns64 discovery", 192, 0, 0, 170, 32),
    v4("nat64/dns64 discovery", 192, 0, 0, 171, 32),
    v4("documentation (test-net-1)", 192, 0, 2, 0, 24),
    v4("as112-v4", 192, 31, 196, 0, 24),
    v4("amt", 192, 52, 193, 0, 24),
    v4("deprecated 6to4 relay anycast", 192, 88, 99, 0, 24),
    v4("private-use", 192, 168, 0, 0, 16),
    v4("direct delegation as112 service", 192, 175, 48, 0, 24),
    v4("benchmarking", 198, 18, 0, 0, 15),
    v4("documentation (test-net-2)", 198, 51, 100, 0, 24),
    v4("documentation (test-net-3)", 203, 0, 113, 0, 24),
    v4("multicast", 224, 0, 0, 0, 4),
    v4("reserved", 240, 0, 0, 0, 4),
    v4("limited broadcast", 255, 255, 255, 255, 32),
];

/// The IANA IPv6 special-purpose address registry, with multicast, the deprecated
/// IPv4-compatible and site-local blocks added.
const IPV6_TABLE: &[V6Entry] = &[
    plain(v6("unspecified", [0, 0, 0, 0, 0, 0, 0, 0], 128)),
    plain(v6("loopback", [0, 0, 0, 0, 0, 0, 0, 1], 128)),
    carrying(
        v6("ipv4-mapped", [0, 0, 0, 0, 0, 0xffff, 0, 0], 96),
        Embedded::Last32 { public_ok: true },
    ),
    carrying(
        v6("ipv4-compatible (deprecated)", [0, 0, 0, 0, 0, 0, 0, 0], 96),
        Embedded::Last32 { public_ok: false },
    ),
    carrying(
        v6(
            "ipv4-ipv6 translation",
            [0x64, 0xff9b, 0, 0, 0, 0, 0, 0],
            96,
        ),
        Embedded::Last32 { public_ok: true },
    ),
    carrying(
        v6(
            "local-use ipv4-ipv6 translation",
            [0x64, 0xff9b, 1, 0, 0, 0, 0, 0],
            48,
        ),
        Embedded::Last32 { public_ok: false },
    ),
    plain(v6("discard-only", [0x100, 0, 0, 0, 0, 0, 0, 0], 64)),
    plain(v6("dummy ipv6 prefix", [0x100, 0, 0, 1, 0, 0, 0, 0], 64)),
    plain(v6(
        "ietf protocol assignments",
        [0x2001, 0, 0, 0, 0, 0, 0, 0],
        23,
    )),
    plain(v6("teredo", [0x2001, 0, 0, 0, 0, 0, 0, 0], 32)),
    plain(v6(
        "port control protocol anycast",
        [0x2001, 1, 0, 0, 0, 0, 0, 1],
        128,
    )),
    plain(v6("turn anycast", [0x2001, 1, 0, 0, 0, 0, 0, 2], 128)),
    plain(v6("dns-sd srp anycast", [0x2001, 1, 0, 0, 0, 0, 0, 3], 128)),
    plain(v6("benchmarking", [0x2001, 2, 0, 0, 0, 0, 0, 0], 48)),
    plain(v6("amt", [0x2001, 3, 0, 0, 0, 0, 0, 0], 32)),
    plain(v6("as112-v6", [0x2001, 4, 0x112, 0, 0, 0, 0, 0], 48)),
    plain(v6(
        "deprecated orchid",
        [0x2001, 0x10, 0, 0, 0, 0, 0, 0],
        28,
    )),
    plain(v6("orchidv2", [0x2001, 0x20, 0, 0, 0, 0, 0, 0], 28)),
    plain(v6("drone remote id", [0x2001, 0x30, 0, 0, 0, 0, 0, 0], 28)),
    plain(v6("documentation", [0x2001, 0xdb8, 0, 0, 0, 0, 0, 0], 32)),
    carrying(
        v6("6to4", [0x2002, 0, 0, 0, 0, 0, 0, 0], 16),
        Embedded::SixToFour,
    ),
    plain(v6(
        "direct delegation as112 service",
        [0x2620, 0x4f, 0x8000, 0, 0, 0, 0, 0],
        48,
    )),
    plain(v6("documentation", [0x3fff, 0, 0, 0, 0, 0, 0, 0], 20)),
    plain(v6(
        "segment routing sids",
        [0x5f00, 0, 0, 0, 0, 0, 0, 0],
        16,
    )),
    plain(v6("unique-local", [0xfc00, 0, 0, 0, 0, 0, 0, 0], 7)),
    plain(v6("link-local", [0xfe80, 0, 0, 0, 0, 0, 0, 0], 10)),
    plain(v6(
        "site-local (deprecated)",
        [0xfec0, 0, 0, 0, 0, 0, 0, 0],
        10,
    )),
    plain(v6("multicast", [0xff00, 0, 0, 0, 0, 0, 0, 0], 8)),
];

/// Everything outside global unicast that the table does not name: the IETF reserves it.
const GLOBAL_UNICAST: Entry<Ipv6Net> = v6("global unicast", [0x2000, 0, 0, 0, 0, 0, 0, 0], 3);
const IETF_RESERVED: &str = "reserved by the ietf, outside global unicast";

/// Names the special-purpose range `ip` falls in, or `None` for an ordinary public address.
///
/// The most specific entry wins (`192.0.0.9` is "port control protocol anycast", not "ietf
/// protocol assignments"). IPv6 forms carrying an IPv4 address are named by that address when it
/// is special; NAT64 (`64:ff9b::/96`), 6to4 and IPv4-mapped forms carrying a public IPv4 address
/// are public.
pub fn classify(ip: IpAddr) -> Option<SpecialRange> {
    match ip {
        IpAddr::V4(ip) => classify_v4(ip),
        IpAddr::V6(ip) => classify_v6(ip),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<SpecialRange> {
    IPV4_TABLE
        .iter()
        .filter(|e| e.net.contains(&ip))
        .max_by_key(|e| e.net.prefix_len())
        .map(|e| SpecialRange {
            name: e.name,
            net: IpNet::V4(e.net),
            carrier: None,
        })
}

fn classify_v6(ip: Ipv6Addr) -> Option<SpecialRange> {
    let Some(found) = IPV6_TABLE
        .iter()
        .filter(|e| e.entry.net.contains(&ip))
        .max_by_key(|e| e.entry.net.prefix_len())
    else {
        if GLOBAL_UNICAST.net.contains(&ip) {
            return None;
        }
        return Some(SpecialRange {
            name: IETF_RESERVED,
            net: IpNet::V6(GLOBAL_UNICAST.net),
            carrier: None,
        });
    };
    let own = SpecialRange {
        name: found.entry.name,
        net: IpNet::V6(found.entry.net),
        carrier: None,
    };
    let Some(embedded) = found.embedded else {
        return Some(own);
    };
    let bits = ip.to_bits();
    let (inner, public_ok) = match embedded {
        Embedded::Last32 { public_ok } => (Ipv4Addr::from_bits(bits as u32), public_ok),
        Embedded::SixToFour => (Ipv4Addr::from_bits((bits >> 80) as u32), true),
    };
    match classify_v4(inner) {
        Some(range) => Some(SpecialRange {
            carrier: Some((found.entry.name, found.entry.net)),
            ..range
        }),
        None if public_ok => None,
        None => Some(own),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_of(ip: &str) -> Option<String> {
        classify(ip.parse().unwrap()).map(|r| r.to_string())
    }

    #[track_caller]
    fn special(ip: &str, expected: &str) {
        assert_eq!(name_of(ip).as_deref(), Some(expected), "{ip}");
    }

    #[track_caller]
    fn public(ip: &str) {
        assert_eq!(name_of(ip), None, "{ip} should be public");
    }

    #[test]
    fn ipv4_ranges_are_named() {
        special("0.1.2.3", "this network 0.0.0.0/8");
        special("0.0.0.0", "this host on this network 0.0.0.0/32");
        special("10.255.0.1", "private-use 10.0.0.0/8");
        special("172.16.0.1", "private-use 172.16.0.0/12");
        special("172.31.255.255", "private-use 172.16.0.0/12");
        special("192.168.1.1", "private-use 192.168.0.0/16");
        special("100.64.0.1", "shared address space 100.64.0.0/10");
        special("100.127.255.254", "shared address space 100.64.0.0/10");
        special("127.0.0.1", "loopback 127.0.0.0/8");
        special("127.255.255.254", "loopback 127.0.0.0/8");
        special("169.254.169.254", "link-local 169.254.0.0/16");
        special("192.0.0.1", "ipv4 service continuity prefix 192.0.0.0/29");
        special("192.0.0.8", "ipv4 dummy address 192.0.0.8/32");
        special("192.0.0.9", "port control protocol anycast 192.0.0.9/32");
        special("192.0.0.10", "turn anycast 192.0.0.10/32");
        special("192.0.0.170", "nat64/dns64 discovery 192.0.0.170/32");
        special("192.0.0.171", "nat64/dns64 discovery 192.0.0.171/32");
        special("192.0.0.200", "ietf protocol assignments 192.0.0.0/24");
        special("192.0.2.7", "documentation (test-net-1) 192.0.2.0/24");
        special("198.51.100.7", "documentation (test-net-2) 198.51.100.0/24");
        special("203.0.113.7", "documentation (test-net-3) 203.0.113.0/24");
        special("192.31.196.1", "as112-v4 192.31.196.0/24");
        special("192.52.193.1", "amt 192.52.193.0/24");
        special(
            "192.88.99.1",
            "deprecated 6to4 relay anycast 192.88.99.0/24",
        );
        special(
            "192.175.48.1",
            "direct delegation as112 service 192.175.48.0/24",
        );
        special("198.18.0.1", "benchmarking 198.18.0.0/15");
        special("198.19.255.255", "benchmarking 198.18.0.0/15");
        special("224.0.0.1", "multicast 224.0.0.0/4");
        special("239.255.255.250", "multicast 224.0.0.0/4");
        special("240.0.0.1", "reserved 240.0.0.0/4");
        special("255.255.255.254", "reserved 240.0.0.0/4");
        special("255.255.255.255", "limited broadcast 255.255.255.255/32");
    }

    #[test]
    fn ipv4_neighbours_of_ranges_are_public() {
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.0.1.0",
            "192.0.3.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "203.0.112.255",
            "223.255.255.255",
        ] {
            public(ip);
        }
    }

    #[test]
    fn ipv6_ranges_are_named() {
        special("::", "unspecified ::/128");
        special("::1", "loopback ::1/128");
        special("100::1", "discard-only 100::/64");
        special("100:0:0:1::1", "dummy ipv6 prefix 100:0:0:1::/64");
        special("2001::1", "teredo 2001::/32");
        special("2001:1::1", "port control protocol anycast 2001:1::1/128");
        special("2001:1::2", "turn anycast 2001:1::2/128");
        special("2001:1::3", "dns-sd srp anycast 2001:1::3/128");
        special("2001:1::4", "ietf protocol assignments 2001::/23");
        special("2001:2::1", "benchmarking 2001:2::/48");
        special("2001:3::1", "amt 2001:3::/32");
        special("2001:4:112::1", "as112-v6 2001:4:112::/48");
        special("2001:10::1", "deprecated orchid 2001:10::/28");
        special("2001:20::1", "orchidv2 2001:20::/28");
        special("2001:30::1", "drone remote id 2001:30::/28");
        special("2001:db8::1", "documentation 2001:db8::/32");
        special("3fff::1", "documentation 3fff::/20");
        special("5f00::1", "segment routing sids 5f00::/16");
        special(
            "2620:4f:8000::1",
            "direct delegation as112 service 2620:4f:8000::/48",
        );
        special("fc00::1", "unique-local fc00::/7");
        special("fd12:3456::1", "unique-local fc00::/7");
        special("fe80::1", "link-local fe80::/10");
        special("febf::1", "link-local fe80::/10");
        special("fec0::1", "site-local (deprecated) fec0::/10");
        special("ff02::1", "multicast ff00::/8");
        special(
            "4000::1",
            "reserved by the ietf, outside global unicast 2000::/3",
        );
        special(
            "::2:3:4:5",
            "reserved by the ietf, outside global unicast 2000::/3",
        );
    }

    #[test]
    fn ipv6_embedded_ipv4_is_checked() {
        special(
            "::ffff:127.0.0.1",
            "loopback 127.0.0.0/8 (embedded in ipv4-mapped ::ffff:0.0.0.0/96)",
        );
        special(
            "::ffff:169.254.169.254",
            "link-local 169.254.0.0/16 (embedded in ipv4-mapped ::ffff:0.0.0.0/96)",
        );
        special(
            "::127.0.0.1",
            "loopback 127.0.0.0/8 (embedded in ipv4-compatible (deprecated) ::/96)",
        );
        special("::8.8.8.8", "ipv4-compatible (deprecated) ::/96");
        special(
            "64:ff9b::10.0.0.1",
            "private-use 10.0.0.0/8 (embedded in ipv4-ipv6 translation 64:ff9b::/96)",
        );
        special(
            "64:ff9b:1::a9fe:a9fe",
            "link-local 169.254.0.0/16 (embedded in local-use ipv4-ipv6 translation 64:ff9b:1::/48)",
        );
        special(
            "64:ff9b:1::8.8.8.8",
            "local-use ipv4-ipv6 translation 64:ff9b:1::/48",
        );
        // 2002:7f00:0001:: carries 127.0.0.1 in bits 16..48.
        special(
            "2002:7f00:1::",
            "loopback 127.0.0.0/8 (embedded in 6to4 2002::/16)",
        );
        special(
            "2002:c0a8:101::1",
            "private-use 192.168.0.0/16 (embedded in 6to4 2002::/16)",
        );
    }

    #[test]
    fn ipv6_public_addresses_and_public_embeddings_pass() {
        for ip in [
            "2606:4700:4700::1111",
            "2a00:1450:4001:80b::200e",
            "2001:200::1",
            "::ffff:8.8.8.8",
            "64:ff9b::8.8.8.8",
            "2002:808:808::1",
        ] {
            public(ip);
        }
    }

    #[test]
    fn display_names_the_range() {
        let range = classify("10.1.2.3".parse().unwrap()).unwrap();
        assert_eq!(range.name(), "private-use");
        assert_eq!(range.net(), "10.0.0.0/8".parse::<IpNet>().unwrap());
        assert_eq!(range.carrier(), None);
    }
}
