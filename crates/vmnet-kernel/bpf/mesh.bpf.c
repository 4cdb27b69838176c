// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// vmnet mesh data plane: VM-to-VM traffic between hosts over the WireGuard interface.
//
// mesh_from_vm (tc ingress of a VM's host veth end = every packet the VM sends)
//   For an IPv6 destination in the mesh range fdaa::/16: look the destination up in `dests`
//   (unknown: drop), check the tenants of both VMs (and the tenant-0 whitelist; not for a
//   packet from an address of the sending VM's own public block: public traffic), then
//   - same host: pass (the host's routes deliver it);
//   - another host: push an outer IPv6 header (this host's mesh address -> the destination
//     host's mesh address, next header 41, flow label = the destination VM's user id) and pass:
//     the kernel routes the outer packet through the peer's /128 route into wg0.
//   A packet bigger than the VM MTU is passed unencapsulated: the mesh range route (MTU locked
//   at the VM MTU) makes the kernel answer with an ICMPv6 Packet Too Big.
//   Any other IPv6 destination from a registered VM:
//   - inside a VM's public IPv6 block (`blocks`, longest prefix): that VM is its owner. On
//     another host the packet is carried there as above (the flow label names the owner); a
//     block is public, so no tenant check. On this host: pass (the block's host route).
//   - else the host's own routing decides (`bpf_fib_lookup` as the packet would be forwarded:
//     the VM's policy rule and table first): a route via a gateway VM's mesh address (`2000::/3
//     via fdaa:1::56`) whose VM lives on another host is carried to that host, the flow label
//     naming the gateway VM, after the same tenant check as mesh traffic; a gateway that is
//     not registered: drop. Everything else (the uplink, a gateway on this host) passes.
//   Too big for the tunnel: dropped and counted (the VM MTU keeps this from happening).
//   Sources: a VM's packets carry its own mesh address; a source inside fdaa::/16 other than
//   that is dropped on every path (counted in `mesh_spoofs`). To a mesh address a VM may also
//   send from an address of its own public block, and a gateway VM (`mesh_gateway_vms`) from
//   any address outside fdaa::/16 (the replies from the internet it forwards); any other
//   source to a mesh address is dropped. The guest guard on the VM's tap drops these first;
//   this check holds when that filter is gone.
// mesh_from_wg (tc ingress of wg0 = every packet WireGuard decrypted)
//   An IPv6-in-IPv6 packet for this host's mesh address: find the local VM by the flow label,
//   check that the inner source is registered on the outer source host (its mesh address, or an
//   address of its public block) and the tenants match (not for public traffic: to an address
//   of the VM's own public block, or from one of the sender's), strip the outer header and redirect the packet to
//   the VM's host veth end (the neighbour table fills in the Ethernet header). An inner source
//   that is neither is what a gateway VM forwards (an internet host's reply): accepted only when
//   the outer source host has a registered gateway VM of the destination VM's tenant
//   (`gateways`).
//
// Pass is TC_ACT_UNSPEC (let later filters run), drop is TC_ACT_SHOT. Drops are counted per
// reason in `drops` and forwarding decisions in `passes` (mirrored in src/mesh/maps.rs).
// Every map is pinned by name, so a new agent reuses them and the kernel keeps forwarding while
// no agent runs.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET6
#define AF_INET6 10
#endif

#ifndef OUTER_HOP_LIMIT // a build may set another (the upgrade test builds one with 63)
#define OUTER_HOP_LIMIT 64
#endif
#define FLOW_LABEL_MASK 0xfffff

// Whether mesh_from_vm checks sources (above). Read-only data fixed at load time, so the
// verifier removes the check when it is 0; vmnet always loads it with 1. Only the cost bench
// loads a copy with 0, to measure the check's cost beside the program with it.
const volatile __u32 check_sources = 1;
// bpf_fib_lookup flag of kernel 6.3 (the build's uapi headers may be older).
#define FIB_LOOKUP_SKIP_NEIGH (1U << 2)

enum drop_reason {
	D_TENANT = 0,
	D_UNKNOWN_DESTINATION,
	D_MTU,
	D_UNKNOWN_SOURCE,
	D_MALFORMED,
	D_COUNT,
};

enum pass_kind {
	P_LOCAL = 0,
	P_ENCAP,
	P_DECAP,
	P_COUNT,
};

struct addr6 {
	__u8 a[16];
};

// config[0]: this host.
struct mesh_config {
	struct addr6 host; // this host's mesh address
	__u32 vm_mtu;      // the largest inner packet (IPv6 header included) carried
	__u32 pad;
};

// dests: mesh address -> where the VM lives (this host's VMs too).
struct dest {
	struct addr6 host; // the mesh address of the VM's host
	__u32 user_id;     // the VM's user id on that host (carried in the flow label)
	__u32 tenant;
};

// local_vms: user id -> a VM of this host.
struct local_vm {
	__u32 ifindex;    // its host veth end
	__u32 tenant;
	struct addr6 mesh; // its mesh address
	struct addr6 via;  // the next hop on the veth (link-local)
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mesh_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct addr6);
	__type(value, struct dest);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_dests SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct local_vm);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_local_vms SEC(".maps");

// mesh_veths: host veth ifindex -> user id of the VM behind it.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_veths SEC(".maps");

// mesh_via_vms: user ids of the local VMs with a route via a mesh address (a gateway VM). Only
// their packets to outside the mesh ask the host's routing (bpf_fib_lookup) for a gateway; every
// other VM's internet traffic is left to the host's routes without that cost.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_via_vms SEC(".maps");

// mesh_whitelist: the prefixes (`POST /v1/sync`'s whitelist) whose tenant-0 VMs cross tenants.
struct lpm6 {
	__u32 prefixlen;
	struct addr6 addr;
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm6);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_whitelist SEC(".maps");

// mesh_gateways: (host, tenant) present when that host runs a gateway VM of that tenant.
struct gw_key {
	struct addr6 host;
	__u32 tenant;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct gw_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_gateways SEC(".maps");

// mesh_gateway_vms: user ids of the local gateway VMs (those routing ::/0 via the host): their
// packets to a mesh address may carry a source outside fdaa::/16.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_gateway_vms SEC(".maps");

// mesh_spoofs[0]: packets from a VM with a source it may not use (a map of its own, so that
// maps pinned by an earlier version keep their layout).
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_spoofs SEC(".maps");

// mesh_blocks: public IPv6 block -> the VM that owns it (longest prefix).
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct lpm6);
	__type(value, struct dest);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_blocks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, D_COUNT);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, P_COUNT);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} mesh_passes SEC(".maps");

static __always_inline void count(void *map, __u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(map, &idx);
	if (c)
		*c += 1;
}

static __always_inline int drop(__u32 reason)
{
	count(&mesh_drops, reason);
	return TC_ACT_SHOT;
}

static __always_inline int addr_eq(const struct addr6 *x, const struct addr6 *y)
{
	const __u64 *a = (const __u64 *)x->a, *b = (const __u64 *)y->a;
	return a[0] == b[0] && a[1] == b[1];
}

static __always_inline int spoofed(void)
{
	__u32 zero = 0;
	count(&mesh_spoofs, zero);
	return TC_ACT_SHOT;
}

static __always_inline int whitelisted(__u32 tenant, const struct addr6 *addr)
{
	if (tenant != 0)
		return 0;
	struct lpm6 key = {.prefixlen = 128};
	__builtin_memcpy(&key.addr, addr, sizeof(key.addr));
	return bpf_map_lookup_elem(&mesh_whitelist, &key) != NULL;
}

// Same tenant, or a whitelisted tenant-0 VM on either end.
static __always_inline int tenants_ok(__u32 src_tenant, const struct addr6 *src,
				      __u32 dst_tenant, const struct addr6 *dst)
{
	return src_tenant == dst_tenant || whitelisted(src_tenant, src) ||
	       whitelisted(dst_tenant, dst);
}

static __always_inline int in_mesh(const struct addr6 *a)
{
	return a->a[0] == 0xfd && a->a[1] == 0xaa;
}

// The VM owning the public block that holds `addr`, or NULL.
static __always_inline struct dest *block_owner(const struct addr6 *addr)
{
	struct lpm6 key = {.prefixlen = 128};
	__builtin_memcpy(&key.addr, addr, sizeof(key.addr));
	return bpf_map_lookup_elem(&mesh_blocks, &key);
}

// The length of the largest packet `skb` becomes on the wire (one segment of a GSO packet),
// IPv6 header included; `ip` starts at offset `l3`.
static __always_inline __u32 wire_len(struct __sk_buff *skb, struct ipv6hdr *ip, void *end,
				      __u32 l3)
{
	if (!skb->gso_size)
		return skb->len - l3;
	__u32 l4 = sizeof(struct tcphdr);
	if (ip->nexthdr == IPPROTO_TCP) {
		struct tcphdr *tcp = (void *)(ip + 1);
		if ((void *)(tcp + 1) <= end)
			l4 = tcp->doff * 4;
	} else if (ip->nexthdr == IPPROTO_UDP) {
		l4 = 8;
	}
	return sizeof(*ip) + l4 + skb->gso_size;
}

// Pushes the outer IPv6 header towards `d`'s host (flow label: `d`'s user id) and passes.
static __always_inline int encapsulate(struct __sk_buff *skb, struct ipv6hdr *ip,
				       const struct mesh_config *cfg, const struct dest *d)
{
	struct ipv6hdr outer = {};
	__u32 label = d->user_id & FLOW_LABEL_MASK;
	outer.version = 6;
	outer.priority = ip->priority;
	outer.flow_lbl[0] = (ip->flow_lbl[0] & 0xf0) | (label >> 16);
	outer.flow_lbl[1] = (label >> 8) & 0xff;
	outer.flow_lbl[2] = label & 0xff;
	outer.payload_len = bpf_htons((__u16)(skb->len - sizeof(struct ethhdr)));
	outer.nexthdr = IPPROTO_IPV6;
	outer.hop_limit = OUTER_HOP_LIMIT;
	__builtin_memcpy(&outer.saddr, &cfg->host, sizeof(outer.saddr));
	__builtin_memcpy(&outer.daddr, &d->host, sizeof(outer.daddr));

	if (bpf_skb_adjust_room(skb, sizeof(outer), BPF_ADJ_ROOM_MAC,
				BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 | BPF_F_ADJ_ROOM_FIXED_GSO))
		return drop(D_MALFORMED);
	if (bpf_skb_store_bytes(skb, sizeof(struct ethhdr), &outer, sizeof(outer), 0))
		return drop(D_MALFORMED);
	count(&mesh_passes, P_ENCAP);
	return TC_ACT_UNSPEC;
}

// A packet from a local VM to a destination outside the mesh range: a public block of a VM on
// another host, or a route via a gateway VM on another host, is carried there; the rest passes.
static __always_inline int from_vm_outside_mesh(struct __sk_buff *skb, struct ipv6hdr *ip,
						void *end, const struct addr6 *daddr)
{
	__u32 ifindex = skb->ifindex;
	__u32 *uid = bpf_map_lookup_elem(&mesh_veths, &ifindex);
	if (!uid)
		return TC_ACT_UNSPEC; // not a registered VM: the host's routes decide
	struct local_vm *src = bpf_map_lookup_elem(&mesh_local_vms, uid);
	if (!src)
		return TC_ACT_UNSPEC;
	// No other VM's mesh address leaves through the host either.
	if (check_sources && ip->saddr.in6_u.u6_addr8[0] == 0xfd && ip->saddr.in6_u.u6_addr8[1] == 0xaa) {
		struct addr6 saddr;
		__builtin_memcpy(&saddr, &ip->saddr, sizeof(saddr));
		if (!addr_eq(&saddr, &src->mesh))
			return spoofed();
	}
	__u32 zero = 0;
	struct mesh_config *cfg = bpf_map_lookup_elem(&mesh_config, &zero);
	if (!cfg || cfg->vm_mtu == 0)
		return TC_ACT_UNSPEC;
	struct dest *d = block_owner(daddr);
	if (!d) {
		if (!bpf_map_lookup_elem(&mesh_via_vms, uid))
			return TC_ACT_UNSPEC; // no route via a gateway VM: the host's routes decide
		struct bpf_fib_lookup fib = {};
		fib.family = AF_INET6;
		fib.ifindex = ifindex;
		fib.l4_protocol = ip->nexthdr;
		__builtin_memcpy(fib.ipv6_src, &ip->saddr, sizeof(fib.ipv6_src));
		__builtin_memcpy(fib.ipv6_dst, daddr, sizeof(fib.ipv6_dst));
		long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), FIB_LOOKUP_SKIP_NEIGH);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_FRAG_NEEDED)
			return TC_ACT_UNSPEC;
		struct addr6 gw;
		__builtin_memcpy(&gw, fib.ipv6_dst, sizeof(gw));
		if (!in_mesh(&gw))
			return TC_ACT_UNSPEC; // the uplink, or a gateway VM on this host
		d = bpf_map_lookup_elem(&mesh_dests, &gw);
		if (!d)
			return drop(D_UNKNOWN_DESTINATION);
		if (!tenants_ok(src->tenant, &src->mesh, d->tenant, &gw))
			return drop(D_TENANT);
	}
	if (addr_eq(&d->host, &cfg->host)) {
		count(&mesh_passes, P_LOCAL);
		return TC_ACT_UNSPEC;
	}
	if (wire_len(skb, ip, end, sizeof(struct ethhdr)) > cfg->vm_mtu)
		return drop(D_MTU);
	return encapsulate(skb, ip, cfg, d);
}

SEC("classifier")
int mesh_from_vm(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IPV6))
		return TC_ACT_UNSPEC;
	struct ipv6hdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return TC_ACT_UNSPEC;
	struct addr6 daddr;
	__builtin_memcpy(&daddr, &ip->daddr, sizeof(daddr));
	if (!in_mesh(&daddr))
		return from_vm_outside_mesh(skb, ip, end, &daddr);

	__u32 ifindex = skb->ifindex;
	__u32 *uid = bpf_map_lookup_elem(&mesh_veths, &ifindex);
	if (!uid)
		return drop(D_UNKNOWN_SOURCE);
	struct local_vm *src = bpf_map_lookup_elem(&mesh_local_vms, uid);
	if (!src)
		return drop(D_UNKNOWN_SOURCE);
	// The source: the VM's own mesh address, else an address of its own public block
	// (public traffic, a block answers anyone: no tenant check) or, for a gateway VM, any
	// address outside the mesh (a reply from the internet it forwards).
	struct addr6 saddr;
	__builtin_memcpy(&saddr, &ip->saddr, sizeof(saddr));
	int from_block = 0;
	if (!check_sources) {
		// Unchecked: only whether the source is an address of the VM's own block matters.
		struct dest *own = in_mesh(&saddr) ? NULL : block_owner(&saddr);
		from_block = own && own->user_id == *uid;
	} else if (!addr_eq(&saddr, &src->mesh)) {
		if (in_mesh(&saddr))
			return spoofed();
		struct dest *own = block_owner(&saddr);
		from_block = own && own->user_id == *uid;
		if (!from_block && !bpf_map_lookup_elem(&mesh_gateway_vms, uid))
			return spoofed();
	}
	struct dest *d = bpf_map_lookup_elem(&mesh_dests, &daddr);
	if (!d)
		return drop(D_UNKNOWN_DESTINATION);
	if (!from_block && !tenants_ok(src->tenant, &src->mesh, d->tenant, &daddr))
		return drop(D_TENANT);
	__u32 zero = 0;
	struct mesh_config *cfg = bpf_map_lookup_elem(&mesh_config, &zero);
	if (!cfg || cfg->vm_mtu == 0)
		return drop(D_UNKNOWN_DESTINATION);
	if (addr_eq(&d->host, &cfg->host)) {
		count(&mesh_passes, P_LOCAL);
		return TC_ACT_UNSPEC;
	}
	if (wire_len(skb, ip, end, sizeof(*eth)) > cfg->vm_mtu) {
		// Unencapsulated, the packet meets the mesh range route's locked MTU: the kernel
		// sends the VM a Packet Too Big and drops it.
		count(&mesh_drops, D_MTU);
		return TC_ACT_UNSPEC;
	}
	return encapsulate(skb, ip, cfg, d);
}

SEC("classifier")
int mesh_from_wg(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (skb->protocol != bpf_htons(ETH_P_IPV6))
		return TC_ACT_UNSPEC;
	struct ipv6hdr *outer = data;
	if ((void *)(outer + 1) > end || outer->nexthdr != IPPROTO_IPV6)
		return TC_ACT_UNSPEC;
	__u32 zero = 0;
	struct mesh_config *cfg = bpf_map_lookup_elem(&mesh_config, &zero);
	if (!cfg)
		return TC_ACT_UNSPEC;
	struct addr6 odst, osrc, isrc;
	__builtin_memcpy(&odst, &outer->daddr, sizeof(odst));
	if (!addr_eq(&odst, &cfg->host))
		return TC_ACT_UNSPEC; // not mesh encapsulation for this host
	struct ipv6hdr *inner = (void *)(outer + 1);
	if ((void *)(inner + 1) > end)
		return drop(D_MALFORMED);
	__builtin_memcpy(&osrc, &outer->saddr, sizeof(osrc));
	__builtin_memcpy(&isrc, &inner->saddr, sizeof(isrc));
	__u32 uid = ((__u32)(outer->flow_lbl[0] & 0x0f) << 16) |
		    ((__u32)outer->flow_lbl[1] << 8) | outer->flow_lbl[2];

	struct local_vm *dst = bpf_map_lookup_elem(&mesh_local_vms, &uid);
	if (!dst)
		return drop(D_UNKNOWN_DESTINATION);
	// The inner source: a VM's mesh address, or an address of its public block, registered on
	// the host that sent the packet.
	struct dest *s = bpf_map_lookup_elem(&mesh_dests, &isrc);
	int from_block = 0;
	if (!s && !in_mesh(&isrc)) {
		s = block_owner(&isrc);
		from_block = s != NULL;
	}
	// An address of the destination VM's own public block is public: no tenant check.
	struct addr6 idst;
	__builtin_memcpy(&idst, &inner->daddr, sizeof(idst));
	struct dest *b = in_mesh(&idst) ? NULL : block_owner(&idst);
	int public_block = b && b->user_id == uid && addr_eq(&b->host, &cfg->host);
	if (s) {
		if (!addr_eq(&s->host, &osrc))
			return drop(D_UNKNOWN_SOURCE);
		if (!public_block && !from_block &&
		    !tenants_ok(s->tenant, &isrc, dst->tenant, &dst->mesh))
			return drop(D_TENANT);
	} else {
		// Forwarded by a gateway VM: its host must run one of the destination's tenant.
		if (in_mesh(&isrc))
			return drop(D_UNKNOWN_SOURCE);
		struct gw_key gk = {.tenant = dst->tenant};
		__builtin_memcpy(&gk.host, &osrc, sizeof(gk.host));
		if (!public_block && !bpf_map_lookup_elem(&mesh_gateways, &gk))
			return drop(D_UNKNOWN_SOURCE);
	}
	__u32 ifindex = dst->ifindex;
	struct bpf_redir_neigh nh = {.nh_family = AF_INET6};
	__builtin_memcpy(nh.ipv6_nh, &dst->via, sizeof(nh.ipv6_nh));

	if (bpf_skb_adjust_room(skb, -(__s32)sizeof(*outer), BPF_ADJ_ROOM_MAC, 0))
		return drop(D_MALFORMED);
	// wg0 has no link layer: give the packet an (empty) Ethernet header, which the neighbour
	// redirect replaces with the veth's.
	if (bpf_skb_change_head(skb, sizeof(struct ethhdr), 0))
		return drop(D_MALFORMED);
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return drop(D_MALFORMED);
	eth->h_proto = bpf_htons(ETH_P_IPV6);
	count(&mesh_passes, P_DECAP);
	return bpf_redirect_neigh(ifindex, &nh, sizeof(nh), 0);
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
