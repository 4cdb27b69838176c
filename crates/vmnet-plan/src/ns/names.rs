//! Every name and number namespace mode derives for a VM, from the name prefix and the VM user
//! id alone (spec "Design notes": deterministic names, no allocator).
//!
//! | object | where | name |
//! |---|---|---|
//! | network namespace | host (`/run/netns`) | `<prefix>n<uid:04x>` |
//! | host end of the veth pair | host | `<prefix>h<uid:04x>` |
//! | peer end of the veth pair | VM netns | `<prefix>p<uid:04x>` |
//! | tap for the VMM | VM netns | `<prefix>t<uid:04x>` |
//! | nftables table (inet) | VM netns | `<prefix>` |
//! | nftables table (ip, host masquerade) | host | `<prefix>_host` |
//! | nftables table (inet, public addresses) | host | `<prefix>_pub` |
//! | policy routing table | host | `host_table_base + uid` |
//! | policy routing rule | host | `iif <prefix>h<uid:04x> lookup <table>`, priority `host_rule_priority` |
//! | inbound routing table | VM netns | [`NS_INBOUND_TABLE`], rule `iif <peer> lookup` it at [`NS_INBOUND_RULE_PRIORITY`] |
//!
//! The user id is written as exactly four lowercase hex digits, so the supported range is
//! `0..=0xffff` ([`vmnet_model::vm::MAX_USER_ID`]) and a prefix of at most [`MAX_PREFIX_LEN`]
//! bytes keeps every interface name within Linux's 15 bytes. [`parse_uid`] is the exact inverse,
//! so observe and garbage collection recognise our objects and never match another prefix's (a
//! name of prefix `vmnx` is not a name of prefix `vmn`: after `vmn` it must be one kind letter and
//! four hex digits).

/// Linux's interface name limit (`IFNAMSIZ - 1`).
pub const IFNAME_MAX: usize = 15;

/// The longest name prefix: 15 bytes minus one kind letter and four hex digits.
pub const MAX_PREFIX_LEN: usize = IFNAME_MAX - 5;

/// The routing table in each VM netns holding the route that sends everything arriving from the
/// host to the guest (so a gateway VM's guest receives traffic routed to it).
pub const NS_INBOUND_TABLE: u32 = 100;

/// The priority of the VM netns rule selecting [`NS_INBOUND_TABLE`].
pub const NS_INBOUND_RULE_PRIORITY: u32 = 100;

/// The kind of a derived name: the letter after the prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    /// The VM network namespace (`n`).
    Netns,
    /// The host end of the veth pair (`h`).
    HostVeth,
    /// The peer end of the veth pair, inside the VM netns (`p`).
    PeerVeth,
    /// The tap inside the VM netns (`t`).
    Tap,
}

impl NameKind {
    /// The letter written after the prefix.
    #[must_use]
    pub const fn letter(self) -> char {
        match self {
            Self::Netns => 'n',
            Self::HostVeth => 'h',
            Self::PeerVeth => 'p',
            Self::Tap => 't',
        }
    }
}

/// The derived name of kind `kind` for `uid` under `prefix`: `<prefix><letter><uid:04x>`.
/// Callers keep `uid <= 0xffff` (validated in the VM config) so the name has a fixed length.
#[must_use]
pub fn name(prefix: &str, kind: NameKind, uid: u32) -> String {
    format!("{prefix}{}{uid:04x}", kind.letter())
}

/// The user id encoded in `name` if it is a name of `kind` under `prefix`, else `None`.
#[must_use]
pub fn parse_uid(prefix: &str, kind: NameKind, name: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?.strip_prefix(kind.letter())?;
    if rest.len() != 4
        || !rest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    u32::from_str_radix(rest, 16).ok()
}

/// The nftables table (family `inet`) inside every VM netns: the prefix itself.
#[must_use]
pub fn vm_nft_table(prefix: &str) -> String {
    prefix.to_owned()
}

/// The host nftables table (family `ip`) holding the transit masquerade: `<prefix>_host`.
#[must_use]
pub fn host_nft_table(prefix: &str) -> String {
    format!("{prefix}_host")
}

/// The host nftables table (family `inet`) holding the public address maps: `<prefix>_pub`.
#[must_use]
pub fn pub_nft_table(prefix: &str) -> String {
    format!("{prefix}_pub")
}

/// Checks a name prefix: 1..=[`MAX_PREFIX_LEN`] bytes, a lowercase letter then lowercase letters
/// or digits (safe in interface names, netns names and nft identifiers).
///
/// # Errors
/// A sentence naming the problem.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    let ok_first = prefix
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase());
    if !ok_first
        || prefix.len() > MAX_PREFIX_LEN
        || !prefix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(format!(
            "name prefix {prefix:?} must be 1..={MAX_PREFIX_LEN} bytes: a lowercase letter, then lowercase letters or digits"
        ));
    }
    Ok(())
}
