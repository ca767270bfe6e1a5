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
    #[error(
        "must not contain invisible formatting characters (zero-width spaces and joiners, direction marks and overrides)"
    )]
    Invisible,
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
    // Two names that look the same must be the same name: `owner` and `owner` with a
    // zero-width space, or a name whose letters a direction override reorders, are refused.
    // The zero-width non-joiner and joiner stay: Persian and Indic names are spelt with them.
    if name
        .chars()
        .any(|c| is_format_char(c) && !matches!(c, '\u{200C}' | '\u{200D}'))
    {
        return Err(NameError::Invisible);
    }
    Ok(())
}

/// Whether `c` is a Unicode format character (general category Cf, Unicode 15.1): invisible,
/// it changes how the text around it shows (zero-width spaces and joiners, direction marks,
/// embeddings, overrides and isolates, the byte order mark, tag characters).
pub fn is_format_char(c: char) -> bool {
    matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x202A..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
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
        for bad in [
            "\u{200B}owner",
            "owner\u{200B}",
            "\u{202E}abc",
            "ow\u{2066}ner",
            "\u{FEFF}x",
        ] {
            assert_eq!(check_name(bad), Err(NameError::Invisible), "{bad:?}");
        }
        // Letters of every script stay names, joiners inside emoji aside.
        for good in [
            "Zoë",
            "Łukasz",
            "مريم",
            "田中",
            "o'brien",
            "می\u{200C}خواهم",
        ] {
            assert_eq!(check_name(good), Ok(()), "{good:?}");
        }
    }
}
