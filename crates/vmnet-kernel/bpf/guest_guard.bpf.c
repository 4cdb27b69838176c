// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// vmnet guest guard: what a namespace-mode guest may send, checked at the first hook its
// frames reach (TCX ingress of the VM's tap, inside the VM's network namespace). One program
// for the whole host, attached to every VM's tap; a VM is an entry in map `guard_vms`, keyed
// by the inode number of its network namespace (tap ifindexes repeat across namespaces).
//
// The rule (docs/src/guest-isolation.md):
// - Ethernet source: the guest MAC 06:00:ac:10:00:02; EtherType ARP, IPv4 or IPv6 only (no
//   VLAN tag, whether the kernel took it off the frame already or not).
// - ARP: Ethernet/IPv4 request or reply from the guest MAC as sender, sender address
//   172.16.0.2 (or 0.0.0.0 in a probe request), asking for or answering the gateway
//   172.16.0.1, the metadata address 169.254.169.254 or the guest's own address.
// - IPv4: source 172.16.0.2; no ICMP redirect or router advertisement, no DHCP server message
//   (UDP from port 67).
// - IPv6: source the VM's mesh address, or an address inside its routed public block; a
//   link-local or unspecified source only for neighbour discovery and MLD (ICMPv6 types 130-133,
//   135, 136, after at most a hop-by-hop header) to a link-local or link-scope multicast
//   address, i.e. with the namespace; a gateway VM also forwards packets to a mesh address
//   (fdaa::/16) from sources outside fdaa::/16. A source inside fdaa::/16 other than the VM's
//   own never passes. No router advertisement, redirect (from any source) or DHCPv6 server
//   message (UDP from port 547).
//
// A frame that passes gets GUARD_MARK in its mark: the namespace's nft table drops every
// packet it forwards from the tap without it, so a program detached by hand fails closed.
// Pass is TC_ACT_UNSPEC (TCX_NEXT: later programs run), drop TC_ACT_SHOT (TCX_DROP).
// Drops are counted per VM user id and kind in `guard_drops` (per CPU); a frame on a tap
// whose namespace has no entry is dropped and counted in `guard_unknown`. The kinds are the
// K_* values, mirrored in src/guard/mod.rs.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

// Set by the loader: the mark bit a passing frame gets (vmnet_plan::ns::guard::GUARD_MARK).
volatile const __u32 GUARD_MARK = 0;

enum kind {
	K_MAC = 0,
	K_ETHERTYPE,
	K_ARP,
	K_IPV4_SOURCE,
	K_IPV6_SOURCE,
	K_MESH_SOURCE,
	K_LINK_LOCAL,
	K_SERVER_MESSAGE,
	K_MALFORMED,
	K_COUNT,
};

#define F_MESH 1
#define F_BLOCK 2
#define F_GATEWAY 4

// A VM: its user id, what it may use (flags), its mesh address and its routed public block
// (the block as two host-order halves and its prefix length).
struct guard_vm {
	__u32 uid;
	__u32 flags;
	__u8 mesh[16];
	__u64 block_hi;
	__u64 block_lo;
	__u32 block_len;
	__u32 pad;
};

struct guard_drops {
	__u64 n[K_COUNT];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct guard_vm);
} guard_vms SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct guard_drops);
} guard_drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} guard_unknown SEC(".maps");

// The kernel's own structures, read for the namespace of the tap (CO-RE: the field offsets
// are relocated against the running kernel's BTF when the program is loaded).
struct ns_common {
	unsigned int inum;
} __attribute__((preserve_access_index));

struct net {
	struct ns_common ns;
} __attribute__((preserve_access_index));

typedef struct {
	struct net *net;
} possible_net_t;

struct net_device {
	possible_net_t nd_net;
} __attribute__((preserve_access_index));

struct sk_buff {
	struct net_device *dev;
} __attribute__((preserve_access_index));

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

#define GUEST_IP4 0xac100002    // 172.16.0.2
#define GATEWAY_IP4 0xac100001  // 172.16.0.1
#define METADATA_IP4 0xa9fea9fe // 169.254.169.254
#define NEXTHDR_HOP 0
#define NEXTHDR_ICMP 58

static const __u8 GUEST_MAC[6] = {0x06, 0x00, 0xac, 0x10, 0x00, 0x02};

static __always_inline int shot(__u32 uid, __u32 kind)
{
	struct guard_drops *d = bpf_map_lookup_elem(&guard_drops, &uid);
	if (d && kind < K_COUNT)
		d->n[kind] += 1;
	return TC_ACT_SHOT;
}

static __always_inline int pass(struct __sk_buff *skb)
{
	skb->mark |= GUARD_MARK;
	return TC_ACT_UNSPEC;
}

// The inode number of the tap's network namespace (0 when it cannot be read).
static __always_inline __u32 netns_inode(struct __sk_buff *ctx)
{
	struct sk_buff *skb = (struct sk_buff *)ctx;
	struct net_device *dev = 0;
	struct net *net = 0;
	unsigned int inum = 0;
	if (bpf_probe_read_kernel(&dev, sizeof(dev), &skb->dev) || !dev)
		return 0;
	if (bpf_probe_read_kernel(&net, sizeof(net), &dev->nd_net.net) || !net)
		return 0;
	if (bpf_probe_read_kernel(&inum, sizeof(inum), &net->ns.inum))
		return 0;
	return inum;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] &&
	       a[5] == b[5];
}

static __always_inline int addr_eq(const __u8 *a, const __u8 *b)
{
	__u64 a0, a1, b0, b1;
	__builtin_memcpy(&a0, a, 8);
	__builtin_memcpy(&a1, a + 8, 8);
	__builtin_memcpy(&b0, b, 8);
	__builtin_memcpy(&b1, b + 8, 8);
	return a0 == b0 && a1 == b1;
}

static __always_inline int in_mesh(const __u8 *a)
{
	return a[0] == 0xfd && a[1] == 0xaa;
}

// fe80::/10 or :: (the addresses a guest uses before and for neighbour discovery).
static __always_inline int link_local_or_unspecified(const __u8 *a)
{
	if (a[0] == 0xfe && (a[1] & 0xc0) == 0x80)
		return 1;
	__u8 any = 0;
#pragma unroll
	for (int i = 0; i < 16; i++)
		any |= a[i];
	return !any;
}

// Whether `a` lies in the VM's routed public block.
static __always_inline int in_block(const struct guard_vm *vm, const __u8 *a)
{
	if (!(vm->flags & F_BLOCK) || vm->block_len > 128)
		return 0;
	__u64 hi, lo;
	__builtin_memcpy(&hi, a, 8);
	__builtin_memcpy(&lo, a + 8, 8);
	hi = bpf_be64_to_cpu(hi);
	lo = bpf_be64_to_cpu(lo);
	__u32 len = vm->block_len;
	if (len == 0)
		return 1;
	if (len <= 64)
		return (hi & (~0ULL << (64 - len))) == vm->block_hi;
	return hi == vm->block_hi && (lo & (~0ULL << (128 - len))) == vm->block_lo;
}

static __always_inline int check_arp(struct __sk_buff *skb, __u32 uid)
{
	struct arp_eth4 arp;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &arp, sizeof(arp)))
		return shot(uid, K_MALFORMED);
	if (arp.htype != bpf_htons(1) || arp.ptype != bpf_htons(ETH_P_IP) || arp.hlen != 6 ||
	    arp.plen != 4)
		return shot(uid, K_ARP);
	if (arp.oper != bpf_htons(1) && arp.oper != bpf_htons(2))
		return shot(uid, K_ARP);
	if (!mac_eq(arp.sha, GUEST_MAC))
		return shot(uid, K_ARP);
	__u32 spa, tpa;
	__builtin_memcpy(&spa, arp.spa, 4);
	__builtin_memcpy(&tpa, arp.tpa, 4);
	spa = bpf_ntohl(spa);
	tpa = bpf_ntohl(tpa);
	// 0.0.0.0 only in a probe (a request checking the guest's own address is free).
	if (spa != GUEST_IP4 && !(spa == 0 && arp.oper == bpf_htons(1)))
		return shot(uid, K_ARP);
	if (tpa != GATEWAY_IP4 && tpa != METADATA_IP4 && tpa != GUEST_IP4)
		return shot(uid, K_ARP);
	return pass(skb);
}

static __always_inline int check_ip4(struct __sk_buff *skb, __u32 uid)
{
	struct ip4 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return shot(uid, K_MALFORMED);
	__u32 ihl = (ip.vihl & 0x0f) * 4;
	if ((ip.vihl >> 4) != 4 || ihl < sizeof(ip))
		return shot(uid, K_MALFORMED);
	if (ip.saddr != bpf_htonl(GUEST_IP4))
		return shot(uid, K_IPV4_SOURCE);
	// A non-first fragment carries no transport header.
	if ((bpf_ntohs(ip.frag) & 0x1fff) != 0)
		return pass(skb);
	if (ip.proto == IPPROTO_ICMP) {
		__u8 type;
		if (bpf_skb_load_bytes(skb, ETH_HLEN + ihl, &type, 1))
			return shot(uid, K_MALFORMED);
		if (type == 5 || type == 9) // redirect, router advertisement
			return shot(uid, K_SERVER_MESSAGE);
	} else if (ip.proto == IPPROTO_UDP) {
		__be16 sport;
		if (bpf_skb_load_bytes(skb, ETH_HLEN + ihl, &sport, 2))
			return shot(uid, K_MALFORMED);
		if (sport == bpf_htons(67)) // a DHCP server's message
			return shot(uid, K_SERVER_MESSAGE);
	}
	return pass(skb);
}

// A packet from a source the VM may use: no router advertisement, redirect or DHCPv6 server
// message (checked when the transport header follows the IPv6 header directly).
static __always_inline int server_message6(struct __sk_buff *skb, __u32 uid, const struct ip6 *ip)
{
	__u32 off = ETH_HLEN + sizeof(*ip);
	if (ip->nexthdr == NEXTHDR_ICMP) {
		__u8 type;
		if (bpf_skb_load_bytes(skb, off, &type, 1))
			return shot(uid, K_MALFORMED);
		if (type == 134 || type == 137)
			return shot(uid, K_SERVER_MESSAGE);
	} else if (ip->nexthdr == IPPROTO_UDP) {
		__be16 sport;
		if (bpf_skb_load_bytes(skb, off, &sport, 2))
			return shot(uid, K_MALFORMED);
		if (sport == bpf_htons(547))
			return shot(uid, K_SERVER_MESSAGE);
	}
	return pass(skb);
}

// A link-local or unspecified source: neighbour discovery and MLD with the namespace only.
static __always_inline int neighbour_discovery(struct __sk_buff *skb, __u32 uid,
					       const struct ip6 *ip)
{
	const __u8 *d = ip->daddr;
	int to_namespace = (d[0] == 0xfe && (d[1] & 0xc0) == 0x80) || (d[0] == 0xff && d[1] == 0x02);
	__u8 nh = ip->nexthdr;
	__u32 off = ETH_HLEN + sizeof(*ip);
	if (nh == NEXTHDR_HOP) {
		__u8 h[2];
		if (bpf_skb_load_bytes(skb, off, h, 2))
			return shot(uid, K_MALFORMED);
		nh = h[0];
		off += ((__u32)h[1] + 1) * 8;
	}
	if (nh != NEXTHDR_ICMP)
		return shot(uid, K_LINK_LOCAL);
	__u8 type;
	if (bpf_skb_load_bytes(skb, off, &type, 1))
		return shot(uid, K_MALFORMED);
	if (type == 134 || type == 137)
		return shot(uid, K_SERVER_MESSAGE);
	int nd = type == 130 || type == 131 || type == 132 || type == 143 || type == 133 ||
		 type == 135 || type == 136;
	if (!nd || !to_namespace)
		return shot(uid, K_LINK_LOCAL);
	return pass(skb);
}

static __always_inline int check_ip6(struct __sk_buff *skb, const struct guard_vm *vm)
{
	__u32 uid = vm->uid;
	struct ip6 ip;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return shot(uid, K_MALFORMED);
	if ((bpf_ntohl(ip.vtcfl) >> 28) != 6)
		return shot(uid, K_MALFORMED);
	if ((vm->flags & F_MESH) && addr_eq(ip.saddr, vm->mesh))
		return server_message6(skb, uid, &ip);
	if (link_local_or_unspecified(ip.saddr))
		return neighbour_discovery(skb, uid, &ip);
	if (in_mesh(ip.saddr))
		return shot(uid, K_MESH_SOURCE);
	if (in_block(vm, ip.saddr))
		return server_message6(skb, uid, &ip);
	// A gateway VM forwards replies from outside the mesh to the mesh VMs behind it.
	if ((vm->flags & F_GATEWAY) && in_mesh(ip.daddr) && ip.saddr[0] != 0xff)
		return server_message6(skb, uid, &ip);
	return shot(uid, K_IPV6_SOURCE);
}

SEC("classifier")
int guest_guard(struct __sk_buff *skb)
{
	__u32 inum = netns_inode(skb);
	struct guard_vm *vm = bpf_map_lookup_elem(&guard_vms, &inum);
	if (!vm) {
		__u32 zero = 0;
		__u64 *n = bpf_map_lookup_elem(&guard_unknown, &zero);
		if (n)
			*n += 1;
		return TC_ACT_SHOT;
	}
	__u32 uid = vm->uid;
	struct ethhdr eth;
	if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)))
		return shot(uid, K_MALFORMED);
	if (!mac_eq(eth.h_source, GUEST_MAC))
		return shot(uid, K_MAC);
	// The kernel takes an outer VLAN tag off the frame before this hook (into the socket
	// buffer's metadata): a tagged frame shows here as its inner EtherType.
	if (skb->vlan_present)
		return shot(uid, K_ETHERTYPE);
	switch (bpf_ntohs(eth.h_proto)) {
	case ETH_P_ARP:
		return check_arp(skb, uid);
	case ETH_P_IP:
		return check_ip4(skb, uid);
	case ETH_P_IPV6:
		return check_ip6(skb, vm);
	default:
		return shot(uid, K_ETHERTYPE);
	}
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
