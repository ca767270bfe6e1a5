//! Console passwords: the rules a new password must meet, and argon2id hashing with the
//! operator's parameters. Hashing runs on the blocking pool: it is slow on purpose.

use std::sync::OnceLock;

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::{Algorithm, Argon2, Params, Version};
use rand::TryRngCore;

use super::ConsoleConfig;

/// Shortest password accepted.
pub const MIN_PASSWORD_CHARS: usize = 12;
/// Longest password accepted: enough for any passphrase, bounded so hashing stays bounded.
pub const MAX_PASSWORD_CHARS: usize = 256;

/// Passwords long enough to pass the length rule that still top every leaked-password list;
/// compared without regard to case.
const COMMON_PASSWORDS: &[&str] = &[
    "123456789012",
    "1234567890123",
    "12345678901234",
    "123456123456",
    "111111111111",
    "000000000000",
    "123123123123",
    "987654321098",
    "password1234",
    "password12345",
    "password123!",
    "passwordpassword",
    "p@ssw0rd1234",
    "passw0rd1234",
    "qwerty123456",
    "qwertyuiop12",
    "qwertyuiop123",
    "qwertyuiopasdf",
    "1q2w3e4r5t6y",
    "1qaz2wsx3edc",
    "zaq12wsxcde3",
    "asdfghjkl123",
    "abcdefghijkl",
    "abc123456789",
    "iloveyou1234",
    "letmein12345",
    "welcome12345",
    "welcome123!!",
    "changeme1234",
    "administrator",
    "administrator1",
    "trustno1trustno1",
    "football1234",
    "baseball1234",
    "monkey123456",
    "dragon123456",
    "sunshine1234",
    "princess1234",
    "superman1234",
    "starwars1234",
    "computer1234",
    "whatever1234",
    "aaaaaaaaaaaa",
];

/// Why a new password was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PasswordRuleError {
    #[error("the password must be at least {MIN_PASSWORD_CHARS} characters long")]
    TooShort,
    #[error("the password must be at most {MAX_PASSWORD_CHARS} characters long")]
    TooLong,
    #[error("this password is one of the most common passwords; choose another")]
    Common,
    #[error("the password must not be your member name")]
    SameAsName,
    #[error("the password must use at least {MIN_DISTINCT_CHARS} different characters")]
    Repetitive,
    #[error("the two passwords do not match")]
    Mismatch,
}

/// The fewest different characters a new password has: twelve spaces, or one letter or two
/// repeated, are not passwords.
pub const MIN_DISTINCT_CHARS: usize = 4;

/// `password` as it is hashed and checked: in Unicode normalization form C, so that the same
/// characters typed on keyboards that compose them differently are the same password.
fn normalized(password: &str) -> std::borrow::Cow<'_, str> {
    use unicode_normalization::UnicodeNormalization as _;
    if unicode_normalization::is_nfc(password) {
        std::borrow::Cow::Borrowed(password)
    } else {
        std::borrow::Cow::Owned(password.nfc().collect())
    }
}

/// Checks a new password for member `name`, typed twice.
pub fn check_new_password(
    password: &str,
    repeated: &str,
    name: &str,
) -> Result<(), PasswordRuleError> {
    let (password, repeated) = (normalized(password), normalized(repeated));
    if password != repeated {
        return Err(PasswordRuleError::Mismatch);
    }
    let chars = password.chars().count();
    if chars < MIN_PASSWORD_CHARS {
        return Err(PasswordRuleError::TooShort);
    }
    if chars > MAX_PASSWORD_CHARS {
        return Err(PasswordRuleError::TooLong);
    }
    let lowered = password.to_lowercase();
    if COMMON_PASSWORDS.contains(&lowered.as_str()) {
        return Err(PasswordRuleError::Common);
    }
    if lowered == name.to_lowercase() {
        return Err(PasswordRuleError::SameAsName);
    }
    let distinct: std::collections::BTreeSet<char> = password.chars().collect();
    if distinct.len() < MIN_DISTINCT_CHARS {
        return Err(PasswordRuleError::Repetitive);
    }
    Ok(())
}

/// Why hashing failed: bad parameters in the configuration, or no randomness.
#[derive(Debug, thiserror::Error)]
pub enum PasswordHashError {
    #[error("invalid argon2 parameters: {0}")]
    Parameters(String),
    #[error("random source failed: {0}")]
    Random(String),
    #[error("hashing failed: {0}")]
    Hash(String),
    #[error("the hashing task did not finish")]
    Task,
}

fn hasher(config: &ConsoleConfig) -> Result<Argon2<'static>, PasswordHashError> {
    let params = Params::new(
        config.argon2_memory_kib,
        config.argon2_iterations,
        config.argon2_parallelism,
        None,
    )
    .map_err(|e| PasswordHashError::Parameters(e.to_string()))?;
    Ok(Argon2::new(Algorithm::Argon2id, Version::V0x13, params))
}

/// Checks that `config`'s argon2 parameters are usable, without hashing anything.
pub fn check_parameters(config: &ConsoleConfig) -> Result<(), PasswordHashError> {
    hasher(config).map(|_| ())
}

fn hash_now(config: &ConsoleConfig, password: &str) -> Result<String, PasswordHashError> {
    let mut salt = [0u8; 16];
    rand::rngs::OsRng
        .try_fill_bytes(&mut salt)
        .map_err(|e| PasswordHashError::Random(e.to_string()))?;
    let salt = SaltString::encode_b64(&salt).map_err(|e| PasswordHashError::Hash(e.to_string()))?;
    Ok(hasher(config)?
        .hash_password(normalized(password).as_bytes(), &salt)
        .map_err(|e| PasswordHashError::Hash(e.to_string()))?
        .to_string())
}

/// The argon2id PHC string of `password`, with the configured parameters and a random salt.
pub async fn hash_password(
    config: &ConsoleConfig,
    password: String,
) -> Result<String, PasswordHashError> {
    let config = config.clone();
    tokio::task::spawn_blocking(move || hash_now(&config, &password))
        .await
        .map_err(|_| PasswordHashError::Task)?
}

/// Whether `password` matches `phc`. With no stored hash (an unknown member) it checks
/// against a throwaway hash anyway, so an unknown name takes as long as a wrong password.
pub async fn verify_password(
    config: &ConsoleConfig,
    phc: Option<String>,
    password: String,
) -> Result<bool, PasswordHashError> {
    static STAND_IN: OnceLock<String> = OnceLock::new();
    let config = config.clone();
    tokio::task::spawn_blocking(move || {
        let (phc, known) = match phc {
            Some(phc) => (phc, true),
            None => {
                let stand_in = match STAND_IN.get() {
                    Some(hash) => hash.clone(),
                    None => {
                        let hash = hash_now(&config, "not a password anyone has")?;
                        STAND_IN.get_or_init(|| hash).clone()
                    }
                };
                (stand_in, false)
            }
        };
        // The parameters come from the stored hash, so raising them later keeps old ones valid.
        let parsed = PasswordHash::new(&phc).map_err(|e| PasswordHashError::Hash(e.to_string()))?;
        // The normalized form, as passwords are hashed; a password set before they were
        // normalized was hashed as typed, so that is tried too when it differs.
        let verify = |text: &str| {
            Argon2::default()
                .verify_password(text.as_bytes(), &parsed)
                .is_ok()
        };
        let as_hashed = normalized(&password);
        // Only for a member who has a hash: an unknown name costs one check, as a wrong
        // password does, whatever form its text comes in.
        let matches =
            verify(&as_hashed) || (known && as_hashed != password.as_str() && verify(&password));
        Ok(known && matches)
    })
    .await
    .map_err(|_| PasswordHashError::Task)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_common_mismatched_and_name_passwords_are_refused() {
        assert_eq!(
            check_new_password("short", "short", "ann"),
            Err(PasswordRuleError::TooShort)
        );
        assert_eq!(
            check_new_password("Password1234", "Password1234", "ann"),
            Err(PasswordRuleError::Common)
        );
        assert_eq!(
            check_new_password("a long passphrase", "a long passphrase!", "ann"),
            Err(PasswordRuleError::Mismatch)
        );
        assert_eq!(
            check_new_password("annabelle-lee", "annabelle-lee", "Annabelle-Lee"),
            Err(PasswordRuleError::SameAsName)
        );
        assert_eq!(
            check_new_password("correct horse battery", "correct horse battery", "ann"),
            Ok(())
        );
        for repetitive in [
            " ".repeat(12),
            "bbbbbbbbbbbb".to_owned(),
            "ab ab ab ab ab".to_owned(),
        ] {
            assert_eq!(
                check_new_password(&repetitive, &repetitive, "ann"),
                Err(PasswordRuleError::Repetitive),
                "{repetitive:?}"
            );
        }
        // The same characters, composed (NFC) and decomposed (NFD), are the same password.
        assert_eq!(
            check_new_password(
                "caf\u{e9} au lait, please",
                "cafe\u{301} au lait, please",
                "ann"
            ),
            Ok(())
        );
    }

    #[tokio::test]
    async fn a_password_typed_composed_or_decomposed_verifies_alike() {
        let config = ConsoleConfig::default();
        let phc = hash_password(&config, "cafe\u{301} au lait, please".to_owned())
            .await
            .unwrap();
        for typed in ["caf\u{e9} au lait, please", "cafe\u{301} au lait, please"] {
            assert!(
                verify_password(&config, Some(phc.clone()), typed.to_owned())
                    .await
                    .unwrap(),
                "{typed:?}"
            );
        }
        // A hash made before passwords were normalized, of the text as typed, still verifies.
        let before = hash_now_as_typed(&config, "cafe\u{301} au lait, please");
        assert!(
            verify_password(
                &config,
                Some(before),
                "cafe\u{301} au lait, please".to_owned()
            )
            .await
            .unwrap()
        );
    }

    /// The argon2id hash of `password` exactly as given, as hashes were made before passwords
    /// were normalized.
    fn hash_now_as_typed(config: &ConsoleConfig, password: &str) -> String {
        let salt = SaltString::encode_b64(&[7u8; 16]).unwrap();
        hasher(config)
            .unwrap()
            .hash_password(password.as_bytes(), &salt)
            .unwrap()
            .to_string()
    }

    #[tokio::test]
    async fn a_hash_verifies_its_password_only() {
        let config = ConsoleConfig::default();
        let phc = hash_password(&config, "correct horse battery".to_owned())
            .await
            .unwrap();
        assert!(phc.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"), "{phc}");
        assert!(
            verify_password(
                &config,
                Some(phc.clone()),
                "correct horse battery".to_owned()
            )
            .await
            .unwrap()
        );
        assert!(
            !verify_password(&config, Some(phc), "correct horse battery!".to_owned())
                .await
                .unwrap()
        );
        assert!(
            !verify_password(&config, None, "correct horse battery".to_owned())
                .await
                .unwrap()
        );
    }
}
