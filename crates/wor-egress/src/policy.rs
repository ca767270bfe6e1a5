//! What the guard allows: the server-wide address policy and per-connection host allowlists.
//!
//! [`EgressPolicy`] comes only from the server configuration ([`EgressConfig`]); nothing reachable
//! through the API can widen it. Special-use addresses (see [`crate::address`]) are refused in
//! every mode unless the operator lists a CIDR covering them. Production additionally refuses
//! lists that would switch the guard off (prefixes shorter than /8 or /16) or open cloud
//! metadata (link-local ranges), judging an IPv6 range that embeds IPv4 addresses by the IPv4
//! range it reaches.
//!
//! A [`HostAllowlist`] narrows one connection to the hosts it declares; it never widens the
//! address policy.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;
use serde::Deserialize;

use crate::address::{SpecialRange, classify};
use crate::url::{EgressHost, UrlRefusal};

/// The `[egress]` section of the server configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressConfig {
    /// Production mode: stricter checks on `allowed_cidrs`.
    #[serde(default)]
    pub production: bool,
    /// Special-use ranges the operator allows anyway (`10.1.0.0/16`, `127.0.0.1/32`).
    #[serde(default)]
    pub allowed_cidrs: Vec<String>,
    /// Special-use ranges open to model connections only (local model servers such as Ollama
    /// or llama.cpp on `10.0.0.0/24`); a model connection there may have no API key. Tools,
    /// webhooks and the sandbox proxy are never let into them.
    #[serde(default)]
    pub model_cidrs: Vec<String>,
}

/// Why an [`EgressConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// Not a CIDR.
    #[error("allowed cidr `{0}` is not a valid cidr")]
    InvalidCidr(String),
    /// A `model_cidrs` entry is not a CIDR.
    #[error("model cidr `{0}` is not a valid cidr")]
    InvalidModelCidr(String),
    /// Production refuses prefixes that would switch most of the guard off.
    #[error("allowed cidr `{0}` is too broad for production (shorter than /{1})")]
    TooBroad(IpNet, u8),
    /// Production refuses a range holding a cloud metadata service's IPv6 address.
    #[error("allowed cidr `{0}` covers {1}, a cloud metadata address, refused in production")]
    Metadata(IpNet, std::net::Ipv6Addr),
    /// Production refuses link-local ranges: cloud metadata services live there.
    #[error(
        "allowed cidr `{0}` covers link-local addresses (cloud metadata), refused in production"
    )]
    LinkLocal(IpNet),
    /// Production judges an IPv6 range that embeds IPv4 addresses (IPv4-mapped, -compatible,
    /// NAT64, 6to4) by the IPv4 range it reaches.
    #[error(
        "allowed cidr `{0}` reaches the IPv4 range {1}, which is too broad for production \
         (shorter than /8)"
    )]
    EmbedsTooBroad(IpNet, ipnet::Ipv4Net),
    /// Production refuses an IPv6 range that embeds IPv4 addresses where the guard cannot
    /// read them (Teredo, local-use NAT64).
    #[error(
        "allowed cidr `{0}` overlaps {1} addresses, which reach IPv4 addresses production \
         cannot check: list the IPv4 range itself"
    )]
    EmbedsUnchecked(IpNet, &'static str),
}

/// IPv6 ranges whose addresses carry an IPv4 address, and the bit where it starts: a listed
/// range within one is judged by the IPv4 range it reaches.
const EMBEDDING_V4: [(ipnet::Ipv6Net, u8); 5] = [
    // IPv4-mapped, `::ffff:a.b.c.d`.
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96),
        96,
    ),
    // IPv4-translated (SIIT), `::ffff:0:a.b.c.d`.
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0, 0, 0, 0, 0xffff, 0, 0, 0), 96),
        96,
    ),
    // IPv4-compatible (deprecated), `::a.b.c.d`.
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 0), 96),
        96,
    ),
    // NAT64's well-known prefix, `64:ff9b::a.b.c.d`.
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0), 96),
        96,
    ),
    // 6to4, `2002:AABB:CCDD::/48`.
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0x2002, 0, 0, 0, 0, 0, 0, 0), 16),
        16,
    ),
];

/// Cloud metadata services' IPv6 addresses outside link-local (AWS's IMDS, in unique-local
/// space an operator may well list).
const METADATA_V6: [std::net::Ipv6Addr; 1] =
    [std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)];

/// IPv6 ranges whose addresses reach IPv4 in a form not read here, and their names.
const UNCHECKED_V4: [(ipnet::Ipv6Net, &str); 2] = [
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0), 32),
        "Teredo",
    ),
    (
        ipnet::Ipv6Net::new_assert(std::net::Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0), 48),
        "local-use NAT64",
    ),
];

/// The IPv4 range `cidr` reaches through `embedding`, whose IPv4 address starts at bit `at`:
/// the whole of IPv4 for a range that holds all of `embedding`, and `None` for one outside it.
fn embedded_v4(cidr: ipnet::Ipv6Net, embedding: ipnet::Ipv6Net, at: u8) -> Option<ipnet::Ipv4Net> {
    if cidr.contains(&embedding) {
        return Some(ipnet::Ipv4Net::default());
    }
    if !embedding.contains(&cidr) {
        return None;
    }
    let bits = u128::from(cidr.network());
    let shift = 128 - u32::from(at) - 32;
    let address = u32::try_from((bits >> shift) & u128::from(u32::MAX)).unwrap_or_default();
    let len = cidr.prefix_len().saturating_sub(at).min(32);
    ipnet::Ipv4Net::new(std::net::Ipv4Addr::from(address), len).ok()
}

const LINK_LOCAL: [IpNet; 2] = [
    IpNet::V4(ipnet::Ipv4Net::new_assert(
        std::net::Ipv4Addr::new(169, 254, 0, 0),
        16,
    )),
    IpNet::V6(ipnet::Ipv6Net::new_assert(
        std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0),
        10,
    )),
];

/// The server-wide address policy.
///
/// `model_cidrs` are kept apart from `allowed_cidrs`: [`EgressPolicy::check_address`] ignores
/// them, and only the policy [`EgressPolicy::for_models`] returns lets traffic into them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    production: bool,
    allowed_cidrs: Vec<IpNet>,
    model_cidrs: Vec<IpNet>,
}

impl EgressPolicy {
    /// Development: every special-use address refused, nothing listed.
    pub fn development() -> Self {
        Self::default()
    }

    /// Production: every special-use address refused, nothing listed.
    pub fn production() -> Self {
        Self {
            production: true,
            ..Self::default()
        }
    }

    /// Builds the policy from the server configuration.
    pub fn from_config(config: &EgressConfig) -> Result<Self, PolicyError> {
        let cidrs = parse_cidrs(&config.allowed_cidrs, PolicyError::InvalidCidr)?;
        let model_cidrs = parse_cidrs(&config.model_cidrs, PolicyError::InvalidModelCidr)?;
        let base = if config.production {
            Self::production()
        } else {
            Self::development()
        };
        base.with_allowed_cidrs(cidrs)?
            .with_model_cidrs(model_cidrs)
    }

    /// Adds operator-listed ranges open to model connections only, under the same production
    /// rules as [`EgressPolicy::with_allowed_cidrs`].
    pub fn with_model_cidrs(
        mut self,
        cidrs: impl IntoIterator<Item = IpNet>,
    ) -> Result<Self, PolicyError> {
        for cidr in cidrs {
            let cidr = cidr.trunc();
            self.check_listable(cidr)?;
            self.model_cidrs.push(cidr);
        }
        Ok(self)
    }

    /// The policy model connections are sent under: this one with the model ranges allowed.
    #[must_use]
    pub fn for_models(&self) -> Self {
        let mut allowed = self.allowed_cidrs.clone();
        allowed.extend(self.model_cidrs.iter().copied());
        Self {
            production: self.production,
            allowed_cidrs: allowed,
            model_cidrs: self.model_cidrs.clone(),
        }
    }

    /// The operator-listed ranges open to model connections only.
    pub fn model_cidrs(&self) -> &[IpNet] {
        &self.model_cidrs
    }

    /// Whether `ip` lies in a range listed for models (a keyless model connection may reach
    /// only such addresses).
    pub fn is_model_address(&self, ip: IpAddr) -> bool {
        let canonical = ip.to_canonical();
        self.model_cidrs
            .iter()
            .any(|cidr| cidr.contains(&ip) || cidr.contains(&canonical))
    }

    /// Production refuses ranges that would switch most of the guard off or open cloud
    /// metadata.
    fn check_listable(&self, cidr: IpNet) -> Result<(), PolicyError> {
        if !self.production {
            return Ok(());
        }
        let min = match cidr {
            IpNet::V4(_) => 8,
            IpNet::V6(_) => 16,
        };
        if cidr.prefix_len() < min {
            return Err(PolicyError::TooBroad(cidr, min));
        }
        let link_local = |range: IpNet| {
            LINK_LOCAL
                .iter()
                .any(|ll| ll.contains(&range) || range.contains(ll))
        };
        if link_local(cidr) {
            return Err(PolicyError::LinkLocal(cidr));
        }
        let IpNet::V6(v6) = cidr else {
            return Ok(());
        };
        if let Some(metadata) = METADATA_V6.iter().find(|address| v6.contains(*address)) {
            return Err(PolicyError::Metadata(cidr, *metadata));
        }
        for (embedding, at) in EMBEDDING_V4 {
            let Some(v4) = embedded_v4(v6, embedding, at) else {
                continue;
            };
            if v4.prefix_len() < 8 {
                return Err(PolicyError::EmbedsTooBroad(cidr, v4));
            }
            if link_local(IpNet::V4(v4)) {
                return Err(PolicyError::LinkLocal(cidr));
            }
        }
        if let Some((_, name)) = UNCHECKED_V4
            .iter()
            .find(|(range, _)| range.contains(&v6) || v6.contains(range))
        {
            return Err(PolicyError::EmbedsUnchecked(cidr, name));
        }
        Ok(())
    }

    /// Adds operator-listed ranges that are allowed even though they are special-use.
    pub fn with_allowed_cidrs(
        mut self,
        cidrs: impl IntoIterator<Item = IpNet>,
    ) -> Result<Self, PolicyError> {
        for cidr in cidrs {
            let cidr = cidr.trunc();
            self.check_listable(cidr)?;
            self.allowed_cidrs.push(cidr);
        }
        Ok(self)
    }

    /// Whether this is the production policy.
    pub fn is_production(&self) -> bool {
        self.production
    }

    /// The operator-listed ranges.
    pub fn allowed_cidrs(&self) -> &[IpNet] {
        &self.allowed_cidrs
    }

    /// `Err` names the special-use range `ip` is in when no listed CIDR allows it.
    pub fn check_address(&self, ip: IpAddr) -> Result<(), SpecialRange> {
        let Some(range) = classify(ip) else {
            return Ok(());
        };
        // `::ffff:10.0.0.1` is allowed by a listed `10.0.0.0/8`, and the other way round.
        let canonical = ip.to_canonical();
        if self
            .allowed_cidrs
            .iter()
            .any(|cidr| cidr.contains(&ip) || cidr.contains(&canonical))
        {
            return Ok(());
        }
        Err(range)
    }
}

/// CIDRs (or single addresses) as written in the configuration; `invalid` names a bad entry.
fn parse_cidrs(
    raw: &[String],
    invalid: fn(String) -> PolicyError,
) -> Result<Vec<IpNet>, PolicyError> {
    raw.iter()
        .map(|entry| {
            IpNet::from_str(entry.trim())
                .or_else(|_| IpAddr::from_str(entry.trim()).map(IpNet::from))
                .map_err(|_| invalid(entry.clone()))
        })
        .collect()
}

/// One allowlist entry: `api.example.com`, `*.example.com` (subdomains only), `10.0.0.5`,
/// `[2001:db8::1]`, each optionally with `:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPattern {
    host: PatternHost,
    port: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum PatternHost {
    Exact(String),
    /// The suffix after `*.`; matches strict subdomains.
    Subdomains(String),
    Ip(IpAddr),
}

/// Why an allowlist entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowlistError {
    /// The host part is not a host.
    #[error("allowlist entry `{0}` is not a valid host")]
    InvalidHost(String),
    /// The port part is not a port.
    #[error("allowlist entry `{0}` has an invalid port")]
    InvalidPort(String),
    /// `*` must be a whole leading label, followed by a domain.
    #[error("allowlist entry `{0}` has an invalid wildcard, only `*.domain` is accepted")]
    InvalidWildcard(String),
}

impl FromStr for HostPattern {
    type Err = AllowlistError;

    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        let trimmed = raw.trim();
        let (host, port) =
            split_port(trimmed).ok_or_else(|| AllowlistError::InvalidPort(raw.into()))?;
        let port = match port {
            None => None,
            Some(port) => match port.parse::<u16>() {
                Ok(0) | Err(_) => return Err(AllowlistError::InvalidPort(raw.into())),
                Ok(port) => Some(port),
            },
        };
        let (wildcard, host) = match host.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, host),
        };
        if host.contains('*') {
            return Err(AllowlistError::InvalidWildcard(raw.into()));
        }
        let parsed =
            ::url::Host::parse(host).map_err(|_| AllowlistError::InvalidHost(raw.into()))?;
        let host = match parsed {
            ::url::Host::Domain(name) => {
                let name = name.strip_suffix('.').unwrap_or(&name).to_owned();
                if name.is_empty() {
                    return Err(AllowlistError::InvalidHost(raw.into()));
                }
                if wildcard {
                    PatternHost::Subdomains(name)
                } else {
                    PatternHost::Exact(name)
                }
            }
            _ if wildcard => return Err(AllowlistError::InvalidWildcard(raw.into())),
            ::url::Host::Ipv4(ip) => PatternHost::Ip(IpAddr::V4(ip)),
            ::url::Host::Ipv6(ip) => PatternHost::Ip(IpAddr::V6(ip)),
        };
        Ok(Self { host, port })
    }
}

/// Splits `host[:port]`, `[v6][:port]`; `None` when the port part is malformed.
fn split_port(raw: &str) -> Option<(&str, Option<&str>)> {
    if raw.starts_with('[') {
        let end = raw.find(']')?;
        let (host, rest) = raw.split_at(end.checked_add(1)?);
        return match rest {
            "" => Some((host, None)),
            _ => rest.strip_prefix(':').map(|port| (host, Some(port))),
        };
    }
    match raw.split_once(':') {
        None => Some((raw, None)),
        Some((host, port)) if !port.contains(':') => Some((host, Some(port))),
        // A bare IPv6 address: no port.
        Some(_) => Some((raw, None)),
    }
}

impl HostPattern {
    /// Whether `host:port` matches this entry (no port in the entry: any port).
    pub fn matches(&self, host: &EgressHost, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match (&self.host, host) {
            (PatternHost::Exact(want), EgressHost::Name(name)) => want == name,
            (PatternHost::Subdomains(suffix), EgressHost::Name(name)) => name
                .strip_suffix(suffix.as_str())
                .and_then(|head| head.strip_suffix('.'))
                .is_some_and(|label| !label.is_empty()),
            (PatternHost::Ip(want), EgressHost::Ip(ip)) => want.to_canonical() == ip.to_canonical(),
            _ => false,
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            PatternHost::Exact(name) => f.write_str(name)?,
            PatternHost::Subdomains(name) => write!(f, "*.{name}")?,
            PatternHost::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]")?,
            PatternHost::Ip(ip) => write!(f, "{ip}")?,
        }
        if let Some(port) = self.port {
            write!(f, ":{port}")?;
        }
        Ok(())
    }
}

/// The hosts one connection may reach. Empty allows nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAllowlist {
    patterns: Vec<HostPattern>,
}

impl HostAllowlist {
    /// An allowlist of already parsed entries.
    pub fn new(patterns: impl IntoIterator<Item = HostPattern>) -> Self {
        Self {
            patterns: patterns.into_iter().collect(),
        }
    }

    /// Parses each entry; the first bad one is the error.
    pub fn parse<S: AsRef<str>>(
        entries: impl IntoIterator<Item = S>,
    ) -> Result<Self, AllowlistError> {
        let patterns = entries
            .into_iter()
            .map(|entry| entry.as_ref().parse())
            .collect::<Result<_, _>>()?;
        Ok(Self { patterns })
    }

    /// Whether any entry matches `host:port`.
    pub fn allows(&self, host: &EgressHost, port: u16) -> bool {
        self.patterns.iter().any(|p| p.matches(host, port))
    }

    /// The entries.
    pub fn patterns(&self) -> &[HostPattern] {
        &self.patterns
    }
}

/// Why the guard refused a destination. A value, not an error: callers report it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EgressDenial {
    /// The URL itself is refused.
    #[error(transparent)]
    Url(#[from] UrlRefusal),
    /// The connection's allowlist does not name this host and port.
    #[error("`{host}` port {port} is not on the connection's allowlist")]
    HostNotAllowed {
        /// The host as parsed.
        host: EgressHost,
        /// The effective port.
        port: u16,
    },
    /// The host is, or resolves to, a special-use address no listed CIDR allows.
    #[error("{}", address_message(host, *ip, range))]
    Address {
        /// The host as parsed.
        host: EgressHost,
        /// The offending address (one bad answer refuses the whole name).
        ip: IpAddr,
        /// The range it is in.
        range: SpecialRange,
    },
    /// The name did not resolve (only reported by [`crate::check`]; sending reports an error).
    #[error("`{host}` did not resolve: {reason}")]
    Unresolvable {
        /// The name.
        host: String,
        /// The resolver's reason.
        reason: String,
    },
}

fn address_message(host: &EgressHost, ip: IpAddr, range: &SpecialRange) -> String {
    match host {
        EgressHost::Ip(_) => format!("`{ip}` is {range}"),
        EgressHost::Name(name) => format!("`{name}` resolves to `{ip}`, which is {range}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(host: &str) -> EgressHost {
        EgressHost::Name(host.into())
    }

    #[test]
    fn special_addresses_are_refused_unless_listed() {
        let dev = EgressPolicy::development();
        let err = dev.check_address("10.1.2.3".parse().unwrap()).unwrap_err();
        assert_eq!(err.name(), "private-use");
        assert!(dev.check_address("8.8.8.8".parse().unwrap()).is_ok());
        assert!(dev.check_address("127.0.0.1".parse().unwrap()).is_err());

        let listed = EgressPolicy::development()
            .with_allowed_cidrs(["127.0.0.1/32".parse().unwrap()])
            .unwrap();
        assert!(listed.check_address("127.0.0.1".parse().unwrap()).is_ok());
        assert!(
            listed
                .check_address("::ffff:127.0.0.1".parse().unwrap())
                .is_ok()
        );
        assert!(listed.check_address("127.0.0.2".parse().unwrap()).is_err());
        assert!(listed.check_address("::1".parse().unwrap()).is_err());
    }

    #[test]
    fn production_refuses_private_unless_listed() {
        let prod = EgressPolicy::production();
        assert!(prod.check_address("192.168.1.10".parse().unwrap()).is_err());
        let config = EgressConfig {
            production: true,
            allowed_cidrs: vec!["192.168.1.0/24".into(), "fd00::1".into()],
            model_cidrs: Vec::new(),
        };
        let prod = EgressPolicy::from_config(&config).unwrap();
        assert!(prod.is_production());
        assert!(prod.check_address("192.168.1.10".parse().unwrap()).is_ok());
        assert!(prod.check_address("192.168.2.10".parse().unwrap()).is_err());
        assert!(prod.check_address("fd00::1".parse().unwrap()).is_ok());
        assert!(prod.check_address("fd00::2".parse().unwrap()).is_err());
    }

    #[test]
    fn production_refuses_lists_that_disable_the_guard() {
        let broad = EgressPolicy::production().with_allowed_cidrs(["0.0.0.0/0".parse().unwrap()]);
        assert!(matches!(broad, Err(PolicyError::TooBroad(_, 8))));
        let broad = EgressPolicy::production().with_allowed_cidrs(["::/0".parse().unwrap()]);
        assert!(matches!(broad, Err(PolicyError::TooBroad(_, 16))));
        let metadata =
            EgressPolicy::production().with_allowed_cidrs(["169.254.169.254/32".parse().unwrap()]);
        assert!(matches!(metadata, Err(PolicyError::LinkLocal(_))));
        // Development takes the operator at their word.
        assert!(
            EgressPolicy::development()
                .with_allowed_cidrs(["0.0.0.0/0".parse().unwrap()])
                .is_ok()
        );
    }

    #[test]
    fn production_judges_an_ipv6_range_that_embeds_ipv4_by_what_it_reaches() {
        let listed = |cidr: &str| {
            EgressPolicy::production().with_allowed_cidrs([cidr.parse::<IpNet>().unwrap()])
        };
        for (cidr, reaches) in [
            ("::ffff:0:0/96", "0.0.0.0/0"),
            ("::ffff:0:0/100", "0.0.0.0/4"),
            ("64:ff9b::/96", "0.0.0.0/0"),
            ("2002::/16", "0.0.0.0/0"),
            ("2002:a000::/20", "160.0.0.0/4"),
            ("::/64", "0.0.0.0/0"),
            ("::ffff:0:0:0/96", "0.0.0.0/0"),
        ] {
            assert_eq!(
                listed(cidr),
                Err(PolicyError::EmbedsTooBroad(
                    cidr.parse().unwrap(),
                    reaches.parse().unwrap()
                )),
                "{cidr}"
            );
        }
        // Cloud metadata, however it is spelt.
        for cidr in [
            "::ffff:169.254.169.254/128",
            "::ffff:169.254.0.0/112",
            "::ffff:169.0.0.0/104",
            "64:ff9b::a9fe:0/112",
            "2002:a9fe::/32",
            "2002:a9fe:a9fe::/48",
            "::ffff:0:a9fe:0/112",
        ] {
            assert_eq!(
                listed(cidr),
                Err(PolicyError::LinkLocal(cidr.parse().unwrap())),
                "{cidr}"
            );
        }
        for (cidr, name) in [
            ("2001::/32", "Teredo"),
            ("2001:0:a9fe::/48", "Teredo"),
            ("64:ff9b:1::/64", "local-use NAT64"),
        ] {
            assert_eq!(
                listed(cidr),
                Err(PolicyError::EmbedsUnchecked(cidr.parse().unwrap(), name)),
                "{cidr}"
            );
        }
        // AWS's IPv6 metadata address, in unique-local space.
        for cidr in ["fd00::/16", "fd00:ec2::/64", "fd00:ec2::254/128"] {
            assert_eq!(
                listed(cidr),
                Err(PolicyError::Metadata(
                    cidr.parse().unwrap(),
                    "fd00:ec2::254".parse().unwrap()
                )),
                "{cidr}"
            );
        }
        // What an operator lists for a private service stays listable, in either spelling.
        for cidr in [
            "::ffff:10.1.0.0/112",
            "64:ff9b::a01:5/128",
            "2002:a01::/32",
            "::1/128",
            "fd00:1::/64",
            "fd00:ec3::/32",
            "2001:db8::/32",
        ] {
            assert!(listed(cidr).is_ok(), "{cidr}");
        }
        let bad = EgressConfig {
            production: false,
            allowed_cidrs: vec!["10.0.0.0/33".into()],
            model_cidrs: Vec::new(),
        };
        assert_eq!(
            EgressPolicy::from_config(&bad),
            Err(PolicyError::InvalidCidr("10.0.0.0/33".into()))
        );
    }

    #[test]
    fn model_ranges_open_only_the_policy_for_models() {
        let config = EgressConfig {
            production: true,
            allowed_cidrs: vec!["192.168.1.0/24".into()],
            model_cidrs: vec!["10.0.0.0/24".into(), "fd00:1::5".into()],
        };
        let policy = EgressPolicy::from_config(&config).unwrap();
        let ollama: IpAddr = "10.0.0.5".parse().unwrap();
        // Tools, webhooks and the sandbox proxy use this policy: the model range stays shut.
        assert!(policy.check_address(ollama).is_err());
        assert!(policy.check_address("fd00:1::5".parse().unwrap()).is_err());
        assert!(policy.is_model_address(ollama));
        assert!(policy.is_model_address("::ffff:10.0.0.5".parse().unwrap()));
        assert!(!policy.is_model_address("192.168.1.10".parse().unwrap()));
        let models = policy.for_models();
        assert!(models.check_address(ollama).is_ok());
        assert!(models.check_address("fd00:1::5".parse().unwrap()).is_ok());
        assert!(
            models
                .check_address("192.168.1.10".parse().unwrap())
                .is_ok()
        );
        assert!(models.check_address("10.0.1.5".parse().unwrap()).is_err());
        // The same production rules as for allowed ranges.
        let metadata = EgressConfig {
            production: true,
            allowed_cidrs: Vec::new(),
            model_cidrs: vec!["169.254.0.0/16".into()],
        };
        assert!(matches!(
            EgressPolicy::from_config(&metadata),
            Err(PolicyError::LinkLocal(_))
        ));
        let bad = EgressConfig {
            production: false,
            allowed_cidrs: Vec::new(),
            model_cidrs: vec!["ollama".into()],
        };
        assert_eq!(
            EgressPolicy::from_config(&bad),
            Err(PolicyError::InvalidModelCidr("ollama".into()))
        );
    }

    #[test]
    fn wildcards_match_subdomains_only() {
        let list = HostAllowlist::parse(["*.example.com"]).unwrap();
        assert!(list.allows(&name("api.example.com"), 443));
        assert!(list.allows(&name("a.b.example.com"), 80));
        assert!(!list.allows(&name("example.com"), 443));
        assert!(!list.allows(&name("badexample.com"), 443));
        assert!(!list.allows(&name("example.com.evil.net"), 443));
        assert!(!list.allows(&EgressHost::Ip("93.184.215.14".parse().unwrap()), 443));
    }

    #[test]
    fn exact_hosts_and_ports() {
        let list = HostAllowlist::parse([
            "API.Example.com:8443",
            "hooks.example.net",
            "[::1]:80",
            "10.0.0.5",
        ])
        .unwrap();
        assert!(list.allows(&name("api.example.com"), 8443));
        assert!(!list.allows(&name("api.example.com"), 443));
        assert!(!list.allows(&name("x.api.example.com"), 8443));
        assert!(list.allows(&name("hooks.example.net"), 1));
        assert!(list.allows(&EgressHost::Ip("::1".parse().unwrap()), 80));
        assert!(!list.allows(&EgressHost::Ip("::1".parse().unwrap()), 81));
        assert!(list.allows(&EgressHost::Ip("10.0.0.5".parse().unwrap()), 9000));
        assert!(!HostAllowlist::default().allows(&name("api.example.com"), 443));
        assert_eq!(
            list.patterns().first().map(ToString::to_string).as_deref(),
            Some("api.example.com:8443")
        );
    }

    #[test]
    fn bad_entries_are_refused() {
        for (raw, expected) in [
            (
                "example.com:0",
                AllowlistError::InvalidPort("example.com:0".into()),
            ),
            (
                "example.com:http",
                AllowlistError::InvalidPort("example.com:http".into()),
            ),
            ("[::1]x", AllowlistError::InvalidPort("[::1]x".into())),
            (
                "a.*.example.com",
                AllowlistError::InvalidWildcard("a.*.example.com".into()),
            ),
            (
                "*example.com",
                AllowlistError::InvalidWildcard("*example.com".into()),
            ),
            (
                "*.10.0.0.1",
                AllowlistError::InvalidWildcard("*.10.0.0.1".into()),
            ),
            (
                "exa mple.com",
                AllowlistError::InvalidHost("exa mple.com".into()),
            ),
            ("", AllowlistError::InvalidHost("".into())),
        ] {
            assert_eq!(raw.parse::<HostPattern>(), Err(expected), "{raw}");
        }
    }

    #[test]
    fn denials_name_the_address_class() {
        let denial = EgressDenial::Address {
            host: name("metadata.example"),
            ip: "169.254.169.254".parse().unwrap(),
            range: classify("169.254.169.254".parse().unwrap()).unwrap(),
        };
        assert_eq!(
            denial.to_string(),
            "`metadata.example` resolves to `169.254.169.254`, which is link-local 169.254.0.0/16"
        );
    }
}
