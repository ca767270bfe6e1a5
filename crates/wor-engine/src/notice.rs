//! What every kind of approval notification shares: where a route's secrets are sealed, and
//! how an argument's value is shown in a message (Slack and email alike).

use serde_json::Value;
use wor_core::{NotificationRouteId, ProjectId};
use wor_store::{NOTIFICATION_ROUTES_TABLE, SecretSlot};

/// Argument values longer than this are cut in messages (the console shows them whole).
const MAX_SHOWN_VALUE_CHARS: usize = 200;

pub(crate) fn route_slot(
    project: ProjectId,
    route: NotificationRouteId,
    field: &str,
) -> SecretSlot {
    SecretSlot::new(project, NOTIFICATION_ROUTES_TABLE, route, field)
}

/// A value as a message shows it: strings as they are, anything else as canonical JSON, cut
/// to [`MAX_SHOWN_VALUE_CHARS`] with a mark saying how much was left out.
pub(crate) fn shown_value(value: &Value) -> String {
    let text = match value {
        Value::String(s) => s.clone(),
        other => wor_core::canonical::to_canonical_json(other),
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
