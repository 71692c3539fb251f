/*
 * The GPU back end: the devices by UUID and the peer matrix between them, the back end's
 * start and stop, pinning of host regions, and what gpxctl topo shows.  The memory kinds live
 * in gpu-map.c (cuda-ipc, cuda-pool) and vmm.c (cuda-vmm), the copy workers in gpu-copy.c,
 * the driver behind plain C types in cuda.c.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

/* A device: what the driver says of it and of its links to the others. */
struct gpu_dev {
	struct gpu_info info;
	struct gpu_nvlinks nvl;
	bool nvml;                          /* NVML described its links */
	struct gpu_link *link;              /* to each device, ngpus of them */
	uint32_t access_mask;               /* devices that can reach this one's memory */
};

static struct gpu_dev *devs;            /* sized at start: the devices the driver shows */
static int ngpus;
static char status_text[256] = "not initialised";

int
gpu_count(void)
{
	return ngpus;
}

const char *
gpu_status(void)
{
	return status_text;
}

int
gpu_dev_by_uuid(const uint8_t uuid[16])
{
	for (int i = 0; i < ngpus; i++)
		if (memcmp(devs[i].info.uuid, uuid, 16) == 0)
			return i;
	return -1;
}

uint32_t
gpu_access_mask(int dev)
{
	return devs[dev].access_mask;
}

bool
gpu_peer_access(int a, int b)
{
	return devs[a].link[b].access;
}

static void
uuid_str(const uint8_t u[16], char *buf, size_t len)
{
	snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
	    u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

/* Host regions are pinned for DMA when a GPU is present; failure only costs speed. */
void
gpu_host_register(struct region *r)
{
	if (cuda_use(0) == 0 && cuda_host_register(r->map, r->map_len, r->read_only) == 0)
		r->priv = r;          /* marks the mapping as pinned */
	else
		log_warnx("could not pin a %llu-byte host region (memlock limit?): host<->GPU copies "
		    "of it run from pageable memory", (unsigned long long)r->map_len);
}

void
gpu_host_unpin(void *map)
{
	cuda_use(0);
	cuda_host_unregister(map);
}

/* "18 NVLinks up, 18 to NVSwitches"; "NVLink unknown" without NVML. */
static const char *
nvlink_str(const struct gpu_dev *d, char *buf, size_t len)
{
	if (!d->nvml)
		snprintf(buf, len, "NVLinks unknown (no NVML)");
	else if (d->nvl.to_switch > 0)
		snprintf(buf, len, "%d NVLinks up, %d to NVSwitches", d->nvl.up, d->nvl.to_switch);
	else
		snprintf(buf, len, "%d NVLinks up", d->nvl.up);
	return buf;
}

/* ---- start and stop ---- */

static void gpu_devs_free(int n);

int
gpu_init(char *why, size_t whylen)
{
	int n = cuda_load(why, whylen);

	if (n <= 0) {
		snprintf(status_text, sizeof(status_text), "unavailable: %s", why);
		return -1;
	}
	if ((devs = calloc(n, sizeof(*devs))) == NULL) {
		snprintf(why, whylen, "out of memory");
		goto fail;
	}
	for (int i = 0; i < n; i++) {
		if ((devs[i].link = calloc(n, sizeof(*devs[i].link))) == NULL) {
			snprintf(why, whylen, "out of memory");
			goto fail;
		}
		if (cuda_device_info(i, &devs[i].info) < 0) {
			snprintf(why, whylen, "cannot query GPU%d", i);
			goto fail;
		}
		devs[i].access_mask = 1u << i;
		devs[i].nvml = nvml_nvlinks(devs[i].info.pci, &devs[i].nvl) == 0;
	}
	for (int a = 0; a < n; a++)
		for (int b = 0; b < n; b++)
			if (a != b) {
				struct gpu_link *l = &devs[a].link[b];
				cuda_peer(a, b, l);
				for (int k = 0; k < devs[a].nvl.ngpu; k++)
					l->nvlinks += devs[a].nvl.gpu[k] == nvml_pci_key(devs[b].info.pci);
				l->nvswitch = devs[a].nvl.to_switch > 0 && devs[b].nvl.to_switch > 0;
				if (devs[a].link[b].access)
					devs[b].access_mask |= 1u << a;   /* a's copies can reach b's memory */
			}
	ngpus = n;
	if (gpu_workers_start(n, why, whylen) < 0)
		goto fail;
	int v = cuda_driver_version();
	snprintf(status_text, sizeof(status_text), "available: %d GPU%s, driver API %d.%d", n,
	    n == 1 ? "" : "s", v / 1000, v % 1000 / 10);
	for (int i = 0; i < n; i++) {
		char u[48], nvl[96];
		uuid_str(devs[i].info.uuid, u, sizeof(u));
		log_info("GPU%d: %s %s pci %s, %d copy engines, %d SMs, %s", i, devs[i].info.name, u,
		    devs[i].info.pci, devs[i].info.copy_engines, devs[i].info.sms, nvlink_str(&devs[i], nvl, sizeof(nvl)));
	}
	return 0;
fail:
	snprintf(status_text, sizeof(status_text), "unavailable: %s", why);
	gpu_devs_free(n);
	return -1;
}

static void
gpu_devs_free(int n)
{
	for (int i = 0; devs != NULL && i < n; i++)
		free(devs[i].link);
	free(devs);
	devs = NULL;
	ngpus = 0;
}

void
gpu_shutdown(void)
{
	gpu_workers_stop();
	gpu_devs_free(ngpus);
}

/* ---- gpxctl topo ---- */

bool
gpu_topo(Gpx__QueryReply *q)
{
	q->devices = calloc(ngpus + 1, sizeof(*q->devices));
	q->links = calloc(ngpus * ngpus + 1, sizeof(*q->links));
	if (q->devices == NULL || q->links == NULL)
		return false;
	for (int i = 0; i < ngpus; i++) {
		Gpx__DeviceInfo *d = malloc(sizeof(*d));
		char *u = malloc(48);
		if (d == NULL || u == NULL) {
			free(d);
			free(u);
			return false;
		}
		gpx__device_info__init(d);
		uuid_str(devs[i].info.uuid, u, 48);
		d->index = i;
		d->uuid = u;
		d->name = devs[i].info.name;
		d->pci = devs[i].info.pci;
		d->memory = devs[i].info.memory;
		d->copy_engines = devs[i].info.copy_engines;
		d->sms = devs[i].info.sms;
		d->nvml = devs[i].nvml;
		d->nvlinks = devs[i].nvl.up;
		d->nvswitch_links = devs[i].nvl.to_switch;
		q->devices[q->n_devices++] = d;
		for (int j = 0; j < ngpus; j++) {
			if (i == j)
				continue;
			Gpx__PeerLink *l = malloc(sizeof(*l));
			if (l == NULL)
				return false;
			gpx__peer_link__init(l);
			l->src = i;
			l->dst = j;
			l->access = devs[i].link[j].access;
			l->rank = devs[i].link[j].rank;
			l->atomics = devs[i].link[j].atomics;
			l->path = (char *)(l->access ? "p2p" : "staged");
			l->nvlinks = devs[i].link[j].nvlinks;
			l->fabric = (char *)(!devs[i].nvml || !devs[j].nvml ? "" : l->nvlinks > 0 ? "nvlink" :
			    devs[i].link[j].nvswitch ? "nvswitch" : "pcie");
			q->links[q->n_links++] = l;
		}
	}
	return true;
}

const char *
gpu_pci(int dev)
{
	return dev >= 0 && dev < ngpus ? devs[dev].info.pci : NULL;
}

void
gpu_topo_free(Gpx__QueryReply *q)
{
	for (size_t i = 0; i < q->n_devices; i++) {
		free(q->devices[i]->uuid);
		free(q->devices[i]);
	}
	for (size_t i = 0; i < q->n_links; i++)
		free(q->links[i]);
	free(q->devices);
	free(q->links);
	q->devices = NULL;
	q->links = NULL;
	q->n_devices = q->n_links = 0;
}
