//! The human tables of the IPAM commands: pools, hosts, instances, leases and `host report`.

use vmnet_agent::table::render;
use vmnet_ipam::{Family, Host, Instance, IpRange, Lease, Pool, PoolRange, StatusReportOutcome};

fn opt<T: ToString>(v: Option<&T>) -> String {
    v.map_or_else(|| "-".to_owned(), ToString::to_string)
}

pub(super) fn range_row(pool_id: &str, r: Option<&IpRange>, leases: Option<u64>) -> Vec<String> {
    let mut row = vec![pool_id.to_owned()];
    match r {
        Some(r) => row.extend([
            r.cidr.to_string(),
            r.gateway.to_string(),
            r.first_host.to_string(),
            r.last_host.to_string(),
            if r.dns.is_empty() {
                "-".into()
            } else {
                r.dns
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            },
        ]),
        None => row.extend(["(no range)", "-", "-", "-", "-"].map(String::from)),
    }
    if let Some(n) = leases {
        row.push(n.to_string());
    }
    row
}

pub(super) const RANGE_HEADER: [&str; 6] = ["POOL", "CIDR", "GATEWAY", "FIRST", "LAST", "DNS"];
pub(super) const POOL_HEADER: [&str; 10] = [
    "POOL",
    "CIDR",
    "GATEWAY",
    "FIRST",
    "LAST",
    "DNS",
    "LEASES",
    "MORE RANGES",
    "IPV6 LEASES",
    "PROVIDER",
];

/// The ranges after the first IPv4 range, as their networks: `2001:db8::/64,10.0.1.0/24`, or
/// `-`.
fn more_ranges(p: &Pool) -> String {
    let first = p.range.as_ref().map(|r| ipnet::IpNet::V4(r.cidr));
    let more: Vec<String> = p
        .ranges
        .iter()
        .filter(|r| Some(r.cidr) != first)
        .map(|r| r.cidr.to_string())
        .collect();
    if more.is_empty() {
        "-".into()
    } else {
        more.join(",")
    }
}

pub(super) fn ranges_table(ranges: &[PoolRange]) -> String {
    let rows: Vec<_> = ranges
        .iter()
        .map(|r| {
            vec![
                r.pool_id.clone(),
                match r.family {
                    Family::Ipv4 => "ipv4".into(),
                    Family::Ipv6 => "ipv6".into(),
                },
                r.cidr.to_string(),
                r.gateway.to_string(),
                r.first_host.to_string(),
                r.last_host.to_string(),
            ]
        })
        .collect();
    render(
        &["POOL", "FAMILY", "CIDR", "GATEWAY", "FIRST", "LAST"],
        &rows,
    )
}

/// A provider pool's settings in one cell: `hetzner-cloud https://api.hetzner.cloud/v1 env
/// HCLOUD_TOKEN every 30s` (where the secret is, never the secret); `-` for a hosted pool.
fn provider_cell(p: &Pool) -> String {
    p.provider.as_ref().map_or_else(
        || "-".to_owned(),
        |pp| {
            format!(
                "{} {} {} every {}s",
                pp.provider, pp.api_url, pp.credentials, pp.poll_interval_secs
            )
        },
    )
}

pub(super) fn pools_table(pools: &[Pool]) -> String {
    let rows: Vec<_> = pools
        .iter()
        .map(|p| {
            let mut row = if p.provider.is_some() {
                let mut r = vec![p.pool_id.clone(), "(provider)".into()];
                r.extend(["-", "-", "-", "-"].map(String::from));
                r.push(p.leases.to_string());
                r
            } else {
                range_row(&p.pool_id, p.range.as_ref(), Some(p.leases))
            };
            row.push(more_ranges(p));
            row.push(p.leases_ipv6.to_string());
            row.push(provider_cell(p));
            row
        })
        .collect();
    render(&POOL_HEADER, &rows)
}

pub(super) fn hosts_table(hosts: &[Host]) -> String {
    let rows: Vec<_> = hosts
        .iter()
        .map(|h| {
            vec![
                h.host_id.clone(),
                format!("{:?}", h.state).to_lowercase(),
                format!("{}/{}", h.used_vcpus, h.vcpus),
                format!("{}/{}", h.used_memory_mib, h.memory_mib),
            ]
        })
        .collect();
    render(
        &["HOST", "STATE", "VCPUS USED/TOTAL", "MEMORY MIB USED/TOTAL"],
        &rows,
    )
}

pub(super) fn instances_table(instances: &[Instance]) -> String {
    let rows: Vec<_> = instances
        .iter()
        .map(|i| {
            let conditions: Vec<String> = i
                .conditions
                .iter()
                .map(|c| format!("{}: {}", c.kind, c.message))
                .collect();
            vec![
                i.instance_id.clone(),
                i.pool_id.clone(),
                opt(i.host_id.as_ref()),
                i.state.to_string(),
                opt(i.address.as_ref()),
                opt(i.address6.as_ref()),
                match (i.addresses.is_empty(), i.addresses_stale) {
                    (true, false) => "-".into(),
                    (true, true) => "- (stale)".into(),
                    (false, false) => i.addresses.join(","),
                    (false, true) => format!("{} (stale)", i.addresses.join(",")),
                },
                i.vcpus.to_string(),
                i.memory_mib.to_string(),
                i.recreate_on_host_loss.to_string(),
                i.network_policy.to_string(),
                i.sandbox.to_string(),
                opt(i.machine.as_ref()),
                if i.allocation_id.is_empty() {
                    "-".into()
                } else {
                    i.allocation_id.clone()
                },
                if conditions.is_empty() {
                    "-".into()
                } else {
                    conditions.join("; ")
                },
            ]
        })
        .collect();
    render(
        &[
            "INSTANCE",
            "POOL",
            "HOST",
            "STATE",
            "ADDRESS",
            "ADDRESS6",
            "ADDRESSES",
            "VCPUS",
            "MEMORY_MIB",
            "RECREATE",
            "POLICY",
            "SANDBOX",
            "MACHINE",
            "ALLOCATION",
            "CONDITIONS",
        ],
        &rows,
    )
}

pub(super) fn leases_table(leases: &[Lease]) -> String {
    let rows: Vec<_> = leases
        .iter()
        .map(|l| vec![l.address.to_string(), l.instance_id.clone()])
        .collect();
    render(&["ADDRESS", "INSTANCE"], &rows)
}

/// The outcome of `host report`: one row per entry, applied ones first.
pub(super) fn report_table(out: &StatusReportOutcome) -> String {
    let list = |v: &[String]| {
        if v.is_empty() {
            "-".to_owned()
        } else {
            v.join(",")
        }
    };
    let mut rows: Vec<Vec<String>> = out
        .updated
        .iter()
        .map(|u| {
            vec![
                u.instance_id.clone(),
                "updated".into(),
                list(&u.added),
                list(&u.addresses),
            ]
        })
        .collect();
    rows.extend(out.skipped.iter().map(|s| {
        let reason = serde_json::to_value(s.reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        vec![
            s.instance_id.clone(),
            format!("skipped ({reason})"),
            "-".into(),
            s.message.clone(),
        ]
    }));
    render(&["INSTANCE", "RESULT", "ADDED", "ADDRESSES / WHY"], &rows)
}
