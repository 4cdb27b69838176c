//! Hetzner Cloud (API reference: <https://docs.hetzner.cloud/reference/cloud>, API v1, "Servers:
//! Get all Servers" and "Pagination"), as of the reference's `GET /v1/servers` shape.
//!
//! One poll lists every server of the project: `GET {api_url}/servers?page=N&per_page=50`
//! (50 is the documented maximum page size) with `Authorization: Bearer <token>`. The first
//! page's `meta.pagination.last_page` says how many pages there are; the rest are fetched with
//! at most [`HttpSettings::concurrency`](super::http::HttpSettings::concurrency) in flight.
//! Without `last_page`, `next_page` is followed one page at a time. So 1,000 servers cost 20
//! requests, whatever the number of machines in the pool.
//!
//! A server's addresses, in this order: `public_net.ipv4.ip` as a `/32`, `public_net.ipv6.ip`
//! as Hetzner gives it (the server's `/64` network), then each `private_net[]` entry's `ip` and
//! `alias_ips` as `/32`s. `ipv4` and `ipv6` may be `null` (a server without that primary IP).

use std::collections::HashMap;
use std::net::Ipv4Addr;

use futures::StreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use serde::Deserialize;
use vmnet_ipam::MachinePoll;
use vmnet_model::pool::Machine;

use super::http::Api;
use super::{PollError, PollReport, push_address};

/// The documented maximum page size of list calls.
pub const PER_PAGE: u32 = 50;

/// The most pages one poll follows (50,000 servers): a guard against a provider that never
/// ends its `next_page` chain.
pub const MAX_PAGES: u64 = 1000;

/// `GET /servers`: one page.
#[derive(Debug, Clone, Deserialize)]
pub struct ServersPage {
    /// The servers of this page.
    pub servers: Vec<Server>,
    /// The pagination.
    pub meta: Meta,
}

/// `meta` of a list answer.
#[derive(Debug, Clone, Deserialize)]
pub struct Meta {
    /// `meta.pagination`.
    pub pagination: Pagination,
}

/// `meta.pagination`.
#[derive(Debug, Clone, Deserialize)]
pub struct Pagination {
    /// This page's number (from 1).
    pub page: u64,
    /// The next page; `null` on the last.
    #[serde(default)]
    pub next_page: Option<u64>,
    /// The last page; `null` when the API does not know it.
    #[serde(default)]
    pub last_page: Option<u64>,
}

/// One server (only the fields vmnet reads).
#[derive(Debug, Clone, Deserialize)]
pub struct Server {
    /// The server id.
    pub id: u64,
    /// Its public network.
    pub public_net: PublicNet,
    /// Its private networks.
    #[serde(default)]
    pub private_net: Vec<PrivateNet>,
}

/// `public_net`.
#[derive(Debug, Clone, Deserialize)]
pub struct PublicNet {
    /// The primary IPv4, `null` without one.
    #[serde(default)]
    pub ipv4: Option<PublicIpv4>,
    /// The primary IPv6 network, `null` without one.
    #[serde(default)]
    pub ipv6: Option<PublicIpv6>,
}

/// `public_net.ipv4`.
#[derive(Debug, Clone, Deserialize)]
pub struct PublicIpv4 {
    /// The address, e.g. `203.0.113.7`.
    pub ip: Ipv4Addr,
}

/// `public_net.ipv6`.
#[derive(Debug, Clone, Deserialize)]
pub struct PublicIpv6 {
    /// The network, e.g. `2001:db8:7::/64`.
    pub ip: Ipv6Net,
}

/// One `private_net[]` entry.
#[derive(Debug, Clone, Deserialize)]
pub struct PrivateNet {
    /// The server's address in the network.
    pub ip: Ipv4Addr,
    /// Its alias addresses there.
    #[serde(default)]
    pub alias_ips: Vec<Ipv4Addr>,
}

impl Server {
    /// The server's addresses in CIDR form, in the order of the module docs.
    #[must_use]
    pub fn addresses(&self) -> Vec<IpNet> {
        let mut out = Vec::new();
        let v4 = |a: Ipv4Addr| IpNet::V4(Ipv4Net::from(a));
        if let Some(v) = &self.public_net.ipv4 {
            push_address(&mut out, v4(v.ip));
        }
        if let Some(v) = &self.public_net.ipv6 {
            push_address(&mut out, IpNet::V6(v.ip));
        }
        for p in &self.private_net {
            push_address(&mut out, v4(p.ip));
            for a in &p.alias_ips {
                push_address(&mut out, v4(*a));
            }
        }
        out
    }
}

fn page_url(base: &str, page: u64) -> String {
    format!("{base}/servers?page={page}&per_page={PER_PAGE}")
}

/// Every server of the project, all pages.
///
/// # Errors
/// The first failing page's [`PollError`]; a pagination that does not advance is `Malformed`.
pub async fn list_servers(api: &Api, base: &str) -> Result<Vec<Server>, PollError> {
    let first: ServersPage = api.get(&page_url(base, 1)).await?;
    let mut servers = first.servers;
    let pg = first.meta.pagination;
    match (pg.last_page, pg.next_page) {
        (_, None) => {}
        (Some(last), Some(_)) if last <= MAX_PAGES => {
            let pages: Vec<u64> = (2..=last).collect();
            let mut fetched: Vec<(u64, ServersPage)> = futures::stream::iter(pages)
                .map(|p| async move {
                    api.get::<ServersPage>(&page_url(base, p))
                        .await
                        .map(|r| (p, r))
                })
                .buffer_unordered(api.settings().concurrency.max(1))
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
            fetched.sort_by_key(|(p, _)| *p);
            servers.extend(fetched.into_iter().flat_map(|(_, r)| r.servers));
        }
        (_, Some(mut next)) => {
            let mut at = pg.page;
            loop {
                if next <= at || next > MAX_PAGES {
                    return Err(PollError::Malformed {
                        what: format!("GET {}", page_url(base, at)),
                        why: format!("meta.pagination.next_page {next} after page {at}"),
                    });
                }
                let page: ServersPage = api.get(&page_url(base, next)).await?;
                servers.extend(page.servers);
                at = next;
                match page.meta.pagination.next_page {
                    Some(n) => next = n,
                    None => break,
                }
            }
        }
    }
    Ok(servers)
}

/// Polls the pool's machines: one listing of every server, then each machine's addresses (a
/// machine the list does not contain is `missing` and has none).
///
/// # Errors
/// The listing's [`PollError`] (then nothing is known about any machine).
pub async fn poll(
    api: &Api,
    base: &str,
    machines: &[(String, Machine)],
) -> Result<PollReport, PollError> {
    let servers = list_servers(api, base).await?;
    let by_id: HashMap<u64, &Server> = servers.iter().map(|s| (s.id, s)).collect();
    let mut report = PollReport::default();
    for (instance_id, m) in machines {
        let found = m.server_id.and_then(|id| by_id.get(&id));
        let addresses = match found {
            Some(s) => s.addresses(),
            None => {
                report.missing.push(instance_id.clone());
                Vec::new()
            }
        };
        report.results.push(MachinePoll {
            instance_id: instance_id.clone(),
            addresses: Some(addresses),
        });
    }
    report.requests = api.requests();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_documented_server_gives_its_addresses_in_order() {
        // The reference's example, shortened; unknown fields are ignored.
        let page: ServersPage = serde_json::from_str(
            r#"{"servers": [{"id": 42, "name": "my-server", "status": "running",
                "created": "2016-01-30T23:55:00+00:00",
                "public_net": {"ipv4": {"id": 42, "ip": "203.0.113.7", "blocked": false,
                                        "dns_ptr": "server01.example.com"},
                               "ipv6": {"id": 42, "ip": "2001:db8:7::/64", "blocked": false,
                                        "dns_ptr": [{"ip": "2001:db8:7::1", "dns_ptr": "x"}]},
                               "floating_ips": [478], "firewalls": []},
                "private_net": [{"network": 4711, "ip": "10.0.0.2", "alias_ips": ["10.0.0.3"],
                                 "mac_address": "86:00:ff:2a:7d:e1"}],
                "server_type": {"id": 1, "name": "cx11"}, "labels": {}}],
              "meta": {"pagination": {"page": 1, "per_page": 25, "previous_page": null,
                                      "next_page": null, "last_page": 1, "total_entries": 1}}}"#,
        )
        .unwrap();
        let got: Vec<String> = page.servers[0]
            .addresses()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            got,
            [
                "203.0.113.7/32",
                "2001:db8:7::/64",
                "10.0.0.2/32",
                "10.0.0.3/32"
            ]
        );
        let bare: Server = serde_json::from_str(
            r#"{"id": 1, "public_net": {"ipv4": null, "ipv6": null}, "private_net": []}"#,
        )
        .unwrap();
        assert!(bare.addresses().is_empty());
    }
}
