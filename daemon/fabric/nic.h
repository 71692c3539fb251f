/*
 * The node's RDMA NICs as sysfs shows them, and which one serves each GPU (daemon/fabric/nic.c).
 * Nothing here calls verbs: the names, PCI addresses, NUMA nodes and port states come from
 * /sys/class/infiniband, so gpxctl topo shows them even where gpxd runs over tcp, and the
 * choice is made (and tested) without a device.
 */
#ifndef GPXD_NIC_H
#define GPXD_NIC_H

#include <limits.h>
#include <stdbool.h>

#include "proto/gpx.pb-c.h"

#define NIC_MAX 64
#define NIC_GPUS 16                  /* [fabric] nic_for_gpu0 .. nic_for_gpu15 */

struct nic {
	char name[64];
	char pci[32];                /* "0000:3b:00.0"; "" for a device without one (rxe, siw) */
	char path[PATH_MAX];         /* its device, resolved, below the sysfs root; "" when none */
	int numa;                    /* -1: unknown */
	char state[32];              /* the best port's state: "ACTIVE", "DOWN", ... */
	char link_layer[32];         /* ... and its link layer: "InfiniBand", "Ethernet" */
	int ports;
	bool active;                 /* some port is ACTIVE */
};

enum nic_why { NIC_NONE, NIC_ONLY, NIC_NEAREST, NIC_CONFIGURED };

/* "/sys" unless a test points it at a fake tree. */
extern const char *nic_sysfs_root;

/* The NICs under <root>/class/infiniband, sorted by name; how many (at most max). */
int nic_scan(struct nic *, int max);
/* A PCI address in any case or domain width ("00000000:3B:00.0") as sysfs spells it. */
bool nic_pci_norm(const char *in, char *out, size_t outlen);
/* The depth of the deepest common ancestor of two device paths below the sysfs root. */
int nic_common_depth(const char *a, const char *b);
/*
 * The NIC for the GPU at PCI address gpu_pci: the one named by `configured` (may be NULL)
 * if present; else the only one; else the nearest by PCI (deepest common ancestor), NICs
 * with an active port before others, ties broken by the GPU's NUMA node, then by name.
 * Its index in nics, or -1 with NIC_NONE.
 */
int nic_for_gpu(const struct nic *, int n, const char *gpu_pci, const char *configured, enum nic_why *);
const char *nic_why_str(enum nic_why);

/* The NIC gpxd uses for GPU dev (rdma_device for host memory is the caller's business). */
bool nic_for_dev(int dev, char *name, size_t namelen, enum nic_why *);

#endif
