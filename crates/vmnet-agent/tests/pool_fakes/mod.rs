//! Pool mode's fakes for the in-process agent tests: an nft executor that keeps every applied
//! batch and lists them back (read by content as the kernel would hold them), and fake links
//! (taps on bridges, host addresses) with a fault switch per tap.

#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{Method, StatusCode};
use futures::future::BoxFuture;
use serde_json::{Value, json};
use vmnet_agent::pool::node::{PoolConfig, PoolNode};
use vmnet_agent::pool::taps::PoolTaps;
use vmnet_kernel::pool::firewall::{FirewallError, NftExec};
use vmnet_kernel::pool::guard::GuardError;
use vmnet_kernel::pool::host::{InstanceTaps, PoolHostError};
use vmnet_kernel::pool::tap::{TapAction, TapError};
use vmnet_model::Error;
use vmnet_model::nic::{IfName, MacAddr};
use vmnet_plan::pool::nft::TapEntry;

use crate::common::{Harness, instance_on, range};

#[derive(Default)]
pub struct FakeNft {
    pub applied: Mutex<Vec<Value>>,
    /// Every applied batch, in order.
    pub batches: Mutex<Vec<String>>,
}

/// A shared handle on the fake (the firewall owns one, the test keeps another).
#[derive(Default, Clone)]
pub struct SharedNft(pub Arc<FakeNft>);

impl NftExec for SharedNft {
    fn apply(&self, batch: &str) -> Result<(), FirewallError> {
        let v: Value = serde_json::from_str(batch).unwrap();
        self.0
            .applied
            .lock()
            .unwrap()
            .extend(v["nftables"].as_array().unwrap().iter().cloned());
        self.0.batches.lock().unwrap().push(batch.to_owned());
        Ok(())
    }

    fn list(&self) -> Result<String, FirewallError> {
        Ok(json!({ "nftables": *self.0.applied.lock().unwrap() }).to_string())
    }
}

impl SharedNft {
    /// Forgets everything applied (as `nft flush ruleset` would).
    pub fn flush(&self) {
        self.0.applied.lock().unwrap().clear();
    }
}

#[derive(Default)]
pub struct Links {
    /// tap → (bridge, mac)
    pub taps: BTreeMap<String, (String, MacAddr)>,
    pub bridges: Vec<String>,
    pub addrs: Vec<IpAddr>,
    /// Every tap `ensure` was called for, in order.
    pub ensured: Vec<String>,
    /// Every tap deleted (that existed), in order.
    pub deleted: Vec<String>,
    /// Taps whose `ensure` fails (after the bridge check, as a tap guard that cannot be
    /// attached would): a tap made by that call is deleted again, one that existed stays.
    pub failing: Vec<String>,
}

#[derive(Default, Clone)]
pub struct FakeTaps(pub Arc<Mutex<Links>>);

impl InstanceTaps for FakeTaps {
    fn ensure<'a>(
        &'a self,
        entry: &'a TapEntry,
        bridge: &'a IfName,
    ) -> BoxFuture<'a, Result<TapAction, PoolHostError>> {
        Box::pin(async move {
            let (tap, mac) = (&entry.tap, entry.mac);
            let mut l = self.0.lock().unwrap();
            if !l.bridges.iter().any(|b| b == bridge.as_str()) {
                return Err(PoolHostError::Tap(TapError::NoBridge {
                    tap: tap.to_string(),
                    bridge: bridge.to_string(),
                }));
            }
            l.ensured.push(tap.to_string());
            if l.failing.iter().any(|t| t == tap.as_str()) {
                return Err(PoolHostError::Guard {
                    tap: tap.clone(),
                    source: GuardError::Attach {
                        tap: tap.to_string(),
                        source: "the fake's guard cannot be attached".into(),
                    },
                });
            }
            let old = l.taps.insert(tap.to_string(), (bridge.to_string(), mac));
            Ok(if old.is_some() {
                TapAction::Reused
            } else {
                TapAction::Created
            })
        })
    }

    fn delete<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        Box::pin(async move {
            let mut l = self.0.lock().unwrap();
            let existed = l.taps.remove(tap.as_str()).is_some();
            if existed {
                l.deleted.push(tap.to_string());
            }
            Ok(existed)
        })
    }

    fn exists<'a>(&'a self, tap: &'a IfName) -> BoxFuture<'a, Result<bool, PoolHostError>> {
        Box::pin(async move { Ok(self.0.lock().unwrap().taps.contains_key(tap.as_str())) })
    }
}

impl PoolTaps for FakeTaps {
    fn list(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move { Ok(self.0.lock().unwrap().taps.keys().cloned().collect()) })
    }

    fn host_addresses(&self) -> BoxFuture<'_, Result<Vec<IpAddr>, Error>> {
        Box::pin(async move { Ok(self.0.lock().unwrap().addrs.clone()) })
    }
}

/// Pool mode for host `h1` on `bridge`, seeds under the harness directory, with the fakes.
pub async fn start_node(
    h: &Harness,
    bridge: &str,
    nft: &SharedNft,
    links: &FakeTaps,
    audit_period: Duration,
) -> Result<Arc<PoolNode>, Error> {
    let cfg = PoolConfig {
        host_id: "h1".into(),
        bridge: bridge.parse().unwrap(),
        seed_dir: h.dir.join("seeds"),
        seed_images: false,
    };
    PoolNode::start(
        cfg,
        nft.clone(),
        Arc::new(links.clone()),
        h.agent.db(),
        audit_period,
    )
    .await
}

pub struct Pool {
    pub h: Harness,
    pub nft: SharedNft,
    pub links: FakeTaps,
    pub seeds: PathBuf,
}

pub async fn pool() -> Pool {
    let h = Harness::new().await;
    let nft = SharedNft::default();
    let links = host_links(&[]);
    let seeds = h.dir.join("seeds");
    let node = start_node(&h, "br0", &nft, &links, Duration::from_millis(100))
        .await
        .unwrap();
    h.agent.set_pool(node).unwrap();
    h.with_range(
        "p1",
        json!({"cidr": "10.0.0.0/29", "gateway": "10.0.0.1", "dns": ["10.0.0.1", "2001:db8::53"]}),
    )
    .await;
    h.with_host("h1", 8, 8192).await;
    h.with_host("h2", 8, 8192).await;
    Pool {
        h,
        nft,
        links,
        seeds,
    }
}

impl Pool {
    pub async fn create(&self, id: &str, host: &str) -> Value {
        self.h.with_instance(instance_on(id, "p1", host)).await
    }

    pub async fn status(&self) -> Value {
        let (st, v) = self.h.call(Method::GET, "/v1/status", None).await;
        assert_eq!(st, StatusCode::OK);
        v["pool"].clone()
    }

    pub fn taps(&self) -> BTreeMap<String, (String, MacAddr)> {
        self.links.0.lock().unwrap().taps.clone()
    }
}

/// Fake links as a host holds them: bridge `br0`, host address 203.0.113.2, and a tap on
/// `br0` with the instance's MAC for each of `instances`.
pub fn host_links(instances: &[&str]) -> FakeTaps {
    let links = FakeTaps::default();
    {
        let mut l = links.0.lock().unwrap();
        l.bridges.push("br0".into());
        l.addrs = vec!["203.0.113.2".parse().unwrap()];
        for id in instances {
            l.taps
                .insert(tap_of(id), ("br0".into(), MacAddr::for_instance(id)));
        }
    }
    links
}

/// The store as an earlier agent left it: pool `p1` with range 10.0.0.0/29, hosts `h1` and
/// `h2` (8 vCPUs, 8 GiB each) and each `(instance, host)` placed.
pub async fn placed(h: &Harness, instances: &[(&str, &str)]) {
    h.with_range("p1", range("10.0.0.0/29", "10.0.0.1")).await;
    h.with_host("h1", 8, 8192).await;
    h.with_host("h2", 8, 8192).await;
    for (id, host) in instances {
        h.with_instance(instance_on(id, "p1", host)).await;
    }
}

pub fn tap_of(id: &str) -> String {
    vmnet_model::nic::tap_name(id, 0).unwrap().to_string()
}
