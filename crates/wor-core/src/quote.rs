//! How an error message quotes a value it was given that it could not use.

/// How many characters of a value too long to quote whole a message shows.
const SHOWN_OF_LONG: usize = 8;

/// `value` as an error message quotes it: whole when it has at most `max` characters, else its
/// first eight followed by `…`, and never cut anywhere in between. A caller may send a secret
/// by mistake (an API key pasted where an id belongs), and the text that leaves the process is
/// redacted by the secret's shape, which only the whole secret has: a secret cut at `max`
/// would go back out in part, unrecognised. Eight characters are no use to whoever reads
/// them, and enough to tell the caller what they sent.
pub fn excerpt(value: &str, max: usize) -> String {
    if value.chars().nth(max).is_none() {
        return value.to_owned();
    }
    let mut shown: String = value.chars().take(SHOWN_OF_LONG).collect();
    shown.push('…');
    shown
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_within_the_limit_is_quoted_whole() {
        assert_eq!(excerpt("viewer", 40), "viewer");
        assert_eq!(excerpt("", 40), "");
        let forty = "a".repeat(40);
        assert_eq!(excerpt(&forty, 40), forty);
        // Characters, not bytes.
        let euros = "€".repeat(40);
        assert_eq!(excerpt(&euros, 40), euros);
    }

    #[test]
    fn a_longer_value_shows_only_its_first_eight_characters() {
        let key = format!("sk-ant-api03-{}AA", "A".repeat(93));
        assert_eq!(excerpt(&key, 80), "sk-ant-a…");
        assert_eq!(excerpt(&"b".repeat(41), 40), "bbbbbbbb…");
        assert_eq!(excerpt(&"€".repeat(41), 40), "€€€€€€€€…");
    }
}
