//! What every kind of approval notification shares: the rules a new route is checked against,
//! where a route's secrets are sealed, and how an argument's value is shown in a message (Slack
//! and email alike).

use serde_json::Value;
use wor_core::{NotificationRouteId, ProjectId};
use wor_store::{NOTIFICATION_ROUTES_TABLE, SecretSlot};

/// Longest route name.
pub(crate) const MAX_ROUTE_NAME_CHARS: usize = 100;

/// Why a new notification route is refused: each names the field to correct.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("`name` must be 1 to {MAX_ROUTE_NAME_CHARS} characters")]
    Name,
    /// A secret (a token, a password) that is empty, too long or has control characters.
    #[error("`{field}` must be 1 to 512 printable characters")]
    Secret { field: &'static str },
    /// A destination the egress policy does not let deliveries reach.
    #[error("`{field}`: {denial}")]
    Destination {
        field: &'static str,
        denial: Box<wor_egress::EgressDenial>,
    },
    #[error("a Slack route needs a Slack channel")]
    NotSlack,
    #[error("`channel` must be a Slack channel id (letters and digits, such as `C0123ABCD`)")]
    SlackChannel,
    #[error("an email route needs an email channel")]
    NotEmail,
    #[error("`smtp_host` must be a host name (letters, digits, `-` and `.`) or an IP address")]
    SmtpHost,
    #[error("`smtp_port` must be 1 to 65535")]
    SmtpPort,
    #[error(
        "`tls = plaintext_loopback` needs the operator's `[notifications] smtp_plaintext_loopback = true`; otherwise STARTTLS is required"
    )]
    PlaintextNotAllowed,
    #[error(
        "`tls = plaintext_loopback` goes only to a loopback relay (`127.0.0.1`, `::1` or `localhost`)"
    )]
    PlaintextNotLoopback,
    #[error("`email_from` is not an email address")]
    From,
    #[error("`email_to` must list 1 to {} addresses", MAX_RECIPIENTS)]
    RecipientCount,
    /// A recipient that is not an address (its first 100 characters).
    #[error("`email_to`: `{address}` is not an email address")]
    Recipient { address: String },
    #[error("`digest_minutes` must be 1 to {}", MAX_DIGEST_MINUTES)]
    DigestMinutes,
}

/// At most this many recipients per route.
pub(crate) const MAX_RECIPIENTS: usize = 20;
/// The longest digest period, in minutes (a day).
pub(crate) const MAX_DIGEST_MINUTES: u32 = 24 * 60;

/// Argument values longer than this are cut in messages (the console shows them whole).
const MAX_SHOWN_VALUE_CHARS: usize = 200;

pub(crate) fn route_slot(
    project: ProjectId,
    route: NotificationRouteId,
    field: &str,
) -> SecretSlot {
    SecretSlot::new(project, NOTIFICATION_ROUTES_TABLE, route, field)
}

/// A value as a message shows it: strings as they are, anything else as canonical JSON, what
/// would hide or reorder text written as its escape ([`wor_core::text::shown`]), cut to
/// [`MAX_SHOWN_VALUE_CHARS`] with a mark saying how much was left out.
pub(crate) fn shown_value(value: &Value) -> String {
    let text = match value {
        Value::String(s) => wor_core::text::shown(s, |_| false).into_owned(),
        other => wor_core::text::shown(&wor_core::canonical::to_canonical_json(other), |_| false)
            .into_owned(),
    };
    let total = text.chars().count();
    if total <= MAX_SHOWN_VALUE_CHARS {
        return text;
    }
    let shown: String = text.chars().take(MAX_SHOWN_VALUE_CHARS).collect();
    format!(
        "{shown}… ({} more characters; the console shows it whole)",
        total - MAX_SHOWN_VALUE_CHARS
    )
}
