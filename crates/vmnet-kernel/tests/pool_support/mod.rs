//! Shared setup of the pool-mode kernel tests: a sandbox host with bridge `br0`
//! (10.0.0.1/29, the gateway, and 2001:db8:10::1/64, the IPv6 range's gateway), the bcd tables
//! loaded through libnftables, and instances whose taps are relayed to simulated guests
//! configured from their own seeds.

#![allow(dead_code, missing_docs)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use vmnet_kernel::pool::firewall::PoolFirewall;
use vmnet_kernel::pool::guard::TapGuard;
use vmnet_kernel::pool::host::{GuardedTaps, PoolHost};
use vmnet_kernel::pool::libnft::LibNft;
use vmnet_kernel::pool::tap::Taps;
use vmnet_kernel::tap::TapOwner;
use vmnet_model::nic::{IfName, InstanceSpec, MacAddr, NetworkPolicy};
use vmnet_model::pool::{Family, IpRange, PoolRange};
use vmnet_plan::pool::nft::{Firewall, HostAddrs};
use vmnet_plan::pool::nic::{Leases, instance_spec};
use vmnet_plan::pool::seed::seed;
use vmnet_testkit::Sandbox;
use vmnet_testkit::netns as tk;
use vmnet_testkit::relay::Relay;
use vmnet_testkit::sandbox::{HOST_UPLINK_V4, HOST_UPLINK_V6};
use vmnet_testkit::sim_guest;

pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// The IPv6 range's gateway, on `br0`.
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x10, 0, 0, 0, 0, 1);

pub fn range() -> IpRange {
    IpRange {
        pool_id: "pool-1".into(),
        cidr: "10.0.0.0/29".parse().unwrap(),
        gateway: GATEWAY,
        first_host: "10.0.0.2".parse().unwrap(),
        last_host: "10.0.0.6".parse().unwrap(),
        dns: vec![IpAddr::V4(GATEWAY)],
    }
}

/// The pool's IPv6 range: `2001:db8:10::/64`, gateway [`GATEWAY6`], leasing `::2` to `::6`.
pub fn range6() -> PoolRange {
    PoolRange {
        pool_id: "pool-1".into(),
        family: Family::Ipv6,
        cidr: "2001:db8:10::/64".parse().unwrap(),
        gateway: IpAddr::V6(GATEWAY6),
        first_host: "2001:db8:10::2".parse().unwrap(),
        last_host: "2001:db8:10::6".parse().unwrap(),
    }
}

pub fn host_addrs() -> HostAddrs {
    HostAddrs {
        own: vec![
            IpAddr::V4(GATEWAY),
            IpAddr::V6(GATEWAY6),
            IpAddr::V4(HOST_UPLINK_V4),
            IpAddr::V6(HOST_UPLINK_V6),
        ],
        gateways: vec![IpAddr::V4(GATEWAY), IpAddr::V6(GATEWAY6)],
    }
}

pub struct Guest {
    pub inst: InstanceSpec,
    pub ns: String,
    pub mac: MacAddr,
    pub ip4: Ipv4Addr,
    /// The IPv6 lease (`::` without one).
    pub ip6: Ipv6Addr,
    pub ll6: Ipv6Addr,
    pub tap: String,
    pub relay: Option<Relay>,
}

pub struct Lab {
    pub pool: PoolHost<LibNft>,
    pub host: String,
    pub guests: Vec<Guest>,
    // Dropped last: deletes every namespace of the test.
    pub sb: Sandbox,
}

impl Lab {
    /// A lab with both layers: the bcd tables and the tap guard (the product's default).
    pub async fn new(tag: &str) -> Self {
        Self::build(tag, true).await
    }

    /// A lab with the bcd tables only (no tap guard): proves what nftables alone does.
    pub async fn nft_only(tag: &str) -> Self {
        Self::build(tag, false).await
    }

    async fn build(tag: &str, guard: bool) -> Self {
        vmnet_testkit::require_root();
        let sb = Sandbox::new(tag).expect("sandbox");
        let host = sb.host();
        tk::ip(&host, &["link", "add", "br0", "type", "bridge"]).unwrap();
        tk::ip(&host, &["addr", "add", "10.0.0.1/29", "dev", "br0"]).unwrap();
        let gw6 = format!("{GATEWAY6}/64");
        tk::ip(&host, &["addr", "add", &gw6, "dev", "br0", "nodad"]).unwrap();
        tk::ip(&host, &["link", "set", "br0", "up"]).unwrap();
        tk::ip(
            &sb.inet(),
            &[
                "route",
                "add",
                "10.0.0.0/29",
                "via",
                &HOST_UPLINK_V4.to_string(),
            ],
        )
        .unwrap();
        let nft = LibNft::in_netns(&host).expect("libnftables context in the sandbox host");
        let mut firewall = PoolFirewall::new(nft);
        firewall
            .replace(Firewall {
                taps: vec![],
                host: host_addrs(),
            })
            .expect("initial tables");
        let handle = vmnet_kernel::netns::netlink_in(&host).expect("netlink");
        let guard = guard.then(|| {
            let g = TapGuard::load(Some(&host)).expect("load the tap guard");
            g.set_host(&host_addrs()).expect("guard host addresses");
            Arc::new(g)
        });
        let pool = PoolHost {
            firewall,
            taps: GuardedTaps {
                taps: Taps::new(&host, handle),
                netns: Some(host.clone()),
                owner: TapOwner::default(),
                guard,
            },
        };
        Self {
            pool,
            host,
            guests: Vec::new(),
            sb,
        }
    }

    /// Starts instance `id` with lease `ip` and attaches a simulated guest configured from the
    /// instance's own seed. Returns its index in `guests`.
    pub async fn add(&mut self, id: &str, ip: &str, policy: NetworkPolicy, sandbox: bool) -> usize {
        self.add_leased(id, ip, None, policy, sandbox).await
    }

    /// Starts instance `id` with both leases, `ip` from [`range`] and `ip6` from [`range6`],
    /// and attaches a simulated guest configured from its own seed (both addresses, both
    /// default routes). Returns its index in `guests`.
    pub async fn add_dual(&mut self, id: &str, ip: &str, ip6: &str) -> usize {
        self.add_leased(id, ip, Some(ip6), NetworkPolicy::Public, false)
            .await
    }

    async fn add_leased(
        &mut self,
        id: &str,
        ip: &str,
        ip6: Option<&str>,
        policy: NetworkPolicy,
        sandbox: bool,
    ) -> usize {
        let br: IfName = "br0".parse().unwrap();
        let (r, r6) = (range(), range6());
        let ip6: Option<Ipv6Addr> = ip6.map(|a| a.parse().unwrap());
        let leases = Leases {
            v4: Some((ip.parse().unwrap(), &r)),
            v6: ip6.map(|a| (a, &r6)),
        };
        let inst = instance_spec(id, &format!("alloc-{id}"), &br, leases, policy, sandbox)
            .expect("instance spec");
        self.pool
            .start_instance(&inst)
            .await
            .expect("start instance");
        let tap = inst.tap_names().unwrap()[0].to_string();
        let ns = self.sb.add_netns(&format!("g-{id}")).expect("guest netns");
        tk::sysctl(&ns, "net/ipv6/conf/all/accept_dad", "0").unwrap();
        tk::sysctl(&ns, "net/ipv6/conf/default/accept_dad", "0").unwrap();
        let relay = Relay::start(&self.host, &tap, &ns, "eth0").expect("relay");
        let s = seed(&inst, None).unwrap();
        let mac = inst.nics[0].mac;
        let net = sim_guest::configure(&ns, "eth0", mac, s.network_config.as_deref())
            .expect("guest config");
        let mut want = vec![format!("{ip}/29")];
        want.extend(ip6.map(|a| format!("{a}/64")));
        assert_eq!(net.addresses, want);
        if ip6.is_some() {
            assert_eq!(
                net.routes,
                [
                    ("0.0.0.0/0".to_owned(), GATEWAY.to_string()),
                    ("::/0".to_owned(), GATEWAY6.to_string())
                ]
            );
        }
        self.guests.push(Guest {
            inst,
            ns,
            mac,
            ip4: ip.parse().unwrap(),
            ip6: ip6.unwrap_or(Ipv6Addr::UNSPECIFIED),
            ll6: mac.link_local_v6(),
            tap,
            relay: Some(relay),
        });
        // Let the link-local address and the bridge port settle.
        std::thread::sleep(Duration::from_millis(300));
        self.guests.len() - 1
    }

    /// Starts instance `id` without a lease (its NIC keeps DHCP: no IPv4 source check of its
    /// own) and attaches a simulated guest with no address. Returns its index in `guests`.
    pub async fn add_unleased(&mut self, id: &str) -> usize {
        let br: IfName = "br0".parse().unwrap();
        let inst = instance_spec(
            id,
            &format!("alloc-{id}"),
            &br,
            Leases::default(),
            NetworkPolicy::Public,
            false,
        )
        .expect("instance spec");
        self.pool
            .start_instance(&inst)
            .await
            .expect("start instance");
        let tap = inst.tap_names().unwrap()[0].to_string();
        let ns = self.sb.add_netns(&format!("g-{id}")).expect("guest netns");
        let relay = Relay::start(&self.host, &tap, &ns, "eth0").expect("relay");
        let mac = inst.nics[0].mac;
        let net = sim_guest::configure(&ns, "eth0", mac, None).expect("guest config");
        assert!(net.dhcp && net.addresses.is_empty(), "{net:?}");
        self.guests.push(Guest {
            inst,
            ns,
            mac,
            ip4: Ipv4Addr::UNSPECIFIED,
            ip6: Ipv6Addr::UNSPECIFIED,
            ll6: mac.link_local_v6(),
            tap,
            relay: Some(relay),
        });
        std::thread::sleep(Duration::from_millis(300));
        self.guests.len() - 1
    }

    /// Gives `br0` a fixed MAC (so frames to the gateway can be addressed) and returns it.
    pub fn bridge_mac(&self) -> MacAddr {
        let mac = MacAddr([0x02, 0, 0, 0, 0, 0x01]);
        tk::ip(
            &self.host,
            &["link", "set", "br0", "address", &mac.to_string()],
        )
        .unwrap();
        mac
    }

    /// Two public instances, `inst-a` (10.0.0.2) and `inst-b` (10.0.0.3), with their guests;
    /// their indexes in `guests`.
    pub async fn add_public_pair(&mut self) -> (usize, usize) {
        let a = self
            .add("inst-a", "10.0.0.2", NetworkPolicy::Public, false)
            .await;
        let b = self
            .add("inst-b", "10.0.0.3", NetworkPolicy::Public, false)
            .await;
        (a, b)
    }

    pub fn nft_list(&self) -> String {
        let out = tk::exec(
            &self.host,
            "nft",
            &["-j", "list", "ruleset"],
            Duration::from_secs(10),
        )
        .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn link_exists(&self, name: &str) -> bool {
        tk::ip(&self.host, &["link", "show", "dev", name]).is_ok()
    }
}

/// A unique marker for one probe frame.
pub fn marker(what: &str) -> Vec<u8> {
    format!("vmnet-probe-{what}-{}", std::process::id()).into_bytes()
}

pub fn ping_ok(ns: &str, to: IpAddr) -> bool {
    vmnet_testkit::traffic::ping(ns, to, 3, Duration::from_millis(400))
        .unwrap()
        .received
        > 0
}

/// One probe frame from guest `a` to guest `b`, and whether it must arrive.
pub struct Case {
    pub name: &'static str,
    pub frame: Vec<u8>,
    pub marker: Vec<u8>,
    pub arrives: bool,
}

impl Case {
    /// A case named `name` whose frame `build` makes around a fresh marker.
    pub fn new(name: &'static str, arrives: bool, build: &dyn Fn(&[u8]) -> Vec<u8>) -> Self {
        let marker = marker(name);
        Self {
            name,
            frame: build(&marker),
            marker,
            arrives,
        }
    }
}

/// The spoof suite: each spoof next to the same frame sent honestly (which must arrive, so the
/// capture is proven to work). Frames go from `a` to `b` (or broadcast/all-nodes).
pub fn spoof_cases(a: &Guest, b: &Guest) -> Vec<Case> {
    use vmnet_testkit::probe::{
        ALL_NODES_MAC, BROADCAST, arp_reply_frame, icmp4_frame, icmp6_frame, udp4_frame, udp6_frame,
    };
    let foreign_mac = MacAddr([0x02, 0xde, 0xad, 0xbe, 0xef, 0x01]);
    let ports = (4000, 4001);
    let all_nodes: Ipv6Addr = "ff02::1".parse().unwrap();
    let foreign6: Ipv6Addr = "fe80::bad:1".parse().unwrap();
    let mut out = Vec::new();
    let mut case = |name, arrives, build: &dyn Fn(&[u8]) -> Vec<u8>| {
        out.push(Case::new(name, arrives, build));
    };
    case("honest IPv4", true, &|m| {
        udp4_frame(b.mac, a.mac, a.ip4, b.ip4, ports, m)
    });
    case("foreign source MAC", false, &|m| {
        udp4_frame(b.mac, foreign_mac, a.ip4, b.ip4, ports, m)
    });
    case("foreign IPv4 source", false, &|m| {
        udp4_frame(b.mac, a.mac, Ipv4Addr::new(10, 0, 0, 5), b.ip4, ports, m)
    });
    case("own link-local IPv6", true, &|m| {
        udp6_frame(b.mac, a.mac, a.ll6, b.ll6, ports, m)
    });
    case("foreign IPv6 source", false, &|m| {
        udp6_frame(b.mac, a.mac, foreign6, b.ll6, ports, m)
    });
    case("honest ARP reply", true, &|m| {
        arp_reply_frame(b.mac, a.mac, (a.mac, a.ip4), (b.mac, b.ip4), m)
    });
    case("ARP reply claiming the gateway", false, &|m| {
        arp_reply_frame(b.mac, a.mac, (a.mac, GATEWAY), (b.mac, b.ip4), m)
    });
    case("ARP reply with a foreign sender MAC", false, &|m| {
        arp_reply_frame(b.mac, a.mac, (foreign_mac, a.ip4), (b.mac, b.ip4), m)
    });
    case("ARP reply with a non-Ethernet hardware type", false, &|m| {
        let mut f = arp_reply_frame(b.mac, a.mac, (a.mac, a.ip4), (b.mac, b.ip4), m);
        f[14..16].copy_from_slice(&6u16.to_be_bytes());
        f
    });
    case("broadcast UDP (control)", true, &|m| {
        udp4_frame(
            BROADCAST,
            a.mac,
            a.ip4,
            Ipv4Addr::BROADCAST,
            (4067, 4068),
            m,
        )
    });
    case("DHCP offer", false, &|m| {
        udp4_frame(BROADCAST, a.mac, a.ip4, Ipv4Addr::BROADCAST, (67, 68), m)
    });
    case("DHCP offer from another source port", false, &|m| {
        udp4_frame(BROADCAST, a.mac, a.ip4, Ipv4Addr::BROADCAST, (4067, 68), m)
    });
    case("DHCPv6 reply", false, &|m| {
        udp6_frame(b.mac, a.mac, a.ll6, b.ll6, (547, 546), m)
    });
    case("DHCPv6 reply from another source port", false, &|m| {
        udp6_frame(b.mac, a.mac, a.ll6, b.ll6, (4547, 546), m)
    });
    case("ICMP echo request (control)", true, &|m| {
        icmp4_frame(b.mac, a.mac, a.ip4, b.ip4, 8, m)
    });
    case("ICMP redirect", false, &|m| {
        icmp4_frame(b.mac, a.mac, a.ip4, b.ip4, 5, m)
    });
    case("ICMP router advertisement", false, &|m| {
        icmp4_frame(BROADCAST, a.mac, a.ip4, Ipv4Addr::BROADCAST, 9, m)
    });
    case("ICMPv6 echo to all-nodes (control)", true, &|m| {
        icmp6_frame(ALL_NODES_MAC, a.mac, a.ll6, all_nodes, 128, m)
    });
    case("router advertisement", false, &|m| {
        icmp6_frame(ALL_NODES_MAC, a.mac, a.ll6, all_nodes, 134, m)
    });
    case("ICMPv6 redirect", false, &|m| {
        icmp6_frame(b.mac, a.mac, a.ll6, b.ll6, 137, m)
    });
    case("VLAN-tagged frame", false, &|m| {
        let mut tagged = udp4_frame(b.mac, a.mac, a.ip4, b.ip4, ports, m);
        tagged.splice(12..12, [0x81, 0x00, 0x00, 0x05]);
        tagged
    });
    out
}

/// Frames from `u`, a guest without a lease, to guest `b`: it may use any IPv4 source except
/// another tap's lease (`a`'s), the host's addresses and the gateway.
pub fn unleased_cases(u: &Guest, a: &Guest, b: &Guest) -> Vec<Case> {
    use vmnet_testkit::probe::{arp_reply_frame, udp4_frame};
    let ports = (4000, 4001);
    let unrelated = Ipv4Addr::new(10, 0, 0, 77);
    let mut out = Vec::new();
    let mut case = |name, arrives, build: &dyn Fn(&[u8]) -> Vec<u8>| {
        out.push(Case::new(name, arrives, build));
    };
    case("unleased: an unrelated IPv4 source (control)", true, &|m| {
        udp4_frame(b.mac, u.mac, unrelated, b.ip4, ports, m)
    });
    case("unleased: another tap's lease as source", false, &|m| {
        udp4_frame(b.mac, u.mac, a.ip4, b.ip4, ports, m)
    });
    case("unleased: the gateway as source", false, &|m| {
        udp4_frame(b.mac, u.mac, GATEWAY, b.ip4, ports, m)
    });
    case(
        "unleased: the host's uplink address as source",
        false,
        &|m| udp4_frame(b.mac, u.mac, HOST_UPLINK_V4, b.ip4, ports, m),
    );
    case(
        "unleased: an ARP reply for an unrelated address (control)",
        true,
        &|m| arp_reply_frame(b.mac, u.mac, (u.mac, unrelated), (b.mac, b.ip4), m),
    );
    case("unleased: an ARP reply claiming the gateway", false, &|m| {
        arp_reply_frame(b.mac, u.mac, (u.mac, GATEWAY), (b.mac, b.ip4), m)
    });
    case(
        "unleased: an ARP reply claiming another tap's lease",
        false,
        &|m| arp_reply_frame(b.mac, u.mac, (u.mac, a.ip4), (b.mac, b.ip4), m),
    );
    out
}

/// Frames from `a` to the gateway address the host owns (`br0`, MAC `br0_mac`): ICMP and DNS
/// pass, any other port does not. Look for them on `br0` in the host namespace.
pub fn gateway_cases(a: &Guest, br0_mac: MacAddr) -> Vec<Case> {
    use vmnet_testkit::probe::{icmp4_frame, udp4_frame};
    let mut out = Vec::new();
    let mut case = |name, arrives, build: &dyn Fn(&[u8]) -> Vec<u8>| {
        out.push(Case::new(name, arrives, build));
    };
    case("to the gateway: ICMP echo", true, &|m| {
        icmp4_frame(br0_mac, a.mac, a.ip4, GATEWAY, 8, m)
    });
    case("to the gateway: DNS (udp/53)", true, &|m| {
        udp4_frame(br0_mac, a.mac, a.ip4, GATEWAY, (4000, 53), m)
    });
    case("to the gateway: another port (udp/9999)", false, &|m| {
        udp4_frame(br0_mac, a.mac, a.ip4, GATEWAY, (4000, 9999), m)
    });
    case("to the gateway: SSH (tcp/22)", false, &|m| {
        let mut f = udp4_frame(br0_mac, a.mac, a.ip4, GATEWAY, (4000, 22), m);
        f[23] = 6; // protocol TCP (the first four bytes of a TCP header are the ports)
        let c = ipv4_header_checksum(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    });
    out
}

fn ipv4_header_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for (i, c) in h.chunks(2).enumerate() {
        if i != 5 {
            sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap()
}

/// Sends every case from guest `a` and asserts what `cap` saw (`layer` names what filters, for
/// the messages).
pub fn check_spoofs(a: &Guest, cases: &[Case], cap: &vmnet_testkit::probe::Capture, layer: &str) {
    let wait = Duration::from_millis(600);
    for c in cases {
        vmnet_testkit::probe::send_frame(&a.ns, "eth0", &c.frame).unwrap();
        let seen = cap.saw(&c.marker, wait);
        assert_eq!(
            seen,
            c.arrives,
            "{layer}: {} must {}",
            c.name,
            if c.arrives { "arrive" } else { "drop" }
        );
    }
}
