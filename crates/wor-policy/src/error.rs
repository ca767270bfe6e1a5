//! Why a policy was refused when it was loaded.

use std::fmt;

/// Which text a policy came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PolicySource {
    /// The project's policy (the built-in default unless replaced).
    Project,
    /// The routine's own policy.
    Routine,
    /// The policies generated from the roster's tool modes.
    Roster,
}

impl PolicySource {
    /// The prefix of the ids of policies from this source.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicySource::Project => "project",
            PolicySource::Routine => "routine",
            PolicySource::Roster => "roster",
        }
    }
}

/// Where in which policy text a problem is. Line and column are 1-based; column counts
/// characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyLocation {
    pub source: PolicySource,
    /// `None` when Cedar reported no position.
    pub line_column: Option<(usize, usize)>,
}

impl PolicyLocation {
    pub(crate) fn at_offset(source: PolicySource, text: &str, offset: Option<usize>) -> Self {
        let line_column = offset.map(|offset| {
            let before = text.get(..offset).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
            (line, column)
        });
        PolicyLocation {
            source,
            line_column,
        }
    }

    pub fn line(&self) -> Option<usize> {
        self.line_column.map(|(line, _)| line)
    }
}

impl fmt::Display for PolicyLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} policy", self.source.as_str())?;
        if let Some((line, column)) = self.line_column {
            write!(f, ", line {line}, column {column}")?;
        }
        Ok(())
    }
}

/// Why policies could not be loaded. Each variant that concerns policy text says where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{at}: {message}")]
    Syntax { at: PolicyLocation, message: String },
    #[error("{at}: does not fit the schema: {message}")]
    Schema { at: PolicyLocation, message: String },
    #[error("{at}: policy id `{id}` is used twice")]
    DuplicateId { at: PolicyLocation, id: String },
    #[error("{at}: `@decision(\"{value}\")` must be `allow`, `confirm` or `deny`")]
    UnknownDecision { at: PolicyLocation, value: String },
    #[error("{at}: a `forbid` always denies, so `@decision(\"{value}\")` cannot apply to it")]
    ForbidWithDecision { at: PolicyLocation, value: String },
    #[error("{at}: the policy nests `(`, `[`, `{{` and `if` deeper than {limit} levels")]
    TooDeep { at: PolicyLocation, limit: usize },
    #[error("{at}: the expression is deeper than {limit} operators")]
    ExpressionTooDeep { at: PolicyLocation, limit: usize },
    #[error("policy templates are not supported: {at}")]
    Template { at: PolicyLocation },
    #[error("the built-in policy schema is invalid: {0}")]
    BuiltInSchema(String),
    #[error("the call could not be put to policy: {0}")]
    Request(String),
}

impl PolicyError {
    /// Where the problem is, for errors about policy text.
    pub fn location(&self) -> Option<&PolicyLocation> {
        match self {
            PolicyError::Syntax { at, .. }
            | PolicyError::Schema { at, .. }
            | PolicyError::DuplicateId { at, .. }
            | PolicyError::UnknownDecision { at, .. }
            | PolicyError::ForbidWithDecision { at, .. }
            | PolicyError::TooDeep { at, .. }
            | PolicyError::ExpressionTooDeep { at, .. }
            | PolicyError::Template { at } => Some(at),
            PolicyError::BuiltInSchema(_) | PolicyError::Request(_) => None,
        }
    }
}
