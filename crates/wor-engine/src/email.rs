//! Approval requests by email: routes that mail each request (or a digest of them) through an
//! SMTP relay, with a link to the console's page for that approval (docs/notifications.md).
//!
//! Deciding is never done by email: the link opens the console, where a signed-in member
//! decides under the same rules as everywhere else. The relay is reached only through
//! [`wor_egress::EgressClient::connect_tcp`], which vets the destination like any request and
//! dials only a validated address; lettre speaks SMTP over that stream and never opens a socket
//! of its own (`clippy.toml` bans its own dialling functions). `STARTTLS` is required before
//! any credential or message is sent, unless the route is a plaintext one to a loopback relay
//! and the operator's configuration allows that.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lettre::message::header::{ContentTransferEncoding, ContentType};
use lettre::message::{Mailbox, SinglePart};
use lettre::transport::smtp::authentication::{Credentials, Mechanism};
use lettre::transport::smtp::client::{AsyncSmtpConnection, AsyncTokioStream, TlsParameters};
use lettre::transport::smtp::extension::ClientId;
use rustls::pki_types::{CertificateDer, ServerName};
use secrecy::{ExposeSecret as _, SecretString};
use serde_json::Value;
use wor_core::ProjectId;
use wor_core::audit::Actor;
use wor_store::{
    ApprovalRecord, ApprovalStatus, AttemptOutcome, NewNotificationRoute,
    NotificationDeliveryRecord, NotificationRouteRecord, RouteChannel, SmtpTls, StoreError,
};

use crate::metrics::DeliveryResult;
use crate::notice::{MAX_DIGEST_MINUTES, MAX_RECIPIENTS, RouteError, route_slot, shown_value};
use crate::triggers::{PassRoom, retry_at};
use crate::{Engine, EngineError};

/// The vault field of a route's SMTP user name.
pub const SMTP_USERNAME_FIELD: &str = "smtp_username";
/// The vault field of a route's SMTP password.
pub const SMTP_PASSWORD_FIELD: &str = "smtp_password";

/// Time allowed for one whole SMTP exchange, from the greeting to `QUIT`.
pub(crate) const SMTP_TIMEOUT: Duration = Duration::from_secs(60);

/// A route's SMTP credentials, as an admin gives them; sealed at once, never shown again.
/// Both or neither: a relay that needs no login (a local one) gets none.
pub struct SmtpSecrets {
    pub username: SecretString,
    pub password: SecretString,
}

impl std::fmt::Debug for SmtpSecrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SmtpSecrets(***)")
    }
}

/// Why an email could not be sent; the text is what `wor notify deliveries` shows.
#[derive(Debug, thiserror::Error)]
enum MailError {
    #[error("{0}")]
    Egress(#[from] wor_egress::EgressError),
    #[error(
        "plaintext SMTP is not allowed by the server's configuration (`[notifications] smtp_plaintext_loopback`)"
    )]
    PlaintextNotAllowed,
    #[error("plaintext SMTP goes only to a loopback relay; `{host}` is {addr}")]
    PlaintextNotLoopback { host: String, addr: SocketAddr },
    #[error("the relay does not offer STARTTLS; nothing was sent")]
    NoStarttls,
    #[error("the STARTTLS handshake failed; nothing was sent: {0}")]
    Starttls(#[source] lettre::transport::smtp::Error),
    #[error("the TLS handshake failed; nothing was sent: {0}")]
    ImplicitTls(#[source] std::io::Error),
    #[error("TLS cannot be set up: {0}")]
    TlsSetup(String),
    #[error("the SMTP exchange did not finish within {0:?}")]
    Timeout(Duration),
    #[error("the route's credentials cannot be opened: {0}")]
    Credentials(String),
    #[error("the message cannot be built: {0}")]
    Message(String),
    #[error("SMTP: {0}")]
    Smtp(#[from] lettre::transport::smtp::Error),
}

impl MailError {
    /// The class of the failure, for the delivery metric.
    fn result(&self) -> DeliveryResult {
        match self {
            MailError::Egress(error) => DeliveryResult::of_egress(error),
            MailError::NoStarttls
            | MailError::Starttls(_)
            | MailError::ImplicitTls(_)
            | MailError::TlsSetup(_) => DeliveryResult::Tls,
            MailError::Timeout(_) => DeliveryResult::Unreachable,
            MailError::PlaintextNotAllowed
            | MailError::PlaintextNotLoopback { .. }
            | MailError::Credentials(_)
            | MailError::Message(_) => DeliveryResult::Undeliverable,
            MailError::Smtp(error) if error.is_transient() || error.is_permanent() => {
                DeliveryResult::Refused
            }
            MailError::Smtp(error) if error.is_tls() => DeliveryResult::Tls,
            MailError::Smtp(_) => DeliveryResult::Unreachable,
        }
    }
}

/// A host name or address an SMTP route may name: a DNS name of letters, digits, `-` and `.`,
/// or an IP literal.
fn is_smtp_host(host: &str) -> bool {
    host.parse::<std::net::IpAddr>().is_ok()
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
}

/// The authority of `host:port`, IPv6 literals in brackets.
fn authority(host: &str, port: u16) -> String {
    match host.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{host}]:{port}"),
        Err(_) => format!("{host}:{port}"),
    }
}

/// When a digest of `minutes` that starts collecting at `now` is sent: the end of the current
/// window, so every request of one window goes out together.
pub(crate) fn digest_due(now: i64, minutes: u32) -> i64 {
    let period = i64::from(minutes.max(1)) * 60_000;
    (now / period + 1).saturating_mul(period)
}

impl Engine {
    /// Makes an email route and seals its SMTP credentials (S3). Its relay is vetted by the
    /// egress guard now (an address literal) and at every send (a name).
    pub async fn create_email_route(
        &self,
        project: ProjectId,
        route: NewNotificationRoute,
        secrets: Option<SmtpSecrets>,
        actor: Actor,
    ) -> Result<NotificationRouteRecord, EngineError> {
        let RouteChannel::Email {
            smtp_host,
            smtp_port,
            tls,
            from,
            to,
            digest_minutes,
        } = &route.channel
        else {
            return Err(RouteError::NotEmail.into());
        };
        if !is_smtp_host(smtp_host) {
            return Err(RouteError::SmtpHost.into());
        }
        if *smtp_port == 0 {
            return Err(RouteError::SmtpPort.into());
        }
        self.egress
            .vet_destination(&format!("https://{}/", authority(smtp_host, *smtp_port)))
            .map_err(|denial| RouteError::Destination {
                field: "smtp_host",
                denial,
            })?;
        if *tls == SmtpTls::PlaintextLoopback {
            if !self.config.smtp_plaintext_loopback {
                return Err(RouteError::PlaintextNotAllowed.into());
            }
            let loopback = smtp_host == "localhost"
                || smtp_host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(RouteError::PlaintextNotLoopback.into());
            }
        }
        from.parse::<Mailbox>().map_err(|_| RouteError::From)?;
        if to.is_empty() || to.len() > MAX_RECIPIENTS {
            return Err(RouteError::RecipientCount.into());
        }
        for address in to {
            address
                .parse::<Mailbox>()
                .map_err(|_| RouteError::Recipient {
                    address: wor_core::quote::excerpt(address, 100),
                })?;
        }
        if digest_minutes.is_some_and(|m| m == 0 || m > MAX_DIGEST_MINUTES) {
            return Err(RouteError::DigestMinutes.into());
        }
        let sealed = match secrets {
            Some(secrets) => vec![
                (SMTP_USERNAME_FIELD, secrets.username),
                (SMTP_PASSWORD_FIELD, secrets.password),
            ],
            None => Vec::new(),
        };
        self.create_route(project, route, sealed, actor).await
    }

    /// Sends the due email deliveries of one route: one message per delivery, or for a digest
    /// route one message for all of them, each while `room` has room for it (what it did not
    /// start is given back when the process is stopping). Returns each delivery attempted with
    /// what came of it.
    pub(crate) async fn attempt_emails(
        &self,
        deliveries: &[NotificationDeliveryRecord],
        room: &PassRoom,
    ) -> Result<Vec<(String, AttemptOutcome, DeliveryResult)>, EngineError> {
        let Some(first) = deliveries.first() else {
            return Ok(Vec::new());
        };
        let give_up = |error: &str| AttemptOutcome::Failed {
            status_code: None,
            error: error.to_owned(),
            retry_at: None,
        };
        let every = |outcome: AttemptOutcome| -> Vec<(String, AttemptOutcome, DeliveryResult)> {
            deliveries
                .iter()
                .map(|d| (d.id.clone(), outcome.clone(), DeliveryResult::Undeliverable))
                .collect()
        };
        let project = first.project_id;
        let route = match self
            .store
            .get_notification_route(project, first.route_id)
            .await
        {
            Ok(route) => route,
            Err(StoreError::NotFound) => return Ok(every(give_up("the route was deleted"))),
            Err(other) => return Err(other.into()),
        };
        let digest = matches!(
            route.channel,
            RouteChannel::Email {
                digest_minutes: Some(_),
                ..
            }
        );
        let groups: Vec<&[NotificationDeliveryRecord]> = if digest {
            vec![deliveries]
        } else {
            deliveries.chunks(1).collect()
        };
        let mut outcomes = Vec::with_capacity(deliveries.len());
        // The groups are the deliveries in order: the `started`-th begins at that delivery
        // (one each), or is all of them (a digest).
        for (started, group) in groups.into_iter().enumerate() {
            if !room.for_one_more(SMTP_TIMEOUT) {
                let unstarted = deliveries.get(started..).unwrap_or_default();
                self.give_back_unstarted(unstarted, room).await?;
                break;
            }
            let Some(lead) = group.first() else {
                continue;
            };
            let mut approvals = Vec::with_capacity(group.len());
            for delivery in group {
                approvals.push(
                    self.store
                        .get_approval(project, delivery.approval_id)
                        .await?,
                );
            }
            let (outcome, result) = match self.send_approval_email(&route, &approvals).await {
                Ok(code) => (
                    AttemptOutcome::Delivered { status_code: code },
                    DeliveryResult::Delivered,
                ),
                Err(error) => (
                    AttemptOutcome::Failed {
                        status_code: None,
                        error: wor_secrets::redact_shapes(&error.to_string()).into_owned(),
                        // A digest's deliveries are retried together, on its first one's
                        // schedule.
                        retry_at: retry_at(&lead.id, lead.attempts + 1),
                    },
                    error.result(),
                ),
            };
            outcomes.extend(
                group
                    .iter()
                    .map(|d| (d.id.clone(), outcome.clone(), result)),
            );
        }
        Ok(outcomes)
    }

    /// Builds and sends one message about `approvals` through `route`'s relay.
    async fn send_approval_email(
        &self,
        route: &NotificationRouteRecord,
        approvals: &[ApprovalRecord],
    ) -> Result<u16, MailError> {
        let RouteChannel::Email {
            smtp_host,
            smtp_port,
            tls,
            from,
            to,
            ..
        } = &route.channel
        else {
            return Err(MailError::Message(
                "the route is not an email route".to_owned(),
            ));
        };
        let mut sections = Vec::with_capacity(approvals.len());
        for approval in approvals {
            sections.push(
                self.email_section(approval)
                    .await
                    .map_err(|e| MailError::Message(e.to_string()))?,
            );
        }
        let subject = match approvals {
            [one] => {
                let tool = plain_line(&one.tool);
                format!("Approval needed: {tool}")
            }
            many => format!("{} approval requests", many.len()),
        };
        let mut body = String::new();
        if approvals.len() > 1 {
            body.push_str(&format!(
                "{} approval requests since the last message. Deciding needs a signed-in session in the console; nothing in this message decides.\n\n",
                approvals.len()
            ));
        }
        body.push_str(&sections.join("\n----\n\n"));
        let mut builder = lettre::Message::builder()
            .from(
                from.parse()
                    .map_err(|_| MailError::Message("`from` is not an address".to_owned()))?,
            )
            .subject(subject);
        for address in to {
            builder = builder.to(address
                .parse()
                .map_err(|_| MailError::Message("a recipient is not an address".to_owned()))?);
        }
        let message = builder
            .singlepart(
                SinglePart::builder()
                    .header(ContentType::TEXT_PLAIN)
                    .header(ContentTransferEncoding::Base64)
                    .body(body),
            )
            .map_err(|e| MailError::Message(e.to_string()))?;
        let credentials = self.smtp_credentials(route).await?;
        tokio::time::timeout(
            SMTP_TIMEOUT,
            self.smtp_send(smtp_host, *smtp_port, *tls, credentials, &message),
        )
        .await
        .map_err(|_| MailError::Timeout(SMTP_TIMEOUT))?
    }

    async fn smtp_credentials(
        &self,
        route: &NotificationRouteRecord,
    ) -> Result<Option<Credentials>, MailError> {
        let mut opened = Vec::with_capacity(2);
        for field in [SMTP_USERNAME_FIELD, SMTP_PASSWORD_FIELD] {
            match self
                .vault
                .open(&route_slot(route.project_id, route.id, field))
                .await
            {
                Ok(value) => opened.push(Some(value)),
                Err(wor_store::VaultError::Missing { .. }) => opened.push(None),
                Err(error) => return Err(MailError::Credentials(error.to_string())),
            }
        }
        let mut opened = opened.into_iter();
        let (username, password) = (opened.next().flatten(), opened.next().flatten());
        Ok(match (username, password) {
            (Some(username), Some(password)) => Some(Credentials::new(
                username.expose_secret().to_owned(),
                password.expose_secret().to_owned(),
            )),
            _ => None,
        })
    }

    /// One SMTP exchange over a connection the egress guard opened.
    async fn smtp_send(
        &self,
        host: &str,
        port: u16,
        tls: SmtpTls,
        credentials: Option<Credentials>,
        message: &lettre::Message,
    ) -> Result<u16, MailError> {
        if tls == SmtpTls::PlaintextLoopback && !self.config.smtp_plaintext_loopback {
            return Err(MailError::PlaintextNotAllowed);
        }
        let (stream, addr) = self.egress.connect_tcp(host, port).await?;
        if tls == SmtpTls::PlaintextLoopback && !addr.ip().is_loopback() {
            return Err(MailError::PlaintextNotLoopback {
                host: host.to_owned(),
                addr,
            });
        }
        let hello = self.hello_name();
        let mut connection = match tls {
            SmtpTls::ImplicitTls => {
                // TLS from the first byte (SMTPS): the handshake with the relay's certificate
                // checked, then SMTP inside it.
                let stream = self.smtps_handshake(host, stream).await?;
                AsyncSmtpConnection::connect_with_transport(Box::new(stream), &hello).await?
            }
            SmtpTls::Starttls | SmtpTls::PlaintextLoopback => {
                AsyncSmtpConnection::connect_with_transport(Box::new(stream), &hello).await?
            }
        };
        if tls == SmtpTls::Starttls {
            // Before any credential or message: a relay that cannot encrypt gets neither.
            if !connection.can_starttls() {
                connection.abort().await;
                return Err(MailError::NoStarttls);
            }
            let mut parameters = TlsParameters::builder(host.to_owned());
            for der in &self.config.smtp_root_certificates {
                parameters = parameters.add_root_certificate(
                    lettre::transport::smtp::client::Certificate::from_der(der.clone())
                        .map_err(|e| MailError::TlsSetup(e.to_string()))?,
                );
            }
            let parameters = parameters
                .build_rustls()
                .map_err(|e| MailError::TlsSetup(e.to_string()))?;
            connection
                .starttls(parameters, &hello)
                .await
                .map_err(MailError::Starttls)?;
        }
        if let Some(credentials) = credentials {
            connection
                .auth(&[Mechanism::Plain, Mechanism::Login], &credentials)
                .await?;
        }
        let response = connection
            .send(message.envelope(), &message.formatted())
            .await?;
        let _ = connection.quit().await;
        Ok(u16::from(response.code()))
    }

    /// The TLS handshake of an implicit-TLS (SMTPS) relay over a connection the egress guard
    /// opened: the certificate is checked by the platform's verifier, with the operator's
    /// extra roots (`[notifications] smtp_ca_file`), for `host` — as STARTTLS checks it.
    async fn smtps_handshake(
        &self,
        host: &str,
        stream: tokio::net::TcpStream,
    ) -> Result<SmtpsStream, MailError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let roots = self
            .config
            .smtp_root_certificates
            .iter()
            .map(|der| CertificateDer::from(der.clone()));
        let verifier =
            rustls_platform_verifier::Verifier::new_with_extra_roots(roots, provider.clone())
                .map_err(|e| MailError::TlsSetup(e.to_string()))?;
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| MailError::TlsSetup(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| MailError::TlsSetup(format!("`{host}` is not a TLS server name")))?;
        let peer = stream.peer_addr().map_err(MailError::ImplicitTls)?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, stream)
            .await
            .map_err(MailError::ImplicitTls)?;
        Ok(SmtpsStream { tls, peer })
    }

    /// The name this server greets a relay with: the public URL's host, else `localhost`.
    fn hello_name(&self) -> ClientId {
        let host = self
            .config
            .console_url
            .as_deref()
            .and_then(|url| url::Url::parse(url).ok())
            .and_then(|url| url.host_str().map(str::to_owned))
            .filter(|host| is_smtp_host(host) && host.parse::<std::net::IpAddr>().is_err());
        ClientId::Domain(host.unwrap_or_else(|| "localhost".to_owned()))
    }

    /// What an email says about one approval, as it stands: the same facts as a Slack
    /// message, as plain text, and the link to its page in the console.
    async fn email_section(&self, approval: &ApprovalRecord) -> Result<String, EngineError> {
        let project = approval.project_id;
        let run = self.store.get_run(project, approval.run_id).await?;
        let routine = self.store.get_routine(project, run.routine_id).await?;
        let mut text = format!(
            "Approval needed for {} in routine {} (version {}), run {}.\n\n",
            approval.tool, routine.name, run.routine_version, run.id
        );
        text.push_str(
            "Arguments (canonical; \"pinned\" ones were set by the routine, not the model):\n",
        );
        match approval.arguments.as_object() {
            Some(map) if !map.is_empty() => {
                for (key, value) in map {
                    let pinned = approval.pinned_keys.iter().any(|k| k == key);
                    text.push_str(&format!(
                        "  {key}{}: {}\n",
                        if pinned { " (pinned)" } else { "" },
                        shown_value(value)
                    ));
                }
            }
            _ => text.push_str("  (no arguments)\n"),
        }
        text.push_str("\nWhy it is held:\n");
        let list = |key: &str| -> Vec<String> {
            approval
                .why
                .get(key)
                .and_then(Value::as_array)
                .map(|l| {
                    l.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut why = Vec::new();
        for (key, label) in [
            ("reasons", "Reasons"),
            ("determining_policies", "Policies"),
            ("untrusted_sources", "Untrusted content in context"),
        ] {
            let items = list(key);
            if !items.is_empty() {
                why.push(format!("  {label}: {}", items.join("; ")));
            }
        }
        if approval.kind == wor_store::ApprovalKind::OutcomeUnknown {
            why.push("  The call started before an interruption and its outcome is unknown: approving runs it again.".to_owned());
        }
        if why.is_empty() {
            why.push("  Held by policy.".to_owned());
        }
        text.push_str(&why.join("\n"));
        text.push('\n');
        let expires = wor_core::schedule::slot_rfc3339(approval.expires_at);
        text.push_str(&match approval.status {
            ApprovalStatus::Pending => format!("\nExpires at {expires} unless decided.\n"),
            ApprovalStatus::Approved => "\nAlready approved.\n".to_owned(),
            ApprovalStatus::Denied => "\nAlready denied.\n".to_owned(),
            ApprovalStatus::Expired => {
                format!("\nExpired at {expires} without a decision: the call did not run.\n")
            }
            ApprovalStatus::Cancelled => {
                "\nCancelled: the run ended before anyone decided.\n".to_owned()
            }
        });
        match self.config.console_url.as_deref() {
            Some(base) => text.push_str(&format!(
                "\nDecide in the console (sign-in required; nothing in this email decides):\n{}/console/approvals/{}\n",
                base.trim_end_matches('/'),
                approval.id
            )),
            None => text.push_str(&format!(
                "\nDecide it in the console's inbox, or with `wor approvals approve {}`.\n",
                approval.id
            )),
        }
        Ok(text)
    }
}

/// An SMTPS connection: TLS over the TCP stream the egress guard opened, for lettre to speak
/// SMTP over.
#[derive(Debug)]
struct SmtpsStream {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    peer: SocketAddr,
}

impl tokio::io::AsyncRead for SmtpsStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for SmtpsStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tls).poll_shutdown(cx)
    }
}

impl AsyncTokioStream for SmtpsStream {
    fn peer_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.peer)
    }
}

/// Text for a header: control characters (a line break would start a new header) become
/// spaces, and it is cut to 150 characters.
fn plain_line(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(150)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_is_due_at_the_end_of_its_window() {
        let minute = 60_000;
        assert_eq!(digest_due(0, 5), 5 * minute);
        assert_eq!(digest_due(5 * minute - 1, 5), 5 * minute);
        assert_eq!(digest_due(5 * minute, 5), 10 * minute);
        // Two requests a minute apart in one window go out together.
        assert_eq!(digest_due(61 * minute, 15), digest_due(62 * minute, 15));
    }

    #[test]
    fn hosts_and_header_text_are_checked() {
        assert!(is_smtp_host("smtp.example.com"));
        assert!(is_smtp_host("127.0.0.1"));
        assert!(is_smtp_host("::1"));
        assert!(!is_smtp_host("smtp.example.com:25"));
        assert!(!is_smtp_host("a b"));
        assert!(!is_smtp_host(""));
        assert_eq!(authority("::1", 25), "[::1]:25");
        assert_eq!(plain_line("a\r\nBcc: x"), "a  Bcc: x");
    }
}
