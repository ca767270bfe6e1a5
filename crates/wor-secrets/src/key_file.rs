//! Private key files in the data directory: created once with mode 0600, refused when others
//! may read them. Every key kept on disk (the development encryption key, the audit signing
//! key) goes through here.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

use secrecy::{ExposeSecret as _, SecretString};
use zeroize::Zeroizing;

use crate::SecretsError;

/// Whether a key file was found or had to be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyFileOrigin {
    /// The key file existed and was loaded.
    Loaded,
    /// No key file existed; a new key was generated and written.
    Created,
}

/// Loads the key in `dir/file_name` with `parse`, or, if there is no such file, makes one
/// with `generate` (which returns the key and its text) and writes the text there.
///
/// The text is written to a private temporary name created with mode 0600 and then
/// hard-linked into place, so the key is never readable by others and a concurrent creator
/// never overwrites it: the loser loads the winner's key.
pub(crate) fn load_or_create<K>(
    dir: &Path,
    file_name: &str,
    parse: impl Fn(&str) -> Result<K, SecretsError>,
    generate: impl FnOnce() -> Result<(K, SecretString), SecretsError>,
) -> Result<(K, KeyFileOrigin), SecretsError> {
    let path = dir.join(file_name);
    let io_error = |path: &Path| {
        let path = path.to_path_buf();
        move |error| SecretsError::KeyFile { path, error }
    };
    match read_private(&path) {
        Ok(text) => return parse(&text).map(|key| (key, KeyFileOrigin::Loaded)),
        Err(SecretsError::KeyFile { error, .. }) if error.kind() == io::ErrorKind::NotFound => {}
        Err(other) => return Err(other),
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_error(dir))?;
    // No key is made where any user could put another in its place.
    refuse_an_open_dir(dir)?;
    let (key, text) = generate()?;
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).map_err(|_| SecretsError::RandomnessUnavailable)?;
    let temporary = dir.join(format!(".{file_name}.{}", hex::encode(suffix)));
    let written = write_new_private_file(&temporary, text.expose_secret());
    let linked = written.and_then(|()| fs::hard_link(&temporary, &path));
    // The temporary name is only a staging area; remove it whatever happened.
    let _ = fs::remove_file(&temporary);
    match linked {
        Ok(()) => Ok((key, KeyFileOrigin::Created)),
        // Another process created the key first: use theirs.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let text = read_private(&path)?;
            parse(&text).map(|key| (key, KeyFileOrigin::Loaded))
        }
        Err(e) => Err(io_error(&path)(e)),
    }
}

/// Loads the key in `dir/file_name` with `parse` if the file exists; never creates it.
pub(crate) fn load_existing<K>(
    dir: &Path,
    file_name: &str,
    parse: impl Fn(&str) -> Result<K, SecretsError>,
) -> Result<Option<K>, SecretsError> {
    match read_private(&dir.join(file_name)) {
        Ok(text) => parse(&text).map(Some),
        Err(SecretsError::KeyFile { error, .. }) if error.kind() == io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(other) => Err(other),
    }
}

pub(crate) fn write_new_private_file(path: &Path, contents: &str) -> io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(contents.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}

/// The text of a key file, refused if group or others may read it, or if any user may write to
/// its directory (and so put another key in its place).
fn read_private(path: &Path) -> Result<Zeroizing<String>, SecretsError> {
    let io_error = |error| SecretsError::KeyFile {
        path: path.to_path_buf(),
        error,
    };
    let mode = fs::metadata(path).map_err(io_error)?.permissions().mode() & 0o777;
    // Only a key that is there is refused for where it lies: a directory that holds none is
    // not this key's to refuse.
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        refuse_an_open_dir(dir)?;
    }
    if mode & 0o077 != 0 {
        return Err(SecretsError::KeyFileTooOpen {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(Zeroizing::new(fs::read_to_string(path).map_err(io_error)?))
}

/// Refuses directory `dir` when any user may write to it; one that cannot be read is left to
/// the caller, whose own read or write then fails.
fn refuse_an_open_dir(dir: &Path) -> Result<(), SecretsError> {
    match fs::metadata(dir)
        .ok()
        .as_ref()
        .and_then(writable_by_any_user)
    {
        Some(mode) => Err(SecretsError::KeyDirTooOpen {
            path: dir.to_path_buf(),
            mode,
        }),
        None => Ok(()),
    }
}

/// The permission bits of a directory any user of the host may write to, and so put another
/// file in place of one it holds (a key, a database); `None` for one only its owner and group
/// may write to. The one rule for the key directories here and the embedded database's data
/// dir in `wor-store`.
pub fn writable_by_any_user(metadata: &fs::Metadata) -> Option<u32> {
    let mode = metadata.permissions().mode() & 0o7777;
    (mode & 0o002 != 0).then_some(mode)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use crate::SecretsError;

    #[test]
    fn a_key_in_a_directory_any_user_may_write_to_is_refused_made_or_read() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        std::fs::create_dir(&keys).unwrap();
        let set = |mode: u32| {
            std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        set(0o777);
        // A directory that holds no key is no key's to refuse: nothing is read from it.
        assert!(crate::load_dev_key(&keys).unwrap().is_none());
        let refused = crate::load_or_create_dev_key(&keys).unwrap_err();
        assert!(
            matches!(refused, SecretsError::KeyDirTooOpen { mode: 0o777, .. }),
            "{refused}"
        );
        assert_eq!(
            std::fs::read_dir(&keys).unwrap().count(),
            0,
            "no key was made"
        );
        // A directory its group may write to is the operator's choice.
        set(0o770);
        crate::load_or_create_dev_key(&keys).unwrap();
        set(0o703);
        let refused = crate::load_dev_key(&keys).unwrap_err();
        assert!(refused.to_string().contains("chmod o-w"), "{refused}");
        set(0o700);
        assert!(crate::load_dev_key(&keys).unwrap().is_some());
    }
}
