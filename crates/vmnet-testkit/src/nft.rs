//! Hand edits of an nft table inside a namespace, for drift tests: what an administrator (or an
//! attacker) would type with `nft`, one kind at a time.

use std::time::Duration;

use crate::{SandboxError, netns};

/// Runs `nft ARGS…` in `ns` and returns its standard output.
///
/// # Errors
/// When nft cannot run or fails (its standard error is in the message).
pub fn nft(ns: &str, args: &[&str]) -> Result<String, SandboxError> {
    let out = netns::exec(ns, "nft", args, Duration::from_secs(5))?;
    if !out.status.success() {
        return Err(SandboxError::Unexpected(format!(
            "nft {} in {ns}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The handle of the last rule of chain `chain` of table `inet <table>` in `ns` (from
/// `nft -a list chain`).
///
/// # Errors
/// When nft fails or the chain has no rule.
pub fn last_rule_handle(ns: &str, table: &str, chain: &str) -> Result<u64, SandboxError> {
    let out = nft(ns, &["-a", "list", "chain", "inet", table, chain])?;
    out.lines()
        .rev()
        .map(str::trim)
        .filter(|l| !l.starts_with("chain ") && !l.starts_with("table "))
        .find_map(|l| l.rsplit_once("# handle ")?.1.trim().parse().ok())
        .ok_or_else(|| {
            SandboxError::Unexpected(format!("{ns}: chain inet {table} {chain} has no rule"))
        })
}

/// One kind of hand edit of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    /// The target rule deleted (its chain flushed: it is the chain's only rule).
    RuleDeleted,
    /// A rule added to the target chain.
    RuleAdded,
    /// The target rule replaced by another one (same chain, same position).
    RuleChanged,
    /// The target chain deleted with its rules.
    ChainDeleted,
    /// The base chain's policy flipped to drop.
    PolicyFlipped,
    /// The whole table deleted.
    TableDeleted,
    /// The table switched off (`flags dormant`): its chains stay listed but run no rule.
    TableDormant,
}

impl Edit {
    /// Every kind, in a fixed order.
    pub const ALL: [Self; 7] = [
        Self::RuleDeleted,
        Self::RuleAdded,
        Self::RuleChanged,
        Self::ChainDeleted,
        Self::PolicyFlipped,
        Self::TableDeleted,
        Self::TableDormant,
    ];
}

/// The table a test edits, and how.
#[derive(Debug, Clone)]
pub struct Target {
    /// The namespace holding the table.
    pub netns: String,
    /// The table's family (`ip`, `inet`, …).
    pub family: String,
    /// The table's name.
    pub table: String,
    /// The chain holding the target rule (its only rule).
    pub chain: String,
    /// The replacement of the target rule for [`Edit::RuleChanged`], in nft syntax.
    pub changed_rule: String,
    /// The base chain whose policy [`Edit::PolicyFlipped`] sets to drop.
    pub policy_chain: String,
}

impl Target {
    /// The handle of the first rule of the target chain.
    ///
    /// # Errors
    /// When the chain cannot be listed or has no rule.
    pub fn rule_handle(&self) -> Result<u64, SandboxError> {
        let listing = nft(
            &self.netns,
            &[
                "-a",
                "list",
                "chain",
                &self.family,
                &self.table,
                &self.chain,
            ],
        )?;
        listing
            .lines()
            .filter(|l| !l.trim_start().starts_with("chain") && !l.contains("type "))
            .find_map(|l| l.rsplit_once("# handle ")?.1.trim().parse().ok())
            .ok_or_else(|| {
                SandboxError::Unexpected(format!(
                    "no rule in {} {}: {listing}",
                    self.table, self.chain
                ))
            })
    }

    /// Makes the hand edit `edit`.
    ///
    /// # Errors
    /// When nft refuses it.
    pub fn apply(&self, edit: Edit) -> Result<(), SandboxError> {
        let (f, t, c) = (
            self.family.as_str(),
            self.table.as_str(),
            self.chain.as_str(),
        );
        match edit {
            Edit::RuleDeleted => nft(&self.netns, &["flush", "chain", f, t, c])?,
            Edit::RuleAdded => nft(&self.netns, &["add", "rule", f, t, c, "counter"])?,
            Edit::RuleChanged => {
                let handle = self.rule_handle()?.to_string();
                let mut args = vec!["replace", "rule", f, t, c, "handle", handle.as_str()];
                args.extend(self.changed_rule.split(' '));
                nft(&self.netns, &args)?
            }
            Edit::ChainDeleted => nft(&self.netns, &["delete", "chain", f, t, c])?,
            Edit::PolicyFlipped => {
                let cmd = format!("chain {f} {t} {} {{ policy drop; }}", self.policy_chain);
                nft(&self.netns, &[cmd.as_str()])?
            }
            Edit::TableDeleted => nft(&self.netns, &["delete", "table", f, t])?,
            Edit::TableDormant => {
                let cmd = format!("add table {f} {t} {{ flags dormant; }}");
                nft(&self.netns, &[cmd.as_str()])?
            }
        };
        Ok(())
    }
}
