// SPDX-License-Identifier: (MIT OR GPL-2.0)
//
// vmnet packet activity: a BTF tracepoint program on `net_dev_queue`, the kernel's tracepoint
// for every frame handed to a device's transmit queue. Of those frames it looks only at the ones
// queued on a namespace-mode VM's tap (every frame the guest is about to receive, after the
// VM's firewall) and records per VM user id when the last TCP segment from the host side
// arrived. Nothing else counts: ARP, NDP and all other ICMPv6, ICMP, UDP, frames that are not
// IPv4/IPv6, packets the VM namespace sends itself (the metadata service at 169.254.169.254
// among them), and TCP whose source is link-local (169.254.0.0/16, fe80::/10). What the guest
// sends is queued on the veth end, never on the tap, and is not looked at.
//
// One program for the whole host, attached once: a VM is a map entry, not a kernel object of
// its own (a tc filter per tap would give every VM a tc block, and the kernel searches a list of
// all tc blocks each time one is bound).
//
// Map `activity_vm`, which the agent fills, has one entry per VM, keyed by the inode number of
// the VM's network namespace: the VM's user id, the ifindex of its veth end and that of its tap
// (in that namespace). A frame counts when it is queued on a device of a registered namespace
// whose ifindex is the VM's tap, and it came "from the host side": it entered the namespace
// through the VM's veth end (its ingress ifindex, `skb_iif`). A packet the namespace made
// itself has no ingress device. Several agents on one kernel (sandboxes) each find only their
// own namespaces. The time is CLOCK_BOOTTIME in ns (bpf_ktime_get_boot_ns), in array
// `activity_last` indexed by user id (0 = never). Both maps are pinned by name so that they
// outlive the agent and the program.
//
// The program only reads (the frame through bpf_probe_read_kernel, within the skb's linear
// part): it never changes, drops or delays a frame. A tracing program's return value is
// ignored.
//
// Wake on packet: a frame from the host side queued on a VM's tap while the tap's transmit
// queue is deactivated (no VMM holds the tap: the kernel dropped the carrier and put the
// built-in `noop` qdisc in place of the real one, so the kernel is about to drop the frame) is
// copied whole, with a small header (`struct held`), into the perf event array `wake_frames`
// (bpf_skb_output: the frame's paged part too). The agent keeps the copy and sends it to the
// tap when the VMM attaches. Only while `wake_cfg[0].enabled` is set (the agent's setting);
// frames longer than `wake_cfg[0].max_frame` are reported with no bytes (counted, not held).
// The frame itself is untouched: the kernel drops it as it would without the program.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_tracing.h>

#define LIBBPF_PIN_BY_NAME 1

// A stored time is rewritten only when it is this much older (ns): on a busy flow most
// packets then only read the shared cache line.
#define GRANULARITY_NS 1000000ULL

// The IPv6 extension headers walked before giving up (a packet with more is not counted).
#define MAX_EXT_HEADERS 6

// The fields read from the kernel's own structures, relocated by name against the running
// kernel's BTF when the program is loaded (CO-RE).
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
	int ifindex;
	possible_net_t nd_net;
	struct netdev_queue *_tx;
} __attribute__((preserve_access_index));

struct Qdisc {
	int (*enqueue)(void);
	unsigned int flags;
} __attribute__((preserve_access_index));

struct netdev_queue {
	struct Qdisc *qdisc;
} __attribute__((preserve_access_index));

struct sk_buff {
	struct net_device *dev;
	int skb_iif;
	unsigned int len;
	unsigned int data_len;
	unsigned char *data;
} __attribute__((preserve_access_index));

// A VM as the program knows it: its user id and the ifindexes of its veth end and its tap (in
// the VM namespace).
struct vm {
	__u32 uid;
	__u32 veth;
	__u32 tap;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct vm);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} activity_vm SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} activity_last SEC(".maps");

// The agent's wake settings (one entry, written at load).
struct wake_cfg {
	__u32 enabled;
	__u32 max_frame;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct wake_cfg);
} wake_cfg SEC(".maps");

// Held frames for the agent, one perf buffer per CPU (max_entries 0: one per CPU).
struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
} wake_frames SEC(".maps");

// What precedes a held frame's bytes in its perf sample.
struct held {
	__u32 uid;
	// The frame's length, and how many of its bytes follow (0: too long to hold).
	__u32 len;
	__u32 caplen;
	// 1 when the frame counts as activity (TCP from the host side).
	__u32 tcp;
};

// TCQ_F_BUILTIN: the kernel's own `noop` and `noqueue` qdiscs; of the two only `noop`
// enqueues (and drops): a device's queue holds it while the device is deactivated.
#define TCQ_F_BUILTIN 1

// Whether `dev`'s first transmit queue is deactivated (no carrier): the frame is dropped.
static __always_inline int deactivated(struct net_device *dev)
{
	struct netdev_queue *txq = dev->_tx;
	if (!txq)
		return 0;
	struct Qdisc *q = txq->qdisc;
	if (!q)
		return 0;
	return (q->flags & TCQ_F_BUILTIN) && q->enqueue;
}

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

// The frame: where it starts and how many bytes of it are in the linear part.
struct frame {
	const unsigned char *data;
	__u32 headlen;
};

// Copies `size` bytes at `off` of the frame into `dst`; non-zero when they are not all in the
// linear part (or cannot be read).
static __always_inline int load(const struct frame *f, __u32 off, void *dst, __u32 size)
{
	if (off > f->headlen || size > f->headlen - off)
		return -1;
	return bpf_probe_read_kernel(dst, size, f->data + off);
}

static __always_inline int tcp4(const struct frame *f)
{
	struct ip4 ip;
	if (load(f, ETH_HLEN, &ip, sizeof(ip)))
		return 0;
	if ((ip.vihl >> 4) != 4 || ip.proto != IPPROTO_TCP)
		return 0;
	// 169.254.0.0/16: the namespace's own link-local services (metadata).
	return (bpf_ntohl(ip.saddr) >> 16) != ((169 << 8) | 254);
}

static __always_inline int tcp6(const struct frame *f)
{
	struct ip6 ip;
	if (load(f, ETH_HLEN, &ip, sizeof(ip)))
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
			if (load(f, off, h, 2))
				return 0;
			nh = h[0];
			off += ((__u32)h[1] + 1) * 8;
		} else if (nh == NEXTHDR_AUTH) {
			if (load(f, off, h, 2))
				return 0;
			nh = h[0];
			off += ((__u32)h[1] + 2) * 4;
		} else if (nh == NEXTHDR_FRAGMENT) {
			if (load(f, off, h, 4))
				return 0;
			nh = h[0];
			off += 8;
		} else {
			return 0;
		}
	}
	return nh == IPPROTO_TCP;
}

SEC("tp_btf/net_dev_queue")
int BPF_PROG(activity_xmit, struct sk_buff *skb)
{
	// Most frames on the host are not a VM's: a few reads and one lookup, then out.
	__u32 iif = skb->skb_iif;
	if (!iif)
		return 0;
	struct net_device *dev = skb->dev;
	if (!dev)
		return 0;
	__u32 ns = dev->nd_net.net->ns.inum;
	struct vm *vm = bpf_map_lookup_elem(&activity_vm, &ns);
	if (!vm || vm->veth != iif || vm->tap != (__u32)dev->ifindex)
		return 0;
	struct frame f = {
		.data = skb->data,
		.headlen = skb->len - skb->data_len,
	};
	__be16 proto;
	if (load(&f, 12, &proto, sizeof(proto)))
		return 0;
	int tcp = 0;
	if (proto == bpf_htons(ETH_P_IP))
		tcp = tcp4(&f);
	else if (proto == bpf_htons(ETH_P_IPV6))
		tcp = tcp6(&f);
	__u32 zero = 0;
	struct wake_cfg *cfg = bpf_map_lookup_elem(&wake_cfg, &zero);
	if (cfg && cfg->enabled && deactivated(dev)) {
		struct held h = {
			.uid = vm->uid,
			.len = skb->len,
			.caplen = skb->len <= cfg->max_frame ? skb->len : 0,
			.tcp = tcp,
		};
		bpf_skb_output(skb, &wake_frames, BPF_F_CURRENT_CPU | ((__u64)h.caplen << 32), &h,
			       sizeof(h));
	}
	if (!tcp)
		return 0;
	__u32 key = vm->uid;
	__u64 *last = bpf_map_lookup_elem(&activity_last, &key);
	if (!last)
		return 0;
	__u64 now = bpf_ktime_get_boot_ns();
	if (now - *last >= GRANULARITY_NS)
		*last = now;
	return 0;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
