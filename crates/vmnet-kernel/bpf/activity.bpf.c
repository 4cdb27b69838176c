// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// vmnet packet activity: on the tc egress of every namespace-mode VM tap (every frame the guest
// is about to receive), record per VM user id when the last TCP segment from the host side
// arrived. Nothing else counts: ARP, NDP and all other ICMPv6, ICMP, UDP, frames that are not
// IPv4/IPv6, packets the VM namespace sends itself (the metadata service at 169.254.169.254
// among them), and TCP whose source is link-local (169.254.0.0/16, fe80::/10). What the guest
// sends passes the tap's ingress, where this program is not attached.
//
// "From the host side" is "entered the VM namespace through its veth end": the VM is found by
// the packet's ingress ifindex (the VM veth end inside the namespace) in map `activity_dev`,
// which the agent fills. A packet the namespace made itself has no ingress device and is not
// found. The time is CLOCK_BOOTTIME in ns (bpf_ktime_get_boot_ns), in array `activity_last`
// indexed by user id (0 = never). Both maps are pinned by name so that they outlive the agent
// and the program.
//
// The program never changes a packet and always returns TC_ACT_UNSPEC, so the filters after it
// on the same hook run as if it were absent.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define LIBBPF_PIN_BY_NAME 1

// A stored time is rewritten only when it is this much older (ns): on a busy flow most
// packets then only read the shared cache line.
#define GRANULARITY_NS 1000000ULL

// The IPv6 extension headers walked before giving up (a packet with more is not counted).
#define MAX_EXT_HEADERS 6

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} activity_dev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} activity_last SEC(".maps");

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

#define NEXTHDR_HOP 0
#define NEXTHDR_ROUTING 43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_AUTH 51
#define NEXTHDR_DEST 60

static __always_inline int tcp4(struct __sk_buff *skb)
{
	struct ip4 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return 0;
	if ((ip.vihl >> 4) != 4 || ip.proto != IPPROTO_TCP)
		return 0;
	// 169.254.0.0/16: the namespace's own link-local services (metadata).
	return (bpf_ntohl(ip.saddr) >> 16) != ((169 << 8) | 254);
}

static __always_inline int tcp6(struct __sk_buff *skb)
{
	struct ip6 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return 0;
	if ((bpf_ntohl(ip.vtcfl) >> 28) != 6)
		return 0;
	// fe80::/10 is never forwarded: only the namespace itself sends from it.
	if (ip.saddr[0] == 0xfe && (ip.saddr[1] & 0xc0) == 0x80)
		return 0;
	__u8 nh = ip.nexthdr;
	__u32 off = ETH_HLEN + sizeof(ip);
#pragma unroll
	for (int i = 0; i < MAX_EXT_HEADERS; i++) {
		__u8 h[4];
		if (nh == IPPROTO_TCP)
			return 1;
		if (nh == NEXTHDR_HOP || nh == NEXTHDR_ROUTING || nh == NEXTHDR_DEST) {
			if (bpf_skb_load_bytes(skb, off, h, 2))
				return 0;
			nh = h[0];
			off += ((__u32)h[1] + 1) * 8;
		} else if (nh == NEXTHDR_AUTH) {
			if (bpf_skb_load_bytes(skb, off, h, 2))
				return 0;
			nh = h[0];
			off += ((__u32)h[1] + 2) * 4;
		} else if (nh == NEXTHDR_FRAGMENT) {
			if (bpf_skb_load_bytes(skb, off, h, 4))
				return 0;
			nh = h[0];
			off += 8;
		} else {
			return 0;
		}
	}
	return nh == IPPROTO_TCP;
}

SEC("classifier")
int activity_out(struct __sk_buff *skb)
{
	int tcp = 0;
	if (skb->protocol == bpf_htons(ETH_P_IP))
		tcp = tcp4(skb);
	else if (skb->protocol == bpf_htons(ETH_P_IPV6))
		tcp = tcp6(skb);
	if (!tcp)
		return TC_ACT_UNSPEC;
	__u32 dev = skb->ingress_ifindex;
	if (!dev)
		return TC_ACT_UNSPEC;
	__u32 *uid = bpf_map_lookup_elem(&activity_dev, &dev);
	if (!uid)
		return TC_ACT_UNSPEC;
	__u32 key = *uid;
	__u64 *last = bpf_map_lookup_elem(&activity_last, &key);
	if (!last)
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_boot_ns();
	if (now - *last >= GRANULARITY_NS)
		*last = now;
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
