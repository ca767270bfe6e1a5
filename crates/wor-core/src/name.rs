//! The names people give: projects, members, keys, model connections, notification routes
//! and workers.

/// The most characters (not bytes) a name may have.
pub const MAX_NAME_CHARS: usize = 100;

/// Why a name cannot be used; its message follows "… name".
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("must be 1 to {MAX_NAME_CHARS} characters with no leading or trailing space")]
    Length,
    #[error("must not contain control characters")]
    Control,
}

/// `Ok` for a name of 1 to [`MAX_NAME_CHARS`] characters, without leading or trailing space
/// or any control character.
pub fn check_name(name: &str) -> Result<(), NameError> {
    let trimmed = name.trim();
    if trimmed.is_empty() || trimmed != name || name.chars().nth(MAX_NAME_CHARS).is_some() {
        return Err(NameError::Length);
    }
    if name.chars().any(char::is_control) {
        return Err(NameError::Control);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_counted_in_characters_and_kept_free_of_space_around_and_control_characters() {
        assert_eq!(check_name("ops"), Ok(()));
        assert_eq!(check_name(&"€".repeat(MAX_NAME_CHARS)), Ok(()));
        assert_eq!(
            check_name(&"€".repeat(MAX_NAME_CHARS + 1)),
            Err(NameError::Length)
        );
        for bad in ["", " ", " ops", "ops\n"] {
            assert_eq!(check_name(bad), Err(NameError::Length), "{bad:?}");
        }
        assert_eq!(check_name("o\u{7}ps"), Err(NameError::Control));
    }
}
