//! TLS on the API's listener (rustls): the certificate chain and key from PEM files, reloaded
//! on request (`wor serve` reloads on SIGHUP) without dropping a connection — a connection
//! keeps the configuration it was accepted under, and only new ones get the new certificate.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Handshakes not finished within this are dropped, so a silent client holds nothing.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why the certificate or key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the TLS certificate `{path}`: {reason}")]
    Certificate { path: String, reason: String },
    #[error("cannot read the TLS key `{path}`: {reason}")]
    Key { path: String, reason: String },
    #[error("the TLS certificate and key do not make a server configuration: {0}")]
    Config(#[from] rustls::Error),
    /// A reload's certificate that clients would refuse for its dates.
    #[error("the TLS certificate `{path}` {reason}: clients would refuse it")]
    Dates { path: String, reason: String },
}

/// Seconds in a day, for a certificate's days to its end.
const DAY_SECONDS: i64 = 86_400;

/// How far in the future a reloaded certificate's start may lie and still be taken: clocks
/// differ by that much between a CA and this host.
pub const START_SKEW_SECONDS: i64 = 300;

/// How many days before its end a listener's certificate is warned of (`wor serve` when it
/// starts, `wor doctor`).
pub const EXPIRY_WARNING_DAYS: i64 = 30;

/// Where the certificate chain and its private key are, in PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TlsFiles {
    /// Reads both files and builds a server configuration (HTTP/1.1 over TLS 1.2 and 1.3).
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        self.read().map(|(config, _)| config)
    }

    /// [`TlsFiles::load`], with the certificate it serves (the chain's first), so that what
    /// is judged of it is what was loaded.
    fn read(&self) -> Result<(Arc<ServerConfig>, CertificateDer<'static>), TlsError> {
        let chain = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| TlsError::Certificate {
                path: self.cert.display().to_string(),
                reason: e.to_string(),
            })?;
        let served = chain
            .first()
            .cloned()
            .ok_or_else(|| TlsError::Certificate {
                path: self.cert.display().to_string(),
                reason: "no certificate in the file".to_owned(),
            })?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| TlsError::Key {
            path: self.key.display().to_string(),
            reason: e.to_string(),
        })?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok((Arc::new(config), served))
    }

    /// What the certificate (the first of the chain) says that clients judge it by, or why it
    /// cannot be read.
    pub fn facts(&self) -> Result<CertificateFacts, TlsError> {
        let unreadable = |reason: String| TlsError::Certificate {
            path: self.cert.display().to_string(),
            reason,
        };
        // The first certificate of the file, as `load` serves it: other PEM blocks (a key
        // before it, say) are passed over.
        let first = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| unreadable(e.to_string()))?
            .next()
            .ok_or_else(|| unreadable("no certificate in the file".to_owned()))?
            .map_err(|e| unreadable(e.to_string()))?;
        self.facts_of(&first)
    }

    /// What certificate `der`, read from this chain's file, says that clients judge it by.
    fn facts_of(&self, der: &CertificateDer<'_>) -> Result<CertificateFacts, TlsError> {
        let unreadable = |reason: String| TlsError::Certificate {
            path: self.cert.display().to_string(),
            reason,
        };
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| unreadable(format!("the certificate does not parse: {e}")))?;
        let now = wor_store::now_millis() / 1000;
        // An extension that does not parse (or is there twice) says nothing either way: the
        // expiry is still read.
        let is_ca = cert
            .basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|constraints| constraints.value.ca);
        let names = cert
            .subject_alternative_name()
            .ok()
            .flatten()
            .map_or(0, |names| {
                names
                    .value
                    .general_names
                    .iter()
                    .filter(|name| {
                        matches!(
                            name,
                            x509_parser::extensions::GeneralName::DNSName(_)
                                | x509_parser::extensions::GeneralName::IPAddress(_)
                        )
                    })
                    .count()
            });
        Ok(CertificateFacts {
            cert: self.cert.clone(),
            seconds_to_expiry: cert.validity().not_after.timestamp() - now,
            seconds_to_start: cert.validity().not_before.timestamp() - now,
            is_ca,
            names,
        })
    }
}

/// What a listener's certificate says that clients judge it by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFacts {
    /// The file it was read from.
    pub cert: PathBuf,
    /// Seconds until it expires (negative once it has).
    pub seconds_to_expiry: i64,
    /// Seconds until it becomes valid (positive while it is not yet).
    pub seconds_to_start: i64,
    /// Whether it is a CA certificate (`basicConstraints` CA:TRUE).
    pub is_ca: bool,
    /// How many host names and addresses its `subjectAltName` holds (other kinds of name, an
    /// email or a URI, name no host).
    pub names: usize,
}

impl CertificateFacts {
    /// Whole days until it expires, rounded down; negative once it has (-1 on the day after).
    pub fn days_to_expiry(&self) -> i64 {
        self.seconds_to_expiry.div_euclid(DAY_SECONDS)
    }

    /// Whether it is not valid yet: clients refuse it until then.
    pub fn not_valid_yet(&self) -> bool {
        self.seconds_to_start > 0
    }

    /// When it expires, as a phrase: `expires in N day(s)`, `expired today` or `expired N
    /// day(s) ago` (whole days since).
    pub fn expiry(&self) -> String {
        match self.seconds_to_expiry {
            left if left >= 0 => format!("expires in {} day(s)", left / DAY_SECONDS),
            left => match (-left) / DAY_SECONDS {
                0 => "expired today".to_owned(),
                days => format!("expired {days} day(s) ago"),
            },
        }
    }

    /// How long until it is valid, as a phrase (`N minute(s)` under an hour, else `N hour(s)`,
    /// rounded up).
    fn wait(&self) -> String {
        match self.seconds_to_start {
            seconds if seconds < 3600 => format!("{} minute(s)", (seconds + 59) / 60),
            seconds => format!("{} hour(s)", (seconds + 3599) / 3600),
        }
    }

    /// Why clients would refuse it for its dates, when they would: it has expired, or it is
    /// not valid yet by more than [`START_SKEW_SECONDS`] (a renewal a CA dated this very moment,
    /// seen by a host whose clock runs a little behind, is not refused).
    pub fn refused_for_dates(&self) -> Option<String> {
        if self.seconds_to_expiry < 0 {
            Some(self.expiry())
        } else if self.seconds_to_start > START_SKEW_SECONDS {
            Some(format!("is not valid yet, for {} more", self.wait()))
        } else {
            None
        }
    }

    /// What clients would hold against it, a sentence each: not valid yet, its end within
    /// [`EXPIRY_WARNING_DAYS`] (or past), being a CA certificate, naming no host. `wor serve`
    /// logs them when it starts and when SIGHUP reloads it; `wor doctor` reports them.
    pub fn warnings(&self) -> Vec<String> {
        let cert = self.cert.display();
        let mut warnings = Vec::new();
        if self.not_valid_yet() {
            warnings.push(format!(
                "the listener's TLS certificate `{cert}` is not valid yet, for {} more: \
                 clients refuse it until then",
                self.wait()
            ));
        }
        if self.days_to_expiry() < EXPIRY_WARNING_DAYS {
            warnings.push(format!(
                "the listener's TLS certificate `{cert}` {}: renew it, then reload with SIGHUP",
                self.expiry()
            ));
        }
        if self.is_ca {
            warnings.push(format!(
                "the listener's TLS certificate `{cert}` is a CA certificate: clients that \
                 check, `wor`'s own among them, refuse one as a server's certificate; give one \
                 with basicConstraints CA:FALSE, or one a CA signed"
            ));
        }
        if self.names == 0 {
            warnings.push(format!(
                "the listener's TLS certificate `{cert}` names no host or address \
                 (subjectAltName): clients check the name they connect to against those \
                 names only, not the subject's common name"
            ));
        }
        warnings
    }
}

/// The configuration new connections are accepted under, replaceable while serving.
#[derive(Debug, Clone)]
pub struct ReloadableTls {
    files: TlsFiles,
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl ReloadableTls {
    pub fn load(files: TlsFiles) -> Result<Self, TlsError> {
        let config = files.load()?;
        Ok(ReloadableTls {
            files,
            current: Arc::new(RwLock::new(config)),
        })
    }

    /// Reads the files again; on success new connections get the new certificate. On failure
    /// the previous one stays in use: files that do not load, or a certificate that clients
    /// would refuse for its dates (expired, or not valid yet), which would turn away every new
    /// connection the previous one may still serve.
    pub fn reload(&self) -> Result<(), TlsError> {
        let (config, served) = self.files.read()?;
        if let Some(reason) = self.files.facts_of(&served)?.refused_for_dates() {
            return Err(TlsError::Dates {
                path: self.files.cert.display().to_string(),
                reason,
            });
        }
        match self.current.write() {
            Ok(mut current) => *current = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
        Ok(())
    }

    fn config(&self) -> Arc<ServerConfig> {
        match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

/// A listener whose connections arrive after their TLS handshake; handshakes run on tasks of
/// their own, so a slow client does not hold up the others.
#[derive(Debug)]
pub struct TlsListener {
    local: SocketAddr,
    accepted: mpsc::Receiver<(TlsStream<tokio::net::TcpStream>, SocketAddr)>,
}

impl TlsListener {
    pub fn new(listener: TcpListener, tls: ReloadableTls) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let (sender, accepted) = mpsc::channel(64);
        // Connections in their handshake, or handed over and not yet taken, are bounded as the
        // served ones are (`serving::MAX_CONNECTIONS`): one more waits to be accepted.
        let handshakes =
            std::sync::Arc::new(tokio::sync::Semaphore::new(crate::serving::MAX_CONNECTIONS));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = handshakes.clone().acquire_owned().await else {
                    break;
                };
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(category = "http", kind = ?error.kind(), "accepting a connection failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if sender.is_closed() {
                    break;
                }
                crate::send_at_once(&stream);
                let acceptor = TlsAcceptor::from(tls.config());
                let sender = sender.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = sender.send((stream, peer)).await;
                            drop(permit);
                        }
                        Ok(Err(_)) | Err(_) => {
                            tracing::debug!(
                                category = "http",
                                "a TLS handshake failed or timed out"
                            );
                        }
                    }
                });
            }
        });
        Ok(TlsListener { local, accepted })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accept task only stops once this listener is gone.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(seconds_to_expiry: i64, seconds_to_start: i64) -> CertificateFacts {
        CertificateFacts {
            cert: PathBuf::from("cert.pem"),
            seconds_to_expiry,
            seconds_to_start,
            is_ca: false,
            names: 1,
        }
    }

    #[test]
    fn an_expiry_is_told_in_whole_days_each_side_of_it() {
        let hours = |h: i64| h * 3600;
        for (left, phrase, days) in [
            (hours(49), "expires in 2 day(s)", 2),
            (hours(2), "expires in 0 day(s)", 0),
            (-hours(2), "expired today", -1),
            (-hours(25), "expired 1 day(s) ago", -2),
            (-hours(49), "expired 2 day(s) ago", -3),
        ] {
            let facts = facts(left, -hours(100));
            assert_eq!(facts.expiry(), phrase, "{left}");
            assert_eq!(facts.days_to_expiry(), days, "{left}");
        }
    }

    #[test]
    fn a_certificate_not_valid_yet_is_warned_of() {
        let warnings = facts(86_400 * 90, 7_200).warnings();
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("is not valid yet, for 2 hour(s) more")),
            "{warnings:?}"
        );
        let soon = facts(86_400 * 90, 5).warnings();
        assert!(
            soon.iter().any(|w| w.contains("for 1 minute(s) more")),
            "{soon:?}"
        );
        assert!(facts(86_400 * 90, -1).warnings().is_empty());
    }

    #[test]
    fn a_certificate_clients_would_refuse_for_its_dates_is_named_so() {
        assert_eq!(
            facts(-3600, -86_400).refused_for_dates().as_deref(),
            Some("expired today")
        );
        assert_eq!(
            facts(86_400, 1_800).refused_for_dates().as_deref(),
            Some("is not valid yet, for 30 minute(s) more")
        );
        // A start a few minutes off is a clock's difference, not a certificate's date.
        assert_eq!(facts(86_400, START_SKEW_SECONDS).refused_for_dates(), None);
        // Near its end is warned of, not refused: it still serves.
        assert_eq!(facts(60, -86_400).refused_for_dates(), None);
        assert_eq!(facts(0, 0).refused_for_dates(), None);
    }
}
