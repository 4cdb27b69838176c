//! Who may drive the agent: the peer credentials (`SO_PEERCRED`) of every connection on the API
//! socket are checked before a byte of it is read. Root (uid 0) is served; so is a member of the
//! socket group (`vmnet serve --socket-group`): a peer whose group id is the socket group, or
//! whose user lists it among its supplementary groups (the group database, `getgrouplist(3)`).
//! Everyone else is refused, and the refusal is logged with the peer's uid, gid and pid.
//!
//! The socket's file mode (0660, owner root, group the socket group) already keeps other users
//! from connecting; the check holds even when the mode was loosened by hand or a descriptor of
//! the socket reached another user.

use nix::unistd::{Gid, Group, Uid, User};

/// The credentials of a connected peer, as the kernel recorded them at `connect(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
    /// Its process id (`None` when the kernel gave none, e.g. from another pid namespace).
    pub pid: Option<i32>,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uid {} gid {}", self.uid, self.gid)?;
        match self.pid {
            Some(p) => write!(f, " pid {p}"),
            None => Ok(()),
        }
    }
}

/// Why a peer is served or refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Served: root, or a member of the socket group.
    Allowed,
    /// Refused, with the reason (for the log).
    Refused(String),
}

/// The access rule: root, and the members of one group when one is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// The socket group; `None`: root only.
    pub group: Option<u32>,
}

impl Access {
    /// The verdict for `peer`; `groups_of(uid, gid)` lists the supplementary groups of a user
    /// (called only for a peer that is neither root nor of the group by its own gid).
    pub fn check(&self, peer: &Peer, groups_of: impl FnOnce(u32, u32) -> Vec<u32>) -> Verdict {
        if peer.uid == 0 {
            return Verdict::Allowed;
        }
        let Some(group) = self.group else {
            return Verdict::Refused(
                "only root may use the API (the agent has no --socket-group)".into(),
            );
        };
        if peer.gid == group || groups_of(peer.uid, peer.gid).contains(&group) {
            return Verdict::Allowed;
        }
        Verdict::Refused(format!(
            "not root and not a member of the socket group (gid {group})"
        ))
    }
}

/// The supplementary groups of user `uid` from the group database (empty when the user has no
/// passwd entry or the lookup fails). Blocking: NSS may read files or ask a directory service.
#[must_use]
pub fn groups_of(uid: u32, gid: u32) -> Vec<u32> {
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return Vec::new();
    };
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return Vec::new();
    };
    nix::unistd::getgrouplist(&name, Gid::from_raw(gid))
        .map(|g| g.into_iter().map(Gid::as_raw).collect())
        .unwrap_or_default()
}

/// Resolves `--socket-group`: a group name, or a numeric gid.
///
/// # Errors
/// A message naming the flag when no such group exists.
pub fn resolve_group(spec: &str) -> Result<u32, String> {
    if let Ok(gid) = spec.parse::<u32>() {
        return Ok(gid);
    }
    match Group::from_name(spec) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(format!("--socket-group {spec}: no such group")),
        Err(e) => Err(format!("--socket-group {spec}: group lookup failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(uid: u32, gid: u32) -> Peer {
        Peer {
            uid,
            gid,
            pid: Some(7),
        }
    }

    #[test]
    fn root_and_the_group_are_served_others_refused() {
        let none = Access { group: None };
        let g = Access { group: Some(500) };
        let no_lookup = |_, _| -> Vec<u32> { panic!("no lookup needed") };
        assert_eq!(none.check(&peer(0, 0), no_lookup), Verdict::Allowed);
        assert_eq!(g.check(&peer(0, 9), no_lookup), Verdict::Allowed);
        assert!(matches!(
            none.check(&peer(1000, 500), |_, _| vec![500]),
            Verdict::Refused(m) if m.contains("only root")
        ));
        assert_eq!(g.check(&peer(1000, 500), no_lookup), Verdict::Allowed);
        // A supplementary group of the peer's user counts.
        assert_eq!(
            g.check(&peer(1000, 1000), |u, gid| {
                assert_eq!((u, gid), (1000, 1000));
                vec![1000, 500]
            }),
            Verdict::Allowed
        );
        assert!(matches!(
            g.check(&peer(1000, 1000), |_, _| vec![1000, 27]),
            Verdict::Refused(m) if m.contains("gid 500")
        ));
        assert_eq!(peer(1, 2).to_string(), "uid 1 gid 2 pid 7");
    }

    #[test]
    fn groups_resolve_by_name_or_number() {
        assert_eq!(resolve_group("0"), Ok(0));
        assert_eq!(resolve_group("root"), Ok(0));
        let e = resolve_group("surely-no-such-group-vmnet").unwrap_err();
        assert!(
            e.starts_with("--socket-group surely-no-such-group-vmnet: "),
            "{e}"
        );
        assert!(groups_of(0, 0).contains(&0));
    }
}
