//! The NoCloud seeds of the instances on this host, under the agent's state directory
//! (spec: "The guest's network configuration").
//!
//! Layout: `<dir>/<instance id>/meta-data`, `user-data`, `network-config` (only with a static
//! NIC) and, when images are enabled, `seed.iso` (the `cidata` image,
//! [`vmnet_kernel::pool::seed_image::write_iso`]). Instance ids are validated
//! ([`vmnet_model::ids::validate_id`]: `[A-Za-z0-9._-]`, starting with a letter or digit), so an
//! id is one safe path component.
//!
//! # Design
//! Each file is written to a temporary name and renamed, and only when its contents changed, so
//! a reconcile pass over unchanged instances writes nothing and a VMM never reads half a file.
//! The image is rebuilt only when a file changed or it is missing.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use vmnet_model::Error;
use vmnet_model::error::chain;
use vmnet_model::nic::InstanceSpec;
use vmnet_plan::pool::seed::seed;

use crate::api::error::from_seed;

/// The image's file name inside an instance's seed directory.
pub const IMAGE_NAME: &str = "seed.iso";

fn io(path: &Path, op: &str, e: &std::io::Error) -> Error {
    Error::unavailable(format!("seed {}: {op}: {e}", path.display()))
}

/// Writes `contents` to `path` unless it already holds them; `true` when written.
fn write_if_changed(path: &Path, contents: &str) -> Result<bool, Error> {
    if std::fs::read(path).ok().as_deref() == Some(contents.as_bytes()) {
        return Ok(false);
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).map_err(|e| io(&tmp, "write", &e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, "rename", &e))?;
    Ok(true)
}

/// The seed directory of `instance_id` under `dir`.
#[must_use]
pub fn instance_dir(dir: &Path, instance_id: &str) -> PathBuf {
    dir.join(instance_id)
}

/// Writes the seed of `inst` under `dir` (see the module docs); with `image`, also the
/// `cidata` image. Returns whether anything changed.
///
/// # Errors
/// `INVALID_INPUT` when the instance does not validate (nothing is written then);
/// `UNAVAILABLE` when a file or the image cannot be written.
pub fn write(dir: &Path, inst: &InstanceSpec, image: bool) -> Result<bool, Error> {
    let s = seed(inst, None).map_err(from_seed)?;
    let d = instance_dir(dir, &inst.id);
    std::fs::create_dir_all(&d).map_err(|e| io(&d, "create directory", &e))?;
    let mut changed = false;
    for (name, contents) in s.files() {
        changed |= write_if_changed(&d.join(name), contents)?;
    }
    if s.network_config.is_none() {
        let nc = d.join("network-config");
        if nc.exists() {
            std::fs::remove_file(&nc).map_err(|e| io(&nc, "remove", &e))?;
            changed = true;
        }
    }
    let iso = d.join(IMAGE_NAME);
    if image && (changed || !iso.exists()) {
        vmnet_kernel::pool::seed_image::write_iso(&s, &iso)
            .map_err(|e| Error::unavailable(format!("instance {}: {}", inst.id, chain(&e))))?;
        changed = true;
    }
    Ok(changed)
}

/// Removes every instance directory under `dir` whose name is not in `keep`; returns the ids
/// removed. A missing `dir` holds nothing.
///
/// # Errors
/// `UNAVAILABLE` when the directory cannot be read or an entry cannot be removed.
pub fn prune(dir: &Path, keep: &BTreeSet<String>) -> Result<Vec<String>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir, "read directory", &e)),
    };
    let mut gone = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io(dir, "read directory", &e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep.contains(&name) || !entry.path().is_dir() {
            continue;
        }
        std::fs::remove_dir_all(entry.path()).map_err(|e| io(&entry.path(), "remove", &e))?;
        gone.push(name);
    }
    gone.sort();
    Ok(gone)
}

/// Whether `genisoimage` (which builds the image) is on the PATH.
#[must_use]
pub fn image_tool_available() -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("genisoimage").is_file()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmnet_model::nic::{MacAddr, NetworkPolicy, NicSpec};

    fn inst(id: &str, addresses: &[&str]) -> InstanceSpec {
        let addresses: Vec<ipnet::IpNet> = addresses.iter().map(|a| a.parse().unwrap()).collect();
        InstanceSpec {
            id: id.into(),
            allocation_id: id.into(),
            policy: NetworkPolicy::Public,
            sandbox: false,
            nics: vec![NicSpec {
                network: Some("br0".parse().unwrap()),
                mac: MacAddr::for_instance(id),
                gateway: (!addresses.is_empty()).then(|| "10.0.0.1".parse().unwrap()),
                gateway6: None,
                addresses,
                nameservers: vec![],
            }],
        }
    }

    #[test]
    fn written_once_rewritten_on_change_network_config_only_when_static() {
        let d = tempfile::tempdir().unwrap();
        assert!(write(d.path(), &inst("i-1", &["10.0.0.2/29"]), false).unwrap());
        assert!(!write(d.path(), &inst("i-1", &["10.0.0.2/29"]), false).unwrap());
        let nc = std::fs::read_to_string(d.path().join("i-1/network-config")).unwrap();
        assert!(nc.contains("\"10.0.0.2/29\""), "{nc}");
        // The lease goes away: DHCP, so no network-config at all.
        assert!(write(d.path(), &inst("i-1", &[]), false).unwrap());
        assert!(!d.path().join("i-1/network-config").exists());
        assert!(d.path().join("i-1/meta-data").exists());
    }

    #[test]
    fn prune_removes_only_other_instances() {
        let d = tempfile::tempdir().unwrap();
        for id in ["i-1", "i-2"] {
            write(d.path(), &inst(id, &["10.0.0.2/29"]), false).unwrap();
        }
        std::fs::write(d.path().join("stray-file"), "x").unwrap();
        let keep: BTreeSet<String> = ["i-2".to_owned()].into();
        assert_eq!(prune(d.path(), &keep).unwrap(), ["i-1"]);
        assert!(d.path().join("i-2/user-data").exists());
        assert!(d.path().join("stray-file").exists(), "files are not ours");
        assert!(prune(&d.path().join("missing"), &keep).unwrap().is_empty());
    }

    #[test]
    fn image_is_built_when_the_tool_exists() {
        if !image_tool_available() {
            // Without genisoimage the agent does not ask for images (PoolConfig::seed_images).
            assert!(write(tempfile::tempdir().unwrap().path(), &inst("i-1", &[]), true).is_err());
            return;
        }
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &inst("i-1", &["10.0.0.2/29"]), true).unwrap();
        let iso = std::fs::read(d.path().join("i-1").join(IMAGE_NAME)).unwrap();
        assert!(iso.len() > 32 * 1024, "an ISO9660 image");
        assert_eq!(&iso[0x8001..0x8006], b"CD001");
    }
}
