//! Starting, updating and stopping one instance's networking in pool mode: its rules, then its
//! taps, on start; its taps, then its rules, on stop (spec: "bcd's nftables rules for the NIC
//! exist before the tap does"). This is the one place that orders those steps and undoes a
//! failed start; the agent ([`start_instance`] and the others, over its root helper and its
//! link layer) and the kernel tests ([`PoolHost`]) both go through it.
//!
//! # Design
//! The two sides are traits, so the same steps run over libnftables or the agent's root helper,
//! and over real taps ([`GuardedTaps`]) or a test's fakes:
//!
//! - [`InstanceRules`]: set an instance's set elements to those of its spec (in one
//!   transaction, nothing applied when they match), saying whether it held any before; remove
//!   them.
//! - [`InstanceTaps`]: ensure a tap (created or reused, attached, guarded, up), saying which;
//!   delete one; say whether one exists.
//!
//! A start that fails undoes only what it did itself: the taps *it created* are deleted again,
//! and the instance's elements go only when it held none before the attempt and no tap of the
//! instance is left. A tap that existed before (a VM running under an agent that restarted)
//! keeps its elements, its guard and its bridge port, whatever failed; so do the elements loaded
//! for it before the attempt.
//!
//! # Limitations
//! A failed start does not restore elements it changed (an instance whose lease changed keeps
//! the new ones); the caller retries the start on its next pass.

use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::task::JoinError;
use vmnet_model::ValidationError;
use vmnet_model::nic::{IfName, InstanceSpec};
use vmnet_plan::pool::nft::{TapEntry, tap_entries};

use super::firewall::{FirewallError, NftExec, PoolFirewall};
use super::guard::{GuardError, TapGuard, detach_from};
use super::tap::{TapAction, TapError, Taps};
use crate::tap::TapOwner;

/// Errors of starting, updating and stopping an instance; each names the instance, the tap or
/// the step that failed, and keeps its cause.
#[derive(Debug, thiserror::Error)]
pub enum PoolHostError {
    /// The instance does not validate (its taps cannot be named).
    #[error(transparent)]
    Invalid(ValidationError),
    /// The instance's rules could not be set or removed.
    #[error(transparent)]
    Firewall(FirewallError),
    /// The task that ran the firewall call failed (panicked or was cancelled).
    #[error("pool firewall task")]
    FirewallTask(#[source] JoinError),
    /// A tap could not be made, deleted or read (the error names it).
    #[error(transparent)]
    Tap(TapError),
    /// The tap guard could not be attached to, detached from or forgotten for a tap.
    #[error("tap {tap}")]
    Guard {
        /// The tap.
        tap: IfName,
        /// Cause.
        #[source]
        source: GuardError,
    },
    /// The task that ran a guard call failed (panicked or was cancelled).
    #[error("tap {tap}: guard task")]
    GuardTask {
        /// The tap.
        tap: IfName,
        /// Cause.
        #[source]
        source: JoinError,
    },
    /// A step of an instance failed.
    #[error("instance {id}")]
    Instance {
        /// The instance.
        id: String,
        /// What failed.
        #[source]
        source: Box<PoolHostError>,
    },
}

impl From<FirewallError> for PoolHostError {
    fn from(e: FirewallError) -> Self {
        Self::Firewall(e)
    }
}

/// The rule side of an instance (see the module docs).
pub trait InstanceRules: Send {
    /// Sets the elements of `inst`'s taps to those of its spec, in one transaction (nothing
    /// applied when they match); `true` when it held elements for the instance before.
    ///
    /// # Errors
    /// [`PoolHostError::Firewall`] (a bad spec, nft or the helper failing) or
    /// [`PoolHostError::FirewallTask`]; the previous elements stay then.
    fn set<'a>(&'a mut self, inst: &'a InstanceSpec) -> BoxFuture<'a, Result<bool, PoolHostError>>;

    /// Removes the elements of instance `instance_id`'s taps (nothing held: nothing done).
    ///
    /// # Errors
    /// [`PoolHostError::Firewall`] or [`PoolHostError::FirewallTask`].
    fn remove<'a>(&'a mut self, instance_id: &'a str) -> BoxFuture<'a, Result<(), PoolHostError>>;
}

/// The link side of an instance (see the module docs).
pub trait InstanceTaps: Send + Sync {
    /// Makes tap `entry.tap` exist, persistent, on `bridge` as a locked port for `entry.mac`,
    /// guarded (when the guard is on) and up; an existing tap is reused (its guard and port
    /// updated). On an error, a tap this call created is deleted again; one that existed stays.
    ///
    /// # Errors
    /// [`PoolHostError::Tap`] (a missing bridge included), [`PoolHostError::Guard`] or
    /// [`PoolHostError::GuardTask`], each naming the tap.
    fn ensure<'a>(
        &'a self,
        entry: &'a TapEntry,
        bridge: &'a IfName,
    ) -> BoxFuture<'a, Result<TapAction, PoolHostError>>;

    /// Deletes tap `tap` and forgets its guard entry; `false` when it did not exist.
    ///
    /// # Errors
    /// [`PoolHostError::Tap`], [`PoolHostError::Guard`] or [`PoolHostError::GuardTask`].
    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>>;

    /// Whether tap `tap` exists.
    ///
    /// # Errors
    /// [`PoolHostError::Tap`] when the links cannot be read.
    fn exists<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>>;
}

fn named(inst: &InstanceSpec) -> impl Fn(PoolHostError) -> PoolHostError + '_ {
    move |e| PoolHostError::Instance {
        id: inst.id.clone(),
        source: Box::new(e),
    }
}

/// Starts an instance's networking: its elements first ([`InstanceRules::set`]), then one tap
/// per NIC on its bridge. Returns what happened to each tap. When a tap fails, only what this
/// call made goes again (see the module docs).
///
/// # Errors
/// The first failure, in [`PoolHostError::Instance`].
pub async fn start_instance<R, T>(
    rules: &mut R,
    taps: &T,
    inst: &InstanceSpec,
) -> Result<Vec<TapAction>, PoolHostError>
where
    R: InstanceRules + ?Sized,
    T: InstanceTaps + ?Sized,
{
    let entries = tap_entries(inst)
        .map_err(PoolHostError::Invalid)
        .map_err(named(inst))?;
    let held = rules.set(inst).await.map_err(named(inst))?;
    let mut done: Vec<(&IfName, TapAction)> = Vec::new();
    for (nic, entry) in inst.nics.iter().zip(&entries) {
        let Some(bridge) = &nic.network else { continue };
        match taps.ensure(entry, bridge).await {
            Ok(a) => done.push((&entry.tap, a)),
            Err(e) => {
                for (tap, a) in &done {
                    if *a == TapAction::Created
                        && let Err(d) = taps.delete(tap).await
                    {
                        tracing::warn!(instance = %inst.id, tap = %tap, error = %d,
                            "failed start: the tap it created could not be deleted");
                    }
                }
                let mut left = false;
                for entry in &entries {
                    // A tap that cannot be looked up counts as left: its rules stay.
                    left |= taps.exists(&entry.tap).await.unwrap_or(true);
                }
                if !held
                    && !left
                    && let Err(r) = rules.remove(&inst.id).await
                {
                    tracing::warn!(instance = %inst.id, error = %r,
                        "failed start: its elements could not be removed");
                }
                return Err(named(inst)(e));
            }
        }
    }
    Ok(done.into_iter().map(|(_, a)| a).collect())
}

/// An instance's new spec under the same taps: its elements set to the new spec's, then each
/// tap ensured again with its new entry (reused: the VMM's fd on it stays; its guard and bridge
/// port follow the entry). Nothing is deleted; on a failure the caller keeps the old spec and
/// tries again.
///
/// # Errors
/// The first failure, in [`PoolHostError::Instance`].
pub async fn update_instance<R, T>(
    rules: &mut R,
    taps: &T,
    inst: &InstanceSpec,
) -> Result<(), PoolHostError>
where
    R: InstanceRules + ?Sized,
    T: InstanceTaps + ?Sized,
{
    let entries = tap_entries(inst)
        .map_err(PoolHostError::Invalid)
        .map_err(named(inst))?;
    rules.set(inst).await.map_err(named(inst))?;
    for (nic, entry) in inst.nics.iter().zip(&entries) {
        let Some(bridge) = &nic.network else { continue };
        taps.ensure(entry, bridge).await.map_err(named(inst))?;
    }
    Ok(())
}

/// Stops an instance's networking: deletes its taps, then its elements. Goes on past failures
/// and returns the first.
///
/// # Errors
/// The first failure, in [`PoolHostError::Instance`].
pub async fn stop_instance<R, T>(
    rules: &mut R,
    taps: &T,
    inst: &InstanceSpec,
) -> Result<(), PoolHostError>
where
    R: InstanceRules + ?Sized,
    T: InstanceTaps + ?Sized,
{
    let mut first = None;
    for tap in inst.tap_names().unwrap_or_default() {
        if let Err(e) = taps.delete(&tap).await {
            first.get_or_insert(e);
        }
    }
    if let Err(e) = rules.remove(&inst.id).await {
        first.get_or_insert(e);
    }
    first.map_or(Ok(()), |e| Err(named(inst)(e)))
}

impl<E: NftExec> InstanceRules for PoolFirewall<E> {
    fn set<'a>(&'a mut self, inst: &'a InstanceSpec) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        Box::pin(async move {
            let held = self.holds(&inst.id);
            self.replace_instance(inst)?;
            Ok(held)
        })
    }

    fn remove<'a>(&'a mut self, instance_id: &'a str) -> BoxFuture<'a, Result<(), PoolHostError>> {
        Box::pin(async move { Ok(self.remove_instance(instance_id)?) })
    }
}

/// The real [`InstanceTaps`]: persistent taps ([`Taps`]) with the tap guard on each
/// ([`TapGuard`]) when it is on.
#[derive(Debug, Clone)]
pub struct GuardedTaps {
    /// The taps.
    pub taps: Taps,
    /// The namespace the taps live in (`None`: the caller's own).
    pub netns: Option<String>,
    /// Owner given to new taps.
    pub owner: TapOwner,
    /// The tap guard, when on. Without it, filters a guarded agent left on a tap are removed
    /// when the tap is ensured.
    pub guard: Option<Arc<TapGuard>>,
}

impl GuardedTaps {
    /// Runs a blocking guard call off the async runtime.
    async fn guard_call<V: Send + 'static>(
        tap: &IfName,
        f: impl FnOnce() -> Result<V, GuardError> + Send + 'static,
    ) -> Result<V, PoolHostError> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|source| PoolHostError::GuardTask {
                tap: tap.clone(),
                source,
            })?
            .map_err(|source| PoolHostError::Guard {
                tap: tap.clone(),
                source,
            })
    }

    async fn guard(&self, entry: &TapEntry) -> Result<(), PoolHostError> {
        if let Some(g) = &self.guard {
            let (g, e) = (Arc::clone(g), entry.clone());
            return Self::guard_call(&entry.tap, move || g.attach(&e)).await;
        }
        let (ns, tap) = (self.netns.clone(), entry.tap.to_string());
        if Self::guard_call(&entry.tap, move || detach_from(ns.as_deref(), &tap)).await? {
            tracing::info!(tap = %entry.tap, "removed the tap guard a previous agent left");
        }
        Ok(())
    }
}

impl InstanceTaps for GuardedTaps {
    fn ensure<'a>(
        &'a self,
        entry: &'a TapEntry,
        bridge: &'a IfName,
    ) -> BoxFuture<'a, Result<TapAction, PoolHostError>> {
        Box::pin(async move {
            let action = self
                .taps
                .ensure(&entry.tap, bridge, entry.mac, self.owner)
                .await
                .map_err(PoolHostError::Tap)?;
            if let Err(e) = self.guard(entry).await {
                if action == TapAction::Created {
                    let _ = self.delete(&entry.tap).await;
                }
                return Err(e);
            }
            Ok(action)
        })
    }

    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        Box::pin(async move {
            let gone = self.taps.delete(tap).await.map_err(PoolHostError::Tap)?;
            if let Some(g) = &self.guard {
                let (g, t) = (Arc::clone(g), tap.clone());
                Self::guard_call(tap, move || g.forget(&t)).await?;
            }
            Ok(gone)
        })
    }

    fn exists<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        Box::pin(async move {
            self.taps
                .link(tap)
                .await
                .map(|l| l.is_some())
                .map_err(PoolHostError::Tap)
        })
    }
}

/// The pool-mode kernel state of one host driven in-process: the bcd tables through `E` and
/// the taps ([`GuardedTaps`]). For sandboxes and tests; the agent drives the same steps over its
/// root helper.
#[derive(Debug)]
pub struct PoolHost<E: NftExec> {
    /// The three tables.
    pub firewall: PoolFirewall<E>,
    /// The taps and their guard.
    pub taps: GuardedTaps,
}

impl<E: NftExec> PoolHost<E> {
    /// [`start_instance`] on this host.
    ///
    /// # Errors
    /// As [`start_instance`].
    pub async fn start_instance(
        &mut self,
        inst: &InstanceSpec,
    ) -> Result<Vec<TapAction>, PoolHostError> {
        start_instance(&mut self.firewall, &self.taps, inst).await
    }

    /// [`stop_instance`] on this host.
    ///
    /// # Errors
    /// As [`stop_instance`].
    pub async fn stop_instance(&mut self, inst: &InstanceSpec) -> Result<(), PoolHostError> {
        stop_instance(&mut self.firewall, &self.taps, inst).await
    }
}
