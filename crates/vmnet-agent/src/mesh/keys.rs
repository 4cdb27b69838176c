//! The host's WireGuard key pair: made on first start and kept in the state directory, mode 0600.
//! The private key lives in a [`PrivateKey`]: its `Debug` redacts it and its memory (and every
//! buffer it passed through here) is zeroed when dropped.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use secrecy::{ExposeSecret, SecretBox};
use vmnet_model::Error;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use super::body::WgKey;

/// The key file's name in the state directory.
pub const KEY_FILE: &str = "wireguard.key";

/// The host's WireGuard private key. `Debug` shows `PrivateKey(..)`; zeroed on drop.
pub struct PrivateKey(SecretBox<[u8; 32]>);

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrivateKey(..)")
    }
}

impl PartialEq for PrivateKey {
    fn eq(&self, other: &Self) -> bool {
        self.expose() == other.expose()
    }
}

impl PrivateKey {
    /// The key's bytes, for the device (UAPI) and the public key only.
    #[must_use]
    pub fn expose(&self) -> &[u8; 32] {
        self.0.expose_secret()
    }

    /// Parses the standard base64 of a key (the key file's form).
    ///
    /// # Errors
    /// When it is not 32 bytes of base64 (the message never shows the text).
    pub fn from_base64(text: &str) -> Result<Self, String> {
        let bytes = Zeroizing::new(
            STANDARD
                .decode(text.trim())
                .map_err(|_| "not base64".to_owned())?,
        );
        let mut key = Box::new([0u8; 32]);
        if bytes.len() != 32 {
            return Err(format!("{} bytes, not 32", bytes.len()));
        }
        key.copy_from_slice(&bytes);
        Ok(Self(SecretBox::new(key)))
    }

    fn to_base64(&self) -> Zeroizing<String> {
        Zeroizing::new(STANDARD.encode(self.expose()))
    }
}

/// The public key of the private key `private`.
#[must_use]
pub fn public_of(private: &[u8; 32]) -> WgKey {
    WgKey(PublicKey::from(&StaticSecret::from(*private)).to_bytes())
}

/// The host's private key from `dir/wireguard.key` (base64, one line), made there on first use
/// (mode 0600, written to a temporary file and renamed, so a crash leaves no half key). A key
/// file readable by others is tightened to 0600.
///
/// # Errors
/// `UNAVAILABLE` when the file cannot be read or written; `INTERNAL` when it holds no key.
pub fn load_or_create(dir: &Path) -> Result<PrivateKey, Error> {
    let path = dir.join(KEY_FILE);
    let io = |what: &str, e: std::io::Error| {
        Error::unavailable(format!("{what} {}: {e}", path.display()))
    };
    let read = std::fs::File::open(&path).and_then(|mut f| {
        let mut text = Zeroizing::new(String::with_capacity(64));
        f.read_to_string(&mut text).map(|_| text)
    });
    match read {
        Ok(text) => {
            let key = PrivateKey::from_base64(&text).map_err(|e| {
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
            let mut bytes = Box::new([0u8; 32]);
            getrandom::fill(bytes.as_mut())
                .map_err(|e| Error::unavailable(format!("no randomness for a key: {e}")))?;
            // Clamped as WireGuard does (x25519 clamps anyway; stored clamped like `wg genkey`).
            bytes[0] &= 248;
            bytes[31] &= 127;
            bytes[31] |= 64;
            let key = PrivateKey(SecretBox::new(bytes));
            let tmp = dir.join(format!(".{KEY_FILE}.tmp"));
            let _ = std::fs::remove_file(&tmp);
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| io("create", e))?;
            writeln!(f, "{}", key.to_base64().as_str()).map_err(|e| io("write", e))?;
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
        assert_ne!(public_of(k.expose()).0, *k.expose());
        assert_eq!(format!("{k:?}"), "PrivateKey(..)");
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
        let k: [u8; 32] = private.try_into().unwrap();
        assert_eq!(public_of(&k).0.to_vec(), public);
    }
}
