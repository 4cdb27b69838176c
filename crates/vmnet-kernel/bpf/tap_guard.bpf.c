// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// vmnet tap guard: a second, nftables-independent filter on every pool-mode instance tap.
//
// guard_in  (tc ingress of the tap = every frame the guest sends) repeats the source checks and
//           policies of chain `from_tap` of `bridge bcd_instances`, from per-tap BPF maps that
//           the agent keeps in step with the nft sets.
// guard_out (tc egress of the tap = every frame sent to the guest) passes a frame only when
//           chain `to_tap` marked it (GUARD_MARK), then clears the mark. When the bcd tables are
//           gone (someone ran `nft flush ruleset`), nothing is marked and nothing reaches a guest.
//
// Pass is TC_ACT_UNSPEC (let later filters run), drop is TC_ACT_SHOT. Every drop is counted
// per reason in `drops` (the reasons are the R_* values, mirrored in guard.rs).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

// Set by the loader: the skb mark bit chain `to_tap` sets.
volatile const __u32 GUARD_MARK = 0;

#define F_POLICY_NONE 1
#define F_POLICY_PRIVATE 2
#define F_IP4_UNCHECKED 4

enum reason {
	R_UNKNOWN_TAP = 0,
	R_POLICY,
	R_MAC,
	R_ETHERTYPE,
	R_ARP,
	R_IP4_SOURCE,
	R_IP6_SOURCE,
	R_SERVER,
	R_HOST_ADDRESS,
	R_MALFORMED,
	R_UNMARKED,
	R_COUNT,
};

struct tap_info {
	__u8 mac[6];
	__u8 flags;
	__u8 pad;
};

struct key4 {
	__u32 ifindex;
	__u32 addr; // network byte order
};

struct key6 {
	__u32 ifindex;
	__u8 addr[16];
};

struct addr6 {
	__u8 a[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct tap_info);
} taps SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct key4);
	__type(value, __u8);
} tap_ip4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct key6);
	__type(value, __u8);
} tap_ip6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u8);
} host_block4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct addr6);
	__type(value, __u8);
} host_block6 SEC(".maps");

// Every tap's IPv4 addresses (value: the tap's ifindex), and the host's addresses plus the
// gateways: a NIC without an IPv4 address may not send from any of them.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} leased4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u8);
} reserved4 SEC(".maps");

// The gateways among the host's own addresses: guests reach them for ICMP and DNS only.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u8);
} host_gw4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct addr6);
	__type(value, __u8);
} host_gw6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, R_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} drops SEC(".maps");

static __always_inline int shot(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&drops, &reason);
	if (n)
		*n += 1;
	return TC_ACT_SHOT;
}

struct arp_eth4 {
	__be16 htype;
	__be16 ptype;
	__u8 hlen;
	__u8 plen;
	__be16 oper;
	__u8 sha[6];
	__u8 spa[4];
	__u8 tha[6];
	__u8 tpa[4];
} __attribute__((packed));

struct ip4 {
	__u8 vihl;
	__u8 tos;
	__be16 len;
	__be16 id;
	__be16 frag;
	__u8 ttl;
	__u8 proto;
	__be16 csum;
	__be32 saddr;
	__be32 daddr;
};

struct ip6 {
	__be32 vtcfl;
	__be16 plen;
	__u8 nexthdr;
	__u8 hlim;
	__u8 saddr[16];
	__u8 daddr[16];
};

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] &&
	       a[5] == b[5];
}

static __always_inline int ip4_allowed(__u32 ifindex, __be32 addr)
{
	struct key4 k = { .ifindex = ifindex, .addr = addr };
	return bpf_map_lookup_elem(&tap_ip4, &k) != 0;
}

// An IPv4 source a NIC may use: its own addresses; without any, anything but another tap's
// lease, the host's addresses and the gateways.
static __always_inline int ip4_source_ok(__u32 ifindex, const struct tap_info *t, __be32 addr)
{
	if (!(t->flags & F_IP4_UNCHECKED))
		return ip4_allowed(ifindex, addr);
	return !bpf_map_lookup_elem(&leased4, &addr) && !bpf_map_lookup_elem(&reserved4, &addr);
}

// Traffic to a gateway the host owns: ICMP (any) and DNS (port 53) only.
static __always_inline int gateway_service_ok(__u8 l4, int first, __be16 dport, __u8 icmp)
{
	if (l4 == icmp)
		return 1;
	return first && (l4 == IPPROTO_UDP || l4 == IPPROTO_TCP) && dport == bpf_htons(53);
}

// The destinations a `private` tap may send to: 10/8, 172.16/12, 192.168/16, 169.254/16 and
// 255.255.255.255 (the nft set `private4`).
static __always_inline int private4(__be32 daddr)
{
	__u32 a = bpf_ntohl(daddr);
	return (a >> 24) == 10 || (a >> 20) == ((172 << 4) | 1) || (a >> 16) == ((192 << 8) | 168) ||
	       (a >> 16) == ((169 << 8) | 254) || a == 0xffffffff;
}

// fc00::/7, fe80::/10 and ff02::/16 (the nft set for `private_out`).
static __always_inline int private6(const __u8 *d)
{
	return (d[0] & 0xfe) == 0xfc || (d[0] == 0xfe && (d[1] & 0xc0) == 0x80) ||
	       (d[0] == 0xff && d[1] == 0x02);
}

static __always_inline int check_arp(struct __sk_buff *skb, __u32 ifx, const struct tap_info *t)
{
	struct arp_eth4 arp;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &arp, sizeof(arp)))
		return shot(R_MALFORMED);
	if (arp.htype != bpf_htons(1) || arp.ptype != bpf_htons(ETH_P_IP) || arp.hlen != 6 ||
	    arp.plen != 4)
		return shot(R_ARP);
	if (!mac_eq(arp.sha, t->mac))
		return shot(R_ARP);
	__be32 spa;
	__builtin_memcpy(&spa, arp.spa, 4);
	if (spa != 0 && !ip4_source_ok(ifx, t, spa))
		return shot(R_ARP);
	return TC_ACT_UNSPEC;
}

static __always_inline int check_ip4(struct __sk_buff *skb, __u32 ifx, const struct tap_info *t)
{
	struct ip4 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return shot(R_MALFORMED);
	__u32 ihl = (ip.vihl & 0x0f) * 4;
	if ((ip.vihl >> 4) != 4 || ihl < sizeof(ip))
		return shot(R_MALFORMED);
	// A non-first fragment carries no transport header.
	int first = (bpf_ntohs(ip.frag) & 0x1fff) == 0;
	__u32 l4 = ETH_HLEN + ihl;
	__be16 ports[2] = { 0, 0 };
	__u8 icmp_type = 0;
	if (first && (ip.proto == IPPROTO_UDP || ip.proto == IPPROTO_TCP) &&
	    bpf_skb_load_bytes(skb, l4, ports, sizeof(ports)))
		return shot(R_MALFORMED);
	if (first && ip.proto == IPPROTO_ICMP && bpf_skb_load_bytes(skb, l4, &icmp_type, 1))
		return shot(R_MALFORMED);

	if (ip.saddr == 0) {
		// 0.0.0.0 only for DHCP requests.
		if (!first || ip.proto != IPPROTO_UDP || ports[1] != bpf_htons(67))
			return shot(R_IP4_SOURCE);
	} else if (!ip4_source_ok(ifx, t, ip.saddr)) {
		return shot(R_IP4_SOURCE);
	}
	if (first && ip.proto == IPPROTO_UDP &&
	    (ports[0] == bpf_htons(67) || ports[1] == bpf_htons(68)))
		return shot(R_SERVER); // DHCP server message
	if (first && ip.proto == IPPROTO_ICMP && (icmp_type == 5 || icmp_type == 9))
		return shot(R_SERVER); // redirect, router advertisement
	if (bpf_map_lookup_elem(&host_block4, &ip.daddr))
		return shot(R_HOST_ADDRESS);
	if (bpf_map_lookup_elem(&host_gw4, &ip.daddr) &&
	    !gateway_service_ok(ip.proto, first, ports[1], IPPROTO_ICMP))
		return shot(R_HOST_ADDRESS);
	if ((t->flags & F_POLICY_PRIVATE) && !private4(ip.daddr))
		return shot(R_POLICY);
	return TC_ACT_UNSPEC;
}

#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_AUTH 51
#define NEXTHDR_DEST 60
#define NEXTHDR_ICMP 58
#define NO_L4 255

static __always_inline int check_ip6(struct __sk_buff *skb, __u32 ifx, const struct tap_info *t)
{
	struct ip6 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return shot(R_MALFORMED);
	if ((bpf_ntohl(ip.vtcfl) >> 28) != 6)
		return shot(R_MALFORMED);

	// Walk the extension headers to the transport header, as nft's `meta l4proto` does.
	__u8 nh = ip.nexthdr;
	__u32 off = ETH_HLEN + sizeof(ip);
#pragma unroll
	for (int i = 0; i < 8; i++) {
		__u8 h[2];
		if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST) {
			if (bpf_skb_load_bytes(skb, off, h, 2))
				return shot(R_MALFORMED);
			nh = h[0];
			off += ((__u32)h[1] + 1) * 8;
		} else if (nh == NEXTHDR_AUTH) {
			if (bpf_skb_load_bytes(skb, off, h, 2))
				return shot(R_MALFORMED);
			nh = h[0];
			off += ((__u32)h[1] + 2) * 4;
		} else if (nh == NEXTHDR_FRAGMENT) {
			__u8 f[4];
			if (bpf_skb_load_bytes(skb, off, f, 4))
				return shot(R_MALFORMED);
			off += 8;
			nh = (((__u16)f[2] << 8 | f[3]) & 0xfff8) ? NO_L4 : f[0];
		} else {
			break;
		}
	}
	if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST ||
	    nh == NEXTHDR_AUTH || nh == NEXTHDR_FRAGMENT)
		return shot(R_MALFORMED); // more extension headers than we walk

	__be16 ports[2] = { 0, 0 };
	__u8 icmp_type = 0;
	if ((nh == IPPROTO_UDP || nh == IPPROTO_TCP) && bpf_skb_load_bytes(skb, off, ports, 4))
		return shot(R_MALFORMED);
	if (nh == NEXTHDR_ICMP && bpf_skb_load_bytes(skb, off, &icmp_type, 1))
		return shot(R_MALFORMED);

	__u8 any = 0;
#pragma unroll
	for (int i = 0; i < 16; i++)
		any |= ip.saddr[i];
	if (!any) {
		// :: only for DAD neighbour solicitations and MLDv2 reports.
		if (nh != NEXTHDR_ICMP || (icmp_type != 135 && icmp_type != 143))
			return shot(R_IP6_SOURCE);
	} else {
		struct key6 k = { .ifindex = ifx };
		__builtin_memcpy(k.addr, ip.saddr, 16);
		if (!bpf_map_lookup_elem(&tap_ip6, &k))
			return shot(R_IP6_SOURCE);
	}
	if (nh == IPPROTO_UDP && (ports[0] == bpf_htons(547) || ports[1] == bpf_htons(546)))
		return shot(R_SERVER); // DHCPv6 server message
	if (nh == NEXTHDR_ICMP && (icmp_type == 134 || icmp_type == 137))
		return shot(R_SERVER); // router advertisement, redirect
	if (nh == NEXTHDR_ICMP && icmp_type == 136) {
		// Neighbour advertisement: the target must be one of the tap's addresses and a
		// target link-layer option (type 2, first) the tap's MAC.
		struct {
			__u8 hdr[8];
			__u8 target[16];
			__u8 opt[2];
			__u8 lladdr[6];
		} na;
		if (bpf_skb_load_bytes(skb, off, &na, 24))
			return shot(R_MALFORMED);
		struct key6 k = { .ifindex = ifx };
		__builtin_memcpy(k.addr, na.target, 16);
		if (!bpf_map_lookup_elem(&tap_ip6, &k))
			return shot(R_IP6_SOURCE);
		if (!bpf_skb_load_bytes(skb, off + 24, na.opt, 8) && na.opt[0] == 2 &&
		    na.opt[1] == 1 && !mac_eq(na.lladdr, t->mac))
			return shot(R_IP6_SOURCE);
	}
	struct addr6 d;
	__builtin_memcpy(d.a, ip.daddr, 16);
	if (bpf_map_lookup_elem(&host_block6, &d))
		return shot(R_HOST_ADDRESS);
	if (bpf_map_lookup_elem(&host_gw6, &d) &&
	    !gateway_service_ok(nh, nh != NO_L4, ports[1], NEXTHDR_ICMP))
		return shot(R_HOST_ADDRESS);
	if ((t->flags & F_POLICY_PRIVATE) && !private6(ip.daddr))
		return shot(R_POLICY);
	return TC_ACT_UNSPEC;
}

SEC("classifier")
int guard_in(struct __sk_buff *skb)
{
	__u32 ifx = skb->ifindex;
	struct tap_info *t = bpf_map_lookup_elem(&taps, &ifx);
	if (!t)
		return shot(R_UNKNOWN_TAP);
	if (t->flags & F_POLICY_NONE)
		return shot(R_POLICY);
	if (skb->vlan_present)
		return shot(R_ETHERTYPE);
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return shot(R_MALFORMED);
	if (!mac_eq(eth.h_source, t->mac))
		return shot(R_MAC);
	switch (bpf_ntohs(eth.h_proto)) {
	case ETH_P_ARP:
		return check_arp(skb, ifx, t);
	case ETH_P_IP:
		return check_ip4(skb, ifx, t);
	case ETH_P_IPV6:
		return check_ip6(skb, ifx, t);
	default:
		return shot(R_ETHERTYPE);
	}
}

SEC("classifier")
int guard_out(struct __sk_buff *skb)
{
	if (!(skb->mark & GUARD_MARK))
		return shot(R_UNMARKED);
	skb->mark &= ~GUARD_MARK;
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
