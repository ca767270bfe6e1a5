//! Name resolution behind the address policy, with answers pinned against DNS rebinding.
//!
//! [`NameResolver`] is the port: [`SystemResolver`] (hickory, system configuration) in
//! production, [`StaticResolver`] for `--resolve HOST:IP` and for tests. [`GuardedResolver`]
//! wraps either: every answer must pass the [`EgressPolicy`] (one bad answer refuses the whole
//! name), and a validated answer is pinned per name for its TTL, clamped to [`PinLimits`], so a
//! second, different answer cannot redirect a connection while the pin holds. The HTTP client
//! resolves only through it, so the address it connects to is always one that was validated.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use hickory_resolver::TokioResolver;

use crate::policy::{EgressDenial, EgressPolicy};
use crate::url::EgressHost;

/// What a resolver found for one name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// Every address in the answer.
    pub addrs: Vec<IpAddr>,
    /// How long the answer may be used.
    pub ttl: Duration,
}

/// Why a name did not resolve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The name does not exist, or has no address records.
    #[error("no address records")]
    NotFound,
    /// The lookup itself failed (no reachable server, timeout, bad configuration).
    #[error("dns lookup failed: {0}")]
    Failed(String),
}

/// The boxed future a [`NameResolver`] returns.
pub type LookupFuture<'a> = Pin<Box<dyn Future<Output = Result<Lookup, ResolveError>> + Send + 'a>>;

/// Resolves a DNS name to addresses. Implementations do no policy checks of their own.
pub trait NameResolver: Send + Sync + fmt::Debug {
    /// Looks `name` up (lowercase, no trailing dot).
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a>;
}

/// The operating system's resolver configuration (`/etc/resolv.conf`, hosts file), via hickory.
#[derive(Debug, Clone)]
pub struct SystemResolver {
    inner: TokioResolver,
}

impl SystemResolver {
    /// Reads the system configuration; sends nothing until the first lookup.
    pub fn from_system_conf() -> Result<Self, ResolveError> {
        let inner = TokioResolver::builder_tokio()
            .and_then(|builder| builder.build())
            .map_err(|error| ResolveError::Failed(error.to_string()))?;
        Ok(Self { inner })
    }
}

impl NameResolver for SystemResolver {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        Box::pin(async move {
            // A trailing dot makes the name fully qualified: no search-domain expansion.
            let fqdn = format!("{name}.");
            let answer = self.inner.lookup_ip(fqdn).await.map_err(|error| {
                if error.is_no_records_found() || error.is_nx_domain() {
                    ResolveError::NotFound
                } else {
                    ResolveError::Failed(error.to_string())
                }
            })?;
            let ttl = answer
                .valid_until()
                .saturating_duration_since(Instant::now());
            Ok(Lookup {
                addrs: answer.iter().collect(),
                ttl,
            })
        })
    }
}

/// A fixed name-to-addresses map: `wor egress check --resolve HOST:IP`, and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StaticResolver {
    entries: HashMap<String, Vec<IpAddr>>,
    ttl: Duration,
}

/// Why a `HOST:IP` entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StaticEntryError {
    /// Not `HOST:IP`.
    #[error("resolve entry `{0}` is not HOST:IP")]
    Malformed(String),
    /// The address part is not an IP address.
    #[error("resolve entry `{0}` has an invalid ip address")]
    InvalidIp(String),
}

impl StaticResolver {
    /// An empty map whose answers carry a 60 s TTL.
    pub fn new() -> Self {
        Self {
            entries: HashMap::new(),
            ttl: Duration::from_secs(60),
        }
    }

    /// Adds `ip` to the answers for `host` (case and trailing dot ignored).
    pub fn insert(&mut self, host: &str, ip: IpAddr) -> &mut Self {
        self.entries.entry(normalise(host)).or_default().push(ip);
        self
    }

    /// Adds a `HOST:IP` entry (`example.com:10.0.0.1`, `example.com:[::1]`, `example.com:::1`).
    pub fn insert_entry(&mut self, entry: &str) -> Result<&mut Self, StaticEntryError> {
        let (host, ip) = entry
            .split_once(':')
            .filter(|(host, _)| !host.is_empty())
            .ok_or_else(|| StaticEntryError::Malformed(entry.into()))?;
        let ip = ip
            .strip_prefix('[')
            .and_then(|ip| ip.strip_suffix(']'))
            .unwrap_or(ip);
        let ip = IpAddr::from_str(ip).map_err(|_| StaticEntryError::InvalidIp(entry.into()))?;
        Ok(self.insert(host, ip))
    }

    /// The TTL every answer carries.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }
}

impl NameResolver for StaticResolver {
    fn lookup<'a>(&'a self, name: &'a str) -> LookupFuture<'a> {
        let found = self.entries.get(&normalise(name)).cloned();
        let ttl = self.ttl;
        Box::pin(async move {
            match found {
                Some(addrs) if !addrs.is_empty() => Ok(Lookup { addrs, ttl }),
                _ => Err(ResolveError::NotFound),
            }
        })
    }
}

fn normalise(host: &str) -> String {
    host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase()
}

/// Bounds on how long and how many validated answers are pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinLimits {
    /// Shortest pin, whatever the TTL says: a TTL of 0 must not reopen the rebinding window
    /// between the check and the connect.
    pub min_ttl: Duration,
    /// Longest pin.
    pub max_ttl: Duration,
    /// Most names pinned at once; the pin closest to expiry is dropped first.
    pub max_entries: usize,
}

impl Default for PinLimits {
    fn default() -> Self {
        Self {
            min_ttl: Duration::from_secs(30),
            max_ttl: Duration::from_secs(300),
            max_entries: 4096,
        }
    }
}

/// Why [`GuardedResolver::resolve`] gave no addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardedLookupError {
    /// An answer is a special-use address the policy does not allow.
    #[error(transparent)]
    Denied(EgressDenial),
    /// The name did not resolve.
    #[error("could not resolve `{host}`: {source}")]
    Resolve {
        /// The name.
        host: String,
        /// What went wrong.
        source: ResolveError,
    },
}

#[derive(Debug)]
struct PinnedAnswer {
    addrs: Vec<IpAddr>,
    until: Instant,
}

/// A [`NameResolver`] behind the address policy, with per-name pinning.
#[derive(Debug)]
pub struct GuardedResolver {
    inner: Arc<dyn NameResolver>,
    policy: Arc<EgressPolicy>,
    limits: PinLimits,
    // INVARIANT: every pinned address passed `policy` when it was pinned.
    pins: Mutex<HashMap<String, PinnedAnswer>>,
}

impl GuardedResolver {
    /// Guards `inner` with `policy` and the default [`PinLimits`].
    pub fn new(inner: Arc<dyn NameResolver>, policy: Arc<EgressPolicy>) -> Self {
        Self::with_limits(inner, policy, PinLimits::default())
    }

    /// Guards `inner` with `policy` and the given pin bounds.
    pub fn with_limits(
        inner: Arc<dyn NameResolver>,
        policy: Arc<EgressPolicy>,
        limits: PinLimits,
    ) -> Self {
        Self {
            inner,
            policy,
            limits,
            pins: Mutex::new(HashMap::new()),
        }
    }

    /// The policy every answer is checked against.
    pub fn policy(&self) -> &EgressPolicy {
        &self.policy
    }

    /// The validated addresses for `host`: the pinned answer while it holds, else a fresh
    /// lookup whose every address passed the policy.
    pub async fn resolve(&self, host: &str) -> Result<Vec<IpAddr>, GuardedLookupError> {
        let name = normalise(host);
        if let Some(addrs) = self.pinned(&name) {
            return Ok(addrs);
        }
        let lookup = if is_localhost(&name) {
            // RFC 6761: localhost names are loopback, whatever a DNS server says.
            Lookup {
                addrs: vec![
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(Ipv6Addr::LOCALHOST),
                ],
                ttl: self.limits.max_ttl,
            }
        } else {
            self.inner
                .lookup(&name)
                .await
                .map_err(|source| GuardedLookupError::Resolve {
                    host: name.clone(),
                    source,
                })?
        };
        if lookup.addrs.is_empty() {
            return Err(GuardedLookupError::Resolve {
                host: name,
                source: ResolveError::NotFound,
            });
        }
        for &ip in &lookup.addrs {
            if let Err(range) = self.policy.check_address(ip) {
                return Err(GuardedLookupError::Denied(EgressDenial::Address {
                    host: EgressHost::Name(name),
                    ip,
                    range,
                }));
            }
        }
        Ok(self.pin(name, lookup))
    }

    fn pinned(&self, name: &str) -> Option<Vec<IpAddr>> {
        let pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        pins.get(name)
            .filter(|pin| pin.until > Instant::now())
            .map(|pin| pin.addrs.clone())
    }

    /// Pins `lookup` unless a concurrent lookup pinned the name first; returns what is pinned.
    fn pin(&self, name: String, lookup: Lookup) -> Vec<IpAddr> {
        let now = Instant::now();
        let ttl = lookup.ttl.clamp(self.limits.min_ttl, self.limits.max_ttl);
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = pins.get(&name).filter(|pin| pin.until > now) {
            return existing.addrs.clone();
        }
        if pins.len() >= self.limits.max_entries {
            pins.retain(|_, pin| pin.until > now);
        }
        while pins.len() >= self.limits.max_entries.max(1) {
            let Some(oldest) = pins
                .iter()
                .min_by_key(|(_, pin)| pin.until)
                .map(|(name, _)| name.clone())
            else {
                break;
            };
            pins.remove(&oldest);
        }
        let addrs = lookup.addrs;
        pins.insert(
            name,
            PinnedAnswer {
                addrs: addrs.clone(),
                until: now.checked_add(ttl).unwrap_or(now),
            },
        );
        addrs
    }
}

pub(crate) fn is_localhost(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Answers each lookup with the next entry of a script (then repeats the last one).
    #[derive(Debug)]
    struct Scripted {
        answers: Vec<Vec<IpAddr>>,
        calls: AtomicUsize,
        ttl: Duration,
    }

    impl NameResolver for Scripted {
        fn lookup<'a>(&'a self, _name: &'a str) -> LookupFuture<'a> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let addrs = self
                .answers
                .get(call)
                .or(self.answers.last())
                .cloned()
                .unwrap_or_default();
            let ttl = self.ttl;
            Box::pin(async move { Ok(Lookup { addrs, ttl }) })
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|ip| ip.parse().unwrap()).collect()
    }

    fn scripted(answers: &[&[&str]], ttl: Duration) -> Arc<Scripted> {
        Arc::new(Scripted {
            answers: answers.iter().map(|a| ips(a)).collect(),
            calls: AtomicUsize::new(0),
            ttl,
        })
    }

    fn dev() -> Arc<EgressPolicy> {
        Arc::new(EgressPolicy::development())
    }

    #[tokio::test]
    async fn one_bad_answer_refuses_the_name() {
        let stub = scripted(&[&["93.184.215.14", "10.0.0.7"]], Duration::from_secs(60));
        let guard = GuardedResolver::new(stub, dev());
        let Err(GuardedLookupError::Denied(EgressDenial::Address { ip, range, .. })) =
            guard.resolve("mixed.example").await
        else {
            panic!("a private answer must refuse the name");
        };
        assert_eq!(ip, "10.0.0.7".parse::<IpAddr>().unwrap());
        assert_eq!(range.name(), "private-use");
    }

    #[tokio::test]
    async fn a_pinned_answer_survives_a_rebinding_attempt() {
        let stub = scripted(&[&["93.184.215.14"], &["127.0.0.1"]], Duration::ZERO);
        let guard = GuardedResolver::new(stub.clone(), dev());
        for _ in 0..3 {
            assert_eq!(
                guard.resolve("rebind.example").await.unwrap(),
                ips(&["93.184.215.14"])
            );
        }
        assert_eq!(stub.calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn after_the_pin_expires_the_new_answer_is_checked_again() {
        let stub = scripted(&[&["93.184.215.14"], &["127.0.0.1"]], Duration::ZERO);
        let limits = PinLimits {
            min_ttl: Duration::ZERO,
            max_ttl: Duration::ZERO,
            max_entries: 8,
        };
        let guard = GuardedResolver::with_limits(stub, dev(), limits);
        assert!(guard.resolve("rebind.example").await.is_ok());
        let second = guard.resolve("rebind.example").await;
        assert!(
            matches!(&second, Err(GuardedLookupError::Denied(d)) if d.to_string().contains("loopback")),
            "{second:?}"
        );
    }

    #[tokio::test]
    async fn denied_answers_are_not_pinned() {
        let stub = scripted(
            &[&["10.0.0.1"], &["93.184.215.14"]],
            Duration::from_secs(60),
        );
        let guard = GuardedResolver::new(stub, dev());
        assert!(guard.resolve("a.example").await.is_err());
        assert_eq!(
            guard.resolve("a.example").await.unwrap(),
            ips(&["93.184.215.14"])
        );
    }

    #[tokio::test]
    async fn the_pin_table_is_bounded() {
        let stub = scripted(&[&["93.184.215.14"]], Duration::from_secs(60));
        let limits = PinLimits {
            max_entries: 2,
            ..PinLimits::default()
        };
        let guard = GuardedResolver::with_limits(stub, dev(), limits);
        for name in ["a.example", "b.example", "c.example", "d.example"] {
            guard.resolve(name).await.unwrap();
        }
        let pins = guard.pins.lock().unwrap();
        assert_eq!(pins.len(), 2);
        assert!(pins.contains_key("d.example"));
    }

    #[tokio::test]
    async fn localhost_names_are_loopback_without_asking_dns() {
        let stub = scripted(&[&["93.184.215.14"]], Duration::from_secs(60));
        let guard = GuardedResolver::new(stub.clone(), dev());
        for name in ["localhost", "LOCALHOST.", "app.localhost"] {
            let result = guard.resolve(name).await;
            assert!(
                matches!(&result, Err(GuardedLookupError::Denied(d)) if d.to_string().contains("loopback")),
                "{name}: {result:?}"
            );
        }
        assert_eq!(stub.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn static_entries() {
        let mut map = StaticResolver::new();
        map.insert_entry("Example.COM:10.0.0.1").unwrap();
        map.insert_entry("example.com:[::1]").unwrap();
        map.insert_entry("v6.example:::1").unwrap();
        assert_eq!(
            map.lookup("example.com").await.unwrap().addrs,
            ips(&["10.0.0.1", "::1"])
        );
        assert_eq!(map.lookup("v6.example").await.unwrap().addrs, ips(&["::1"]));
        assert_eq!(
            map.lookup("other.example").await,
            Err(ResolveError::NotFound)
        );
        assert_eq!(
            map.insert_entry("example.com").err(),
            Some(StaticEntryError::Malformed("example.com".into()))
        );
        assert_eq!(
            map.insert_entry("example.com:10.0.0.300").err(),
            Some(StaticEntryError::InvalidIp("example.com:10.0.0.300".into()))
        );
    }

    #[tokio::test]
    async fn unknown_names_do_not_resolve() {
        let guard = GuardedResolver::new(Arc::new(StaticResolver::new()), dev());
        assert_eq!(
            guard.resolve("nowhere.example").await,
            Err(GuardedLookupError::Resolve {
                host: "nowhere.example".into(),
                source: ResolveError::NotFound
            })
        );
    }
}
