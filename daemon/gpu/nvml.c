/*
 * What NVML says of each GPU's NVLinks, for gpxctl topo: how many links are up and where each
 * leads (an NVSwitch, or another GPU by its PCI address).  The CUDA driver API does not tell;
 * NVML ships with the driver as libnvidia-ml.so.1 and is loaded here if it is there.  Only
 * the handful of calls below are used, declared as NVML has them since driver R460, so no
 * header is needed to build.  Nothing in gpxd's copies depends on this: without NVML, topo
 * shows the driver's view (peer access, performance rank) and no link kinds.
 */
#include "config.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

typedef int nvml_ret;               /* nvmlReturn_t: 0 is NVML_SUCCESS */
typedef struct nvml_dev *nvml_dev;  /* nvmlDevice_t */

struct nvml_pci {                   /* nvmlPciInfo_t */
	char bus_id_legacy[16];
	unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
	char bus_id[32];
};

enum { NVML_LINK_GPU = 0, NVML_LINK_SWITCH = 2 };    /* nvmlIntNvLinkDeviceType_t */
#define NVML_MAX_LINKS 18           /* NVML_NVLINK_MAX_LINKS in current drivers (H100: 18) */

static struct {
	nvml_ret (*init)(void);
	nvml_ret (*by_pci)(const char *, nvml_dev *);
	nvml_ret (*state)(nvml_dev, unsigned, unsigned *);
	nvml_ret (*remote_type)(nvml_dev, unsigned, int *);
	nvml_ret (*remote_pci)(nvml_dev, unsigned, struct nvml_pci *);
	bool ok;
} nv;

static pthread_once_t nv_once = PTHREAD_ONCE_INIT;

static void
nvml_load(void)
{
	void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);

	if (h == NULL)
		return;
	nv.init = (nvml_ret (*)(void))dlsym(h, "nvmlInit_v2");
	nv.by_pci = (nvml_ret (*)(const char *, nvml_dev *))dlsym(h, "nvmlDeviceGetHandleByPciBusId_v2");
	nv.state = (nvml_ret (*)(nvml_dev, unsigned, unsigned *))dlsym(h, "nvmlDeviceGetNvLinkState");
	nv.remote_type = (nvml_ret (*)(nvml_dev, unsigned, int *))dlsym(h, "nvmlDeviceGetNvLinkRemoteDeviceType");
	nv.remote_pci = (nvml_ret (*)(nvml_dev, unsigned, struct nvml_pci *))dlsym(h, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
	nv.ok = nv.init != NULL && nv.by_pci != NULL && nv.state != NULL && nv.remote_type != NULL &&
	    nv.remote_pci != NULL && nv.init() == 0;
	if (!nv.ok)
		log_info("NVML present but unusable: gpxctl topo shows no NVLink details");
}

uint32_t
nvml_pci_key(const char *pci)
{
	unsigned dom, bus, dev;

	if (pci == NULL || sscanf(pci, "%x:%x:%x", &dom, &bus, &dev) != 3)
		return 0;
	return (dom & 0xffff) << 16 | (bus & 0xff) << 8 | (dev & 0x1f) << 3;
}

int
nvml_nvlinks(const char *pci, struct gpu_nvlinks *out)
{
	nvml_dev d;

	memset(out, 0, sizeof(*out));
	pthread_once(&nv_once, nvml_load);
	if (!nv.ok || nv.by_pci(pci, &d) != 0)
		return -1;
	for (unsigned l = 0; l < NVML_MAX_LINKS; l++) {
		unsigned up = 0;
		int type = -1;
		struct nvml_pci far;
		if (nv.state(d, l, &up) != 0 || !up)
			continue;      /* not a link of this GPU (past its last one), or down */
		out->up++;
		if (nv.remote_type(d, l, &type) != 0)
			continue;
		if (type == NVML_LINK_SWITCH)
			out->to_switch++;
		else if (type == NVML_LINK_GPU && nv.remote_pci(d, l, &far) == 0 && out->ngpu < GPU_NVLINKS_MAX)
			out->gpu[out->ngpu++] = (far.domain & 0xffff) << 16 | (far.bus & 0xff) << 8 |
			    (far.device & 0x1f) << 3;
	}
	return 0;
}
