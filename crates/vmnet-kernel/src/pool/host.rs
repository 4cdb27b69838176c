//! One host in pool mode: an instance's rules, then its taps, on start; its taps, then its
//! rules, on stop (spec: "bcd's nftables rules for the NIC exist before the tap does").

use vmnet_model::Error;
use vmnet_model::nic::InstanceSpec;

use std::sync::Arc;

use vmnet_plan::pool::nft::tap_entries;

use super::firewall::{FirewallError, NftExec, PoolFirewall};
use super::guard::{GuardError, TapGuard};
use super::tap::{TapAction, TapError, TapOwner, Taps};

/// Errors of starting or stopping an instance.
#[derive(Debug, thiserror::Error)]
pub enum PoolHostError {
    /// The firewall change failed (nothing of it applied).
    #[error("instance {instance}: firewall")]
    Firewall {
        /// The instance.
        instance: String,
        /// Cause.
        #[source]
        source: FirewallError,
    },
    /// A tap could not be made, attached or deleted.
    #[error("instance {instance}: tap")]
    Tap {
        /// The instance.
        instance: String,
        /// Cause.
        #[source]
        source: TapError,
    },
    /// The tap guard could not be attached or updated.
    #[error("instance {instance}: tap guard")]
    Guard {
        /// The instance.
        instance: String,
        /// Cause.
        #[source]
        source: GuardError,
    },
}

impl PoolHostError {
    /// The documented error: plan errors keep their code (`INVALID_INPUT`, `CONFLICT`), kernel
    /// failures are `UNAVAILABLE`.
    #[must_use]
    pub fn to_error(&self) -> Error {
        match self {
            Self::Firewall { instance, source } => {
                let e = source.to_error();
                Error::new(e.code, format!("instance {instance}: {}", e.message))
            }
            Self::Tap { instance, source } => unavailable(instance, source),
            Self::Guard { instance, source } => unavailable(instance, source),
        }
    }
}

fn unavailable(instance: &str, source: &dyn std::error::Error) -> Error {
    let mut msg = format!("instance {instance}: {source}");
    let mut cur = source.source();
    while let Some(c) = cur {
        msg.push_str(&format!(": {c}"));
        cur = c.source();
    }
    Error::unavailable(msg)
}

/// The pool-mode kernel state of one host: the bcd tables and the taps.
#[derive(Debug)]
pub struct PoolHost<E: NftExec> {
    /// The three tables.
    pub firewall: PoolFirewall<E>,
    /// The taps.
    pub taps: Taps,
    /// Owner given to new taps.
    pub owner: TapOwner,
    /// The tap guard (BPF filters on each tap), when enabled.
    pub guard: Option<Arc<TapGuard>>,
}

impl<E: NftExec> PoolHost<E> {
    /// Starts an instance's networking: rules first, then one persistent tap per NIC on its
    /// bridge. When a tap fails, the taps made here and the rules are removed again.
    ///
    /// # Errors
    /// [`PoolHostError`] naming the instance.
    pub async fn start_instance(
        &mut self,
        inst: &InstanceSpec,
    ) -> Result<Vec<TapAction>, PoolHostError> {
        let fw = |source| PoolHostError::Firewall {
            instance: inst.id.clone(),
            source,
        };
        let taps = inst.tap_names().map_err(|e| fw(FirewallError::Plan(e)))?;
        let entries = tap_entries(inst).map_err(|e| fw(FirewallError::Plan(e)))?;
        self.firewall.add_instance(inst).map_err(fw)?;
        let mut done = Vec::new();
        for ((nic, tap), entry) in inst.nics.iter().zip(&taps).zip(&entries) {
            let Some(bridge) = &nic.network else { continue };
            let made = match self.taps.ensure(tap, bridge, nic.mac, self.owner).await {
                Ok(a) => {
                    done.push(a);
                    match &self.guard {
                        Some(g) => g.attach(entry).map_err(|source| PoolHostError::Guard {
                            instance: inst.id.clone(),
                            source,
                        }),
                        None => Ok(()),
                    }
                }
                Err(source) => Err(PoolHostError::Tap {
                    instance: inst.id.clone(),
                    source,
                }),
            };
            match made {
                Ok(()) => {}
                Err(e) => {
                    for (t, a) in taps.iter().zip(&done) {
                        if *a == TapAction::Created {
                            let _ = self.taps.delete(t).await;
                        }
                    }
                    if let Some(g) = &self.guard {
                        for t in &taps {
                            let _ = g.forget(t);
                        }
                    }
                    let _ = self.firewall.remove_instance(&inst.id);
                    return Err(e);
                }
            }
        }
        Ok(done)
    }

    /// Stops an instance's networking: deletes its taps, then its rules. Goes on past failures
    /// and returns the first.
    ///
    /// # Errors
    /// [`PoolHostError`] naming the instance.
    pub async fn stop_instance(&mut self, inst: &InstanceSpec) -> Result<(), PoolHostError> {
        let mut first = None;
        let taps = inst.tap_names().unwrap_or_default();
        for tap in &taps {
            if let Err(source) = self.taps.delete(tap).await {
                first.get_or_insert(PoolHostError::Tap {
                    instance: inst.id.clone(),
                    source,
                });
            }
            if let Some(g) = &self.guard
                && let Err(source) = g.forget(tap)
            {
                first.get_or_insert(PoolHostError::Guard {
                    instance: inst.id.clone(),
                    source,
                });
            }
        }
        if let Err(source) = self.firewall.remove_instance(&inst.id) {
            first.get_or_insert(PoolHostError::Firewall {
                instance: inst.id.clone(),
                source,
            });
        }
        first.map_or(Ok(()), Err)
    }
}
