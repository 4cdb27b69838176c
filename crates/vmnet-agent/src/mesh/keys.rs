//! The host's WireGuard key pair: made on first start and kept in the state directory, mode 0600.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use vmnet_model::Error;
use x25519_dalek::{PublicKey, StaticSecret};

use super::body::WgKey;

/// The key file's name in the state directory.
pub const KEY_FILE: &str = "wireguard.key";

/// The public key of `private`.
#[must_use]
pub fn public_of(private: &WgKey) -> WgKey {
    WgKey(PublicKey::from(&StaticSecret::from(private.0)).to_bytes())
}

/// The host's private key from `dir/wireguard.key` (base64, one line), made there on first use
/// (mode 0600, written to a temporary file and renamed, so a crash leaves no half key). A key
/// file readable by others is tightened to 0600.
///
/// # Errors
/// `UNAVAILABLE` when the file cannot be read or written; `INTERNAL` when it holds no key.
pub fn load_or_create(dir: &Path) -> Result<WgKey, Error> {
    let path = dir.join(KEY_FILE);
    let io = |what: &str, e: std::io::Error| {
        Error::unavailable(format!("{what} {}: {e}", path.display()))
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let key: WgKey = text.trim().parse().map_err(|e| {
                Error::internal(format!("{}: not a WireGuard key: {e}", path.display()))
            })?;
            let mode = std::fs::metadata(&path)
                .map_err(|e| io("stat", e))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| io("chmod", e))?;
            }
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(|e| io("create the directory of", e))?;
            let mut bytes = [0u8; 32];
            getrandom::fill(&mut bytes)
                .map_err(|e| Error::unavailable(format!("no randomness for a key: {e}")))?;
            // Clamped as WireGuard does (x25519 clamps anyway; stored clamped like `wg genkey`).
            bytes[0] &= 248;
            bytes[31] &= 127;
            bytes[31] |= 64;
            let key = WgKey(bytes);
            let tmp = dir.join(format!(".{KEY_FILE}.tmp"));
            let _ = std::fs::remove_file(&tmp);
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| io("create", e))?;
            writeln!(f, "{key}").map_err(|e| io("write", e))?;
            f.sync_all().map_err(|e| io("sync", e))?;
            std::fs::rename(&tmp, &path).map_err(|e| io("rename to", e))?;
            Ok(key)
        }
        Err(e) => Err(io("read", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_with_mode_0600_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let k = load_or_create(d.path()).unwrap();
        let mode = std::fs::metadata(d.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(load_or_create(d.path()).unwrap(), k);
        assert_ne!(public_of(&k), k);
        // Loosened permissions are tightened again.
        std::fs::set_permissions(
            d.path().join(KEY_FILE),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        assert_eq!(load_or_create(d.path()).unwrap(), k);
        let mode = std::fs::metadata(d.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn the_public_key_matches_wireguard() {
        // RFC 7748 section 6.1: Alice's private and public keys.
        let private =
            hex::decode("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
                .unwrap();
        let public =
            hex::decode("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
                .unwrap();
        let k = WgKey(private.try_into().unwrap());
        assert_eq!(public_of(&k).0.to_vec(), public);
    }
}
