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
        move |source| SecretsError::KeyFile { path, source }
    };
    match read_private(&path) {
        Ok(text) => return parse(&text).map(|key| (key, KeyFileOrigin::Loaded)),
        Err(SecretsError::KeyFile { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
        Err(other) => return Err(other),
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_error(dir))?;
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
        Err(SecretsError::KeyFile { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
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

/// The text of a key file, refused if group or others may read it.
fn read_private(path: &Path) -> Result<Zeroizing<String>, SecretsError> {
    let io_error = |source| SecretsError::KeyFile {
        path: path.to_path_buf(),
        source,
    };
    let mode = fs::metadata(path).map_err(io_error)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(SecretsError::KeyFileTooOpen {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(Zeroizing::new(fs::read_to_string(path).map_err(io_error)?))
}
