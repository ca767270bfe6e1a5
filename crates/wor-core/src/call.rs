//! The words every crate uses about one proposed tool call: how its tool is classified, how
//! its run was started, and what was decided.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What was decided for one call, by policy or, as `Allow`, by a person's approval. Ordered by
/// strength: when several policies match, the greatest wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The call runs.
    Allow,
    /// The call waits for an approver's decision on that exact call.
    Confirm,
    /// The call does not run; the model gets a clear refusal.
    Deny,
}

impl Verdict {
    pub const ALL: [Verdict; 3] = [Verdict::Allow, Verdict::Confirm, Verdict::Deny];

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Allow => "allow",
            Verdict::Confirm => "confirm",
            Verdict::Deny => "deny",
        }
    }

    /// The verdict `text` names (`allow`, `confirm`, `deny`).
    pub fn parse(text: &str) -> Option<Verdict> {
        Verdict::ALL.into_iter().find(|v| v.as_str() == text)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An admin's classification of a tool (never taken from the tool's own annotations). A tool
/// nobody classified is consequential.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolClass {
    /// Reads only: may run after untrusted content entered the context.
    ReadOnly,
    /// May change something: needs approval once untrusted content is in the context.
    #[default]
    Consequential,
    /// Reads, but contacts destinations its arguments name (URLs, hosts, addresses, channels):
    /// the visit itself can carry data out. Needs approval when a destination-like argument
    /// is not trusted-only while untrusted content is in the context.
    OpenWorld,
}

impl ToolClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolClass::ReadOnly => "read_only",
            ToolClass::Consequential => "consequential",
            ToolClass::OpenWorld => "open_world",
        }
    }

    pub const ALL: [ToolClass; 3] = [
        ToolClass::ReadOnly,
        ToolClass::Consequential,
        ToolClass::OpenWorld,
    ];

    /// The class `text` names (`read_only`, `consequential`, `open_world`).
    pub fn parse(text: &str) -> Option<ToolClass> {
        ToolClass::ALL.into_iter().find(|c| c.as_str() == text)
    }
}

/// How a run was started. Policy may decide on it, so a stored value that is none of these is
/// refused, never read as one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TriggerKind {
    /// By an API caller (or the CLI).
    Api,
    /// By a cron schedule's slot.
    Schedule,
    /// By a signed inbound webhook.
    Webhook,
    /// By another routine's run.
    Routine,
}

impl TriggerKind {
    pub const ALL: [TriggerKind; 4] = [
        TriggerKind::Api,
        TriggerKind::Schedule,
        TriggerKind::Webhook,
        TriggerKind::Routine,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TriggerKind::Api => "api",
            TriggerKind::Schedule => "schedule",
            TriggerKind::Webhook => "webhook",
            TriggerKind::Routine => "routine",
        }
    }
}

impl fmt::Display for TriggerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The text was not a trigger kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a trigger kind")]
pub struct TriggerKindParseError(pub String);

impl std::str::FromStr for TriggerKind {
    type Err = TriggerKindParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TriggerKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| TriggerKindParseError(crate::quote::excerpt(s, 40)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_and_nothing_else_does() {
        for verdict in Verdict::ALL {
            assert_eq!(Verdict::parse(verdict.as_str()), Some(verdict));
        }
        assert_eq!(Verdict::parse("Allow"), None);
        for kind in TriggerKind::ALL {
            assert_eq!(kind.as_str().parse(), Ok(kind));
        }
        assert!("cron".parse::<TriggerKind>().is_err());
        assert!("".parse::<TriggerKind>().is_err());
        assert_eq!(ToolClass::parse("read_only"), Some(ToolClass::ReadOnly));
        assert_eq!(ToolClass::parse("readonly"), None);
        assert_eq!(ToolClass::parse("open_world"), Some(ToolClass::OpenWorld));
        assert_eq!(ToolClass::default(), ToolClass::Consequential);
        assert!(Verdict::Deny > Verdict::Confirm && Verdict::Confirm > Verdict::Allow);
    }
}
