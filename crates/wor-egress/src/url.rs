//! Parsing an outbound URL the way a browser would, then refusing what the guard never sends.
//!
//! Hosts are parsed by the WHATWG URL standard (the `url` crate), so every spelling of an IPv4
//! address (`127.1`, `2130706433`, `0x7f.1`, `0177.0.0.1`) becomes the address it means and is
//! checked as such, and anything that looks numeric but is not a valid address
//! (`425.510.425.510`, `0x41414141A9FEA9FE`) is refused by the parser. On top of that: only
//! `http` and `https`, no userinfo at all (not even an empty `@`), no IPv6 zone ids, no port 0.
//!
//! Refusal messages never repeat the URL: it may carry credentials.

use std::fmt;
use std::net::IpAddr;

use ::url::{Host, Url};

/// A URL the guard accepts the shape of; its address still has to pass the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressUrl {
    url: Url,
    host: EgressHost,
    port: u16,
}

/// The host part of an [`EgressUrl`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EgressHost {
    /// A DNS name: lowercase, IDNA-encoded, without a trailing dot.
    Name(String),
    /// An IP literal, whatever spelling the URL used for it.
    Ip(IpAddr),
}

impl fmt::Display for EgressHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressHost::Name(name) => f.write_str(name),
            EgressHost::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Why a URL was refused before any name was resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlRefusal {
    /// The WHATWG parser refused it (bad host, bad IPv4 spelling, bad port...).
    #[error("the url is invalid: {0}")]
    Invalid(String),
    /// A scheme other than `http` or `https`.
    #[error("scheme `{0}` is refused, only http and https are allowed")]
    Scheme(String),
    /// A `user:password@` (or just `@`) part.
    #[error("credentials in the url are refused")]
    Credentials,
    /// An IPv6 literal with a zone id (`[fe80::1%eth0]`).
    #[error("ipv6 zone ids are refused")]
    ZoneId,
    /// No host, or a host that is only dots.
    #[error("the url has no host")]
    MissingHost,
    /// Port 0 names no service.
    #[error("port 0 is refused")]
    PortZero,
}

impl EgressUrl {
    /// Parses `input` and refuses anything but a plain `http(s)://host[:port]/...` URL.
    pub fn parse(input: &str) -> Result<Self, UrlRefusal> {
        let url = match Url::parse(input) {
            Ok(url) => url,
            Err(error) => {
                if authority(input).is_some_and(|a| a.contains('[') && a.contains('%')) {
                    return Err(UrlRefusal::ZoneId);
                }
                return Err(UrlRefusal::Invalid(error.to_string()));
            }
        };
        if !matches!(url.scheme(), "http" | "https") {
            return Err(UrlRefusal::Scheme(url.scheme().to_owned()));
        }
        // The parser drops an empty userinfo (`http://@host`), so look at the raw authority too.
        if !url.username().is_empty()
            || url.password().is_some()
            || authority(input).is_none_or(|a| a.contains('@'))
        {
            return Err(UrlRefusal::Credentials);
        }
        let host = match url.host() {
            Some(Host::Ipv4(ip)) => EgressHost::Ip(IpAddr::V4(ip)),
            Some(Host::Ipv6(ip)) => EgressHost::Ip(IpAddr::V6(ip)),
            Some(Host::Domain(name)) => {
                let name = name.strip_suffix('.').unwrap_or(name);
                if name.is_empty() || name.starts_with('.') {
                    return Err(UrlRefusal::MissingHost);
                }
                EgressHost::Name(name.to_owned())
            }
            None => return Err(UrlRefusal::MissingHost),
        };
        let port = url.port_or_known_default().ok_or(UrlRefusal::MissingHost)?;
        if port == 0 {
            return Err(UrlRefusal::PortZero);
        }
        Ok(Self { url, host, port })
    }

    /// The parsed URL, as it will be sent.
    pub fn as_url(&self) -> &Url {
        &self.url
    }

    /// The host, with IPv4 spellings normalised to the address they mean.
    pub fn host(&self) -> &EgressHost {
        &self.host
    }

    /// The port, explicit or the scheme's default.
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// The raw authority of a special-scheme URL as the WHATWG parser delimits it: after the
/// scheme and any run of slashes or backslashes, up to the first `/`, `\`, `?` or `#`.
fn authority(input: &str) -> Option<String> {
    let cleaned: String = input
        .trim_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect();
    let (_, rest) = cleaned.split_once(':')?;
    let rest = rest.trim_start_matches(['/', '\\']);
    let end = rest.find(['/', '\\', '?', '#']).unwrap_or(rest.len());
    rest.get(..end).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn host_of(input: &str) -> String {
        EgressUrl::parse(input).unwrap().host().to_string()
    }

    #[track_caller]
    fn refused(input: &str) -> UrlRefusal {
        EgressUrl::parse(input).unwrap_err()
    }

    #[test]
    fn ipv4_spellings_become_the_address_they_mean() {
        assert_eq!(host_of("http://127.1"), "127.0.0.1");
        assert_eq!(host_of("http://127.0.1"), "127.0.0.1");
        assert_eq!(host_of("http://2130706433"), "127.0.0.1");
        assert_eq!(host_of("http://0x7f.1"), "127.0.0.1");
        assert_eq!(host_of("http://0177.0.0.1"), "127.0.0.1");
        assert_eq!(host_of("http://0"), "0.0.0.0");
        assert_eq!(host_of("http://0xA9FEA9FE"), "169.254.169.254");
        assert_eq!(host_of("http://0xA9.0xFE.0xA9.0xFE"), "169.254.169.254");
        assert_eq!(
            host_of("http://0251.00376.000251.0000376"),
            "169.254.169.254"
        );
        assert_eq!(host_of("http://2852039166"), "169.254.169.254");
        assert_eq!(host_of("http://3232235521"), "192.168.0.1");
        assert_eq!(host_of("http://127.0.0.1./x"), "127.0.0.1");
    }

    #[test]
    fn numeric_hosts_that_are_no_address_are_refused() {
        for input in [
            "http://425.510.425.510",
            "http://0x41414141A9FEA9FE",
            "http://7147006462",
            "http://1.2.3.4.5",
            "http://256.0.0.1",
            "http://example.09",
        ] {
            assert!(
                matches!(refused(input), UrlRefusal::Invalid(_)),
                "{input}: {:?}",
                EgressUrl::parse(input)
            );
        }
    }

    #[test]
    fn ipv6_literals_and_embedded_ipv4() {
        assert_eq!(host_of("http://[::1]:8080/"), "::1");
        assert_eq!(
            host_of("http://[0:0:0:0:0:ffff:127.0.0.1]"),
            "::ffff:127.0.0.1"
        );
        assert_eq!(
            host_of("http://[::ffff:a9fe:a9fe]"),
            "::ffff:169.254.169.254"
        );
        assert_eq!(refused("http://[fe80::1%25eth0]/"), UrlRefusal::ZoneId);
        assert_eq!(refused("http://[fe80::1%eth0]/"), UrlRefusal::ZoneId);
        assert!(matches!(refused("http://[::1/"), UrlRefusal::Invalid(_)));
    }

    #[test]
    fn only_http_and_https() {
        assert_eq!(
            refused("ftp://example.com/"),
            UrlRefusal::Scheme("ftp".into())
        );
        assert_eq!(
            refused("file:///etc/passwd"),
            UrlRefusal::Scheme("file".into())
        );
        assert_eq!(
            refused("gopher://127.0.0.1:6379/_"),
            UrlRefusal::Scheme("gopher".into())
        );
        assert_eq!(
            refused("HTTPX://a.example"),
            UrlRefusal::Scheme("httpx".into())
        );
        assert!(EgressUrl::parse("HTTPS://Example.COM/").is_ok());
        assert!(matches!(refused("example.com"), UrlRefusal::Invalid(_)));
    }

    #[test]
    fn any_userinfo_is_refused() {
        for input in [
            "http://user:pass@example.com/",
            "http://user@example.com/",
            "http://@example.com/",
            "http://:@example.com/",
            "http://127.1.1.1:80@127.2.2.2:80",
            "http://127.1.1.1:80@@127.2.2.2:80",
            "http://127.1.1.1:80:@@127.2.2.2:80",
            "http:\\\\user@example.com/",
            "http://us\ter@example.com/",
            "  http://@example.com/",
        ] {
            assert_eq!(refused(input), UrlRefusal::Credentials, "{input}");
        }
        // An `@` after the authority is path, query or fragment, not userinfo.
        assert_eq!(host_of("http://127.1.1.1:80#@127.2.2.2:80"), "127.1.1.1");
        assert_eq!(host_of("http://example.com/a@b?c=@d"), "example.com");
    }

    #[test]
    fn ports() {
        assert_eq!(EgressUrl::parse("http://example.com").unwrap().port(), 80);
        assert_eq!(EgressUrl::parse("https://example.com").unwrap().port(), 443);
        assert_eq!(
            EgressUrl::parse("https://example.com:8443").unwrap().port(),
            8443
        );
        assert_eq!(refused("http://example.com:0/"), UrlRefusal::PortZero);
        for input in [
            "http://localhost:+11211aaa",
            "http://localhost:00011211aaaa",
            "http://example.com:65536/",
            "http://example.com:-1/",
        ] {
            assert!(matches!(refused(input), UrlRefusal::Invalid(_)), "{input}");
        }
    }

    #[test]
    fn names_are_normalised() {
        assert_eq!(host_of("http://EXAMPLE.com./"), "example.com");
        assert_eq!(host_of("http://bücher.example/"), "xn--bcher-kva.example");
        assert_eq!(refused("http://./"), UrlRefusal::MissingHost);
    }

    #[test]
    fn refusals_do_not_repeat_the_url() {
        let message = refused("http://admin:hunter2@example.com/").to_string();
        assert!(!message.contains("hunter2"), "{message}");
    }
}
