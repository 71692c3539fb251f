/*
 * The node's RDMA NICs read from sysfs, and the choice of a NIC for each GPU.  No verbs call
 * here: /sys/class/infiniband/<dev>/device resolves to the NIC's PCI device (absent for
 * software devices such as rxe, shown as "virtual"), its numa_node sits beside it, and the
 * ports' state and link_layer under /sys/class/infiniband/<dev>/ports/N/.  A GPU's device is
 * /sys/bus/pci/devices/<its bus id>.
 *
 * The NIC of a GPU is the one [fabric] nic_for_gpuN names, else the only NIC, else the nearest
 * by PCI: the one whose resolved device path shares the deepest ancestor with the GPU's (the
 * same switch beats the same root port beats the same root complex), NICs with an active port
 * before the others, ties broken by the GPU's NUMA node and then by name.  rdma-dev.c asks
 * nic_for_dev when the local side of a transfer is GPU memory; host memory keeps rdma_device.
 *
 * The sysfs root is nic_sysfs_root so that tests/unit.c can point it at a fake tree.
 */
#include "config.h"

#include <ctype.h>
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/gpxd.h"
#include "daemon/fabric/fabric.h"
#include "daemon/gpu/gpu.h"
#include "daemon/fabric/nic.h"

const char *nic_sysfs_root = "/sys";

/* snprintf that says whether it all fit (sysfs names are short; a longer one is skipped). */
static bool fmt(char *out, size_t len, const char *f, ...) __attribute__((format(printf, 3, 4)));

static bool
fmt(char *out, size_t len, const char *f, ...)
{
	va_list ap;
	int n;

	va_start(ap, f);
	n = vsnprintf(out, len, f, ap);
	va_end(ap);
	return n >= 0 && (size_t)n < len;
}

/* The first line of a small file, without its newline; false if it cannot be read. */
static bool
read_line(const char *path, char *out, size_t outlen)
{
	FILE *f = fopen(path, "re");
	bool ok;

	if (f == NULL)
		return false;
	ok = fgets(out, (int)outlen, f) != NULL;
	fclose(f);
	if (ok)
		out[strcspn(out, "\n")] = '\0';
	return ok;
}

bool
nic_pci_norm(const char *in, char *out, size_t outlen)
{
	unsigned dom, bus, dev, fn;
	char tail;

	if (in == NULL || sscanf(in, "%x:%x:%x.%1u%c", &dom, &bus, &dev, &fn, &tail) != 4 ||
	    dom > 0xffff || bus > 0xff || dev > 0x1f || fn > 7)
		return false;
	fmt(out, outlen, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
	return true;
}

/* The NUMA node of a resolved device path, or -1. */
static int
numa_of(const char *path)
{
	char f[PATH_MAX + 16], v[32];

	if (path[0] == '\0')
		return -1;
	fmt(f, sizeof(f), "%s/numa_node", path);
	return read_line(f, v, sizeof(v)) ? atoi(v) : -1;
}

/* Ports: the state of the first active one, else of the first one. */
static void
read_ports(const char *devdir, struct nic *n)
{
	char d[PATH_MAX], f[PATH_MAX + 80], v[64];
	struct dirent **l = NULL;
	int cnt;

	fmt(d, sizeof(d), "%s/ports", devdir);
	fmt(n->state, sizeof(n->state), "none");
	if ((cnt = scandir(d, &l, NULL, versionsort)) < 0)
		return;
	for (int i = 0; i < cnt; i++) {
		char *st, *ll = NULL;
		if (l[i]->d_name[0] == '.')
			continue;
		fmt(f, sizeof(f), "%s/%s/state", d, l[i]->d_name);
		if (!read_line(f, v, sizeof(v)))
			continue;
		n->ports++;
		st = strchr(v, ':') != NULL ? strchr(v, ':') + 1 : v;   /* "4: ACTIVE" */
		while (*st == ' ')
			st++;
		bool act = strcmp(st, "ACTIVE") == 0;
		if (n->ports > 1 && (n->active || !act))
			continue;
		fmt(n->state, sizeof(n->state), "%s", st);
		n->active = act;
		fmt(f, sizeof(f), "%s/%s/link_layer", d, l[i]->d_name);
		if (read_line(f, v, sizeof(v)))
			ll = v;
		fmt(n->link_layer, sizeof(n->link_layer), "%s", ll ? ll : "");
	}
	for (int i = 0; i < cnt; i++)
		free(l[i]);
	free(l);
}

int
nic_scan(struct nic *out, int max)
{
	char cls[PATH_MAX], p[PATH_MAX + 80], *res;
	struct dirent **l = NULL;
	int cnt, n = 0;

	fmt(cls, sizeof(cls), "%s/class/infiniband", nic_sysfs_root);
	if ((cnt = scandir(cls, &l, NULL, alphasort)) < 0)
		return 0;
	for (int i = 0; i < cnt; i++) {
		struct nic *x = &out[n];
		if (l[i]->d_name[0] == '.' || n >= max)
			continue;
		memset(x, 0, sizeof(*x));
		fmt(x->name, sizeof(x->name), "%s", l[i]->d_name);
		fmt(p, sizeof(p), "%s/%s/device", cls, l[i]->d_name);
		if ((res = realpath(p, NULL)) != NULL) {
			const char *b = strrchr(res, '/');
			fmt(x->path, sizeof(x->path), "%s", res);
			if (!nic_pci_norm(b != NULL ? b + 1 : res, x->pci, sizeof(x->pci)))
				x->pci[0] = '\0';
			free(res);
		}
		x->numa = numa_of(x->path);
		fmt(p, sizeof(p), "%s/%s", cls, l[i]->d_name);
		read_ports(p, x);
		n++;
	}
	for (int i = 0; i < cnt; i++)
		free(l[i]);
	free(l);
	return n;
}

int
nic_common_depth(const char *a, const char *b)
{
	int depth = 0;

	if (a == NULL || b == NULL || a[0] == '\0' || b[0] == '\0')
		return -1;
	for (;;) {
		while (*a == '/')
			a++;
		while (*b == '/')
			b++;
		size_t la = strcspn(a, "/"), lb = strcspn(b, "/");
		if (la == 0 || la != lb || strncmp(a, b, la) != 0)
			return depth;
		depth++;
		a += la;
		b += lb;
	}
}

const char *
nic_why_str(enum nic_why w)
{
	switch (w) {
	case NIC_ONLY: return "only one";
	case NIC_NEAREST: return "nearest by PCI";
	case NIC_CONFIGURED: return "configured";
	default: return "none";
	}
}

int
nic_for_gpu(const struct nic *nics, int n, const char *gpu_pci, const char *configured, enum nic_why *why)
{
	char pci[32], p[PATH_MAX], *gpath = NULL;
	int best = -1, bdepth = 0, gnuma = -1;

	*why = NIC_NONE;
	for (int i = 0; configured != NULL && i < n; i++)
		if (strcmp(nics[i].name, configured) == 0) {
			*why = NIC_CONFIGURED;
			return i;
		}
	if (n <= 0)
		return -1;
	if (n == 1) {
		*why = NIC_ONLY;
		return 0;
	}
	if (nic_pci_norm(gpu_pci, pci, sizeof(pci))) {
		fmt(p, sizeof(p), "%s/bus/pci/devices/%s", nic_sysfs_root, pci);
		gpath = realpath(p, NULL);
	}
	if (gpath != NULL)
		gnuma = numa_of(gpath);
	for (int i = 0; i < n; i++) {
		int d = gpath != NULL ? nic_common_depth(gpath, nics[i].path) : -1;
		if (best >= 0) {
			const struct nic *b = &nics[best];
			/* active first, then depth, then the GPU's NUMA node; names come sorted */
			if (nics[i].active != b->active) {
				if (!nics[i].active)
					continue;
			} else if (d != bdepth) {
				if (d < bdepth)
					continue;
			} else if (gnuma < 0 || (nics[i].numa == gnuma) == (b->numa == gnuma) ||
			    b->numa == gnuma)
				continue;
		}
		best = i;
		bdepth = d;
	}
	free(gpath);
	*why = NIC_NEAREST;
	return best;
}

bool
nic_for_dev(int dev, char *name, size_t namelen, enum nic_why *why)
{
	static struct nic nics[NIC_MAX];
	int n = nic_scan(nics, NIC_MAX), i;
	const char *conf = dev >= 0 && dev < NIC_GPUS ? cfg->fabric_nic_for_gpu[dev] : NULL;

	if ((i = nic_for_gpu(nics, n, gpu_pci(dev), conf, why)) < 0)
		return false;
	fmt(name, namelen, "%s", nics[i].name);
	return true;
}

/* ---- Q_TOPO ---- */

bool
nic_topo(Gpx__QueryReply *q)
{
	struct nic *nics = calloc(NIC_MAX, sizeof(*nics));
	int n = nics != NULL ? nic_scan(nics, NIC_MAX) : 0;
	bool whole = nics != NULL && (q->nics = calloc((size_t)n + 1, sizeof(*q->nics))) != NULL;

	for (int i = 0; whole && i < n; i++) {
		Gpx__NicInfo *x = malloc(sizeof(*x));
		if (x == NULL) {
			whole = false;
			break;
		}
		gpx__nic_info__init(x);
		x->name = strdup(nics[i].name);
		x->pci = strdup(nics[i].pci[0] ? nics[i].pci : "virtual");
		x->numa = nics[i].numa;
		x->state = strdup(nics[i].state);
		x->link_layer = strdup(nics[i].link_layer);
		x->ports = (uint32_t)nics[i].ports;
		q->nics[q->n_nics++] = x;       /* (freed by nic_topo_free, whole or not) */
		whole = x->name != NULL && x->pci != NULL && x->state != NULL && x->link_layer != NULL;
	}
	for (size_t g = 0; whole && g < q->n_devices; g++) {
		Gpx__DeviceInfo *d = q->devices[g];
		enum nic_why why;
		int i = nic_for_gpu(nics, n, d->pci, d->index < NIC_GPUS ? cfg->fabric_nic_for_gpu[d->index] : NULL, &why);
		d->nic = strdup(i >= 0 ? nics[i].name : "");
		d->nic_why = (char *)nic_why_str(why);
		whole = d->nic != NULL;
	}
	free(nics);
	return whole;
}

void
nic_topo_free(Gpx__QueryReply *q)
{
	for (size_t i = 0; i < q->n_nics; i++) {
		free(q->nics[i]->name);
		free(q->nics[i]->pci);
		free(q->nics[i]->state);
		free(q->nics[i]->link_layer);
		free(q->nics[i]);
	}
	free(q->nics);
	q->nics = NULL;
	q->n_nics = 0;
	for (size_t g = 0; g < q->n_devices; g++) {
		if (q->devices[g]->nic != protobuf_c_empty_string)
			free(q->devices[g]->nic);
		q->devices[g]->nic = NULL;
	}
}
