/*
 * Unit tests of daemon/fabric/nic.c against fake sysfs trees made in a temporary directory: reading
 * the NICs (PCI address, "virtual" devices, NUMA node, port state and link layer), PCI address
 * spelling, the common-ancestor depth, the nearest NIC of each GPU with its tie-breaks (an
 * active port, then the GPU's NUMA node, then the name), the only NIC, no NIC, the configured
 * override, and the [fabric] nic_for_gpuN keys of the configuration.
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "daemon/gpxd.h"
#include "daemon/fabric/nic.h"
#include "tests/tap.h"

static char root[64];

static void path_of(char *out, size_t len, const char *fmt, va_list ap) __attribute__((format(printf, 3, 0)));

static void
path_of(char *out, size_t len, const char *fmt, va_list ap)
{
	char rel[512];

	vsnprintf(rel, sizeof(rel), fmt, ap);
	if ((size_t)snprintf(out, len, "%s/%s", root, rel) >= len)
		tap_bail("path too long");
}

/* mkdir -p root/PATH */
static void mkdirs(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void
mkdirs(const char *fmt, ...)
{
	char p[1024];
	va_list ap;

	va_start(ap, fmt);
	path_of(p, sizeof(p), fmt, ap);
	va_end(ap);
	for (char *s = p + strlen(root) + 1; (s = strchr(s, '/')) != NULL; s++) {
		*s = '\0';
		if (mkdir(p, 0755) < 0 && errno != EEXIST)
			tap_bail("mkdir %s", p);
		*s = '/';
	}
	if (mkdir(p, 0755) < 0 && errno != EEXIST)
		tap_bail("mkdir %s", p);
}

/* root/FILE holds text */
static void
put(const char *file, const char *text)
{
	char p[1024];
	FILE *f;

	snprintf(p, sizeof(p), "%s/%s", root, file);
	if ((f = fopen(p, "w")) == NULL)
		tap_bail("cannot write %s", p);
	fputs(text, f);
	fclose(f);
}

/* root/LINK -> TARGET (relative to LINK's directory, as sysfs makes them) */
static void
link_to(const char *link, const char *target)
{
	char p[1024];

	snprintf(p, sizeof(p), "%s/%s", root, link);
	if (symlink(target, p) < 0)
		tap_bail("symlink %s", p);
}

/* A PCI device at devices/DIR with its NUMA node, named by bus/pci/devices/ADDR. */
static void
pci_dev(const char *dir, const char *addr, int numa)
{
	char f[512], t[512], v[16];

	mkdirs("devices/%s", dir);
	snprintf(f, sizeof(f), "devices/%s/numa_node", dir);
	snprintf(v, sizeof(v), "%d\n", numa);
	put(f, v);
	snprintf(f, sizeof(f), "bus/pci/devices/%s", addr);
	snprintf(t, sizeof(t), "../../../devices/%s", dir);
	link_to(f, t);
}

/* An RDMA device NAME with one port; on the PCI device at devices/DIR, or virtual (DIR NULL). */
static void
ib_dev(const char *name, const char *dir, const char *state, const char *ll)
{
	char f[512], t[512];

	mkdirs("class/infiniband/%s/ports/1", name);
	if (dir != NULL) {
		snprintf(f, sizeof(f), "class/infiniband/%s/device", name);
		snprintf(t, sizeof(t), "../../../devices/%s", dir);
		link_to(f, t);
	}
	snprintf(f, sizeof(f), "class/infiniband/%s/ports/1/state", name);
	put(f, state);
	snprintf(f, sizeof(f), "class/infiniband/%s/ports/1/link_layer", name);
	put(f, ll);
}

static int
find(const struct nic *n, int cnt, const char *name)
{
	for (int i = 0; i < cnt; i++)
		if (strcmp(n[i].name, name) == 0)
			return i;
	return -1;
}

static const char *
pick(const struct nic *n, int cnt, const char *gpu, const char *conf, enum nic_why *why)
{
	int i = nic_for_gpu(n, cnt, gpu, conf, why);
	return i >= 0 ? n[i].name : "(none)";
}

static void
test_tree(void)
{
	struct nic n[NIC_MAX];
	enum nic_why why;
	char pci[32];
	int cnt, i;

	mkdirs("bus/pci/devices");
	mkdirs("devices/virtual/infiniband");
	/* socket 0: a switch with GPU0, a NIC with a dead port and mlx5_0 */
	pci_dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", "0000:02:00.0", 0);
	pci_dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", "0000:02:01.0", 0);
	pci_dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0", "0000:02:02.0", 0);
	/* socket 1: GPU1 and mlx5_1 on different root ports of one root complex */
	pci_dev("pci0000:80/0000:80:01.0/0000:81:00.0", "0000:81:00.0", 1);
	pci_dev("pci0000:80/0000:80:02.0/0000:82:00.0", "0000:82:00.0", 1);
	/* GPU2 and GPU3 on root complexes of their own, NUMA 1 and unknown */
	pci_dev("pci0000:40/0000:40:01.0/0000:41:00.0", "0000:41:00.0", 1);
	pci_dev("pci0000:c0/0000:c0:01.0/0000:c1:00.0", "0000:c1:00.0", -1);
	ib_dev("mlx4_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", "1: DOWN\n", "InfiniBand\n");
	ib_dev("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0", "4: ACTIVE\n", "InfiniBand\n");
	ib_dev("mlx5_1", "pci0000:80/0000:80:02.0/0000:82:00.0", "4: ACTIVE\n", "Ethernet\n");
	ib_dev("rxe0", NULL, "4: ACTIVE\n", "Ethernet\n");

	cnt = nic_scan(n, NIC_MAX);
	ok(cnt == 4, "nic_scan: 4 devices (%d)", cnt);
	ok(cnt == 4 && strcmp(n[0].name, "mlx4_0") == 0 && strcmp(n[3].name, "rxe0") == 0, "nic_scan: sorted by name");
	i = find(n, cnt, "mlx5_0");
	ok(i >= 0 && strcmp(n[i].pci, "0000:02:02.0") == 0 && n[i].numa == 0 && n[i].active &&
	    strcmp(n[i].state, "ACTIVE") == 0 && strcmp(n[i].link_layer, "InfiniBand") == 0 && n[i].ports == 1,
	    "nic_scan: mlx5_0 pci 0000:02:02.0, numa 0, ACTIVE, InfiniBand");
	i = find(n, cnt, "mlx4_0");
	ok(i >= 0 && !n[i].active && strcmp(n[i].state, "DOWN") == 0, "nic_scan: mlx4_0's port is DOWN");
	i = find(n, cnt, "mlx5_1");
	ok(i >= 0 && n[i].numa == 1 && strcmp(n[i].link_layer, "Ethernet") == 0, "nic_scan: mlx5_1 numa 1, Ethernet");
	i = find(n, cnt, "rxe0");
	ok(i >= 0 && n[i].pci[0] == '\0' && n[i].path[0] == '\0' && n[i].numa == -1 && n[i].active,
	    "nic_scan: rxe0 has no PCI device (virtual), numa unknown, ACTIVE");

	ok(nic_pci_norm("00000000:3B:00.0", pci, sizeof(pci)) && strcmp(pci, "0000:3b:00.0") == 0,
	    "nic_pci_norm: the driver's 8-digit upper-case spelling becomes sysfs's");
	ok(!nic_pci_norm("virtual", pci, sizeof(pci)) && !nic_pci_norm("0000:3b:00.0x", pci, sizeof(pci)) &&
	    !nic_pci_norm(NULL, pci, sizeof(pci)), "nic_pci_norm: refuses what is not a PCI address");
	ok(nic_common_depth("/sys/devices/pci0000:00/a/b", "/sys/devices/pci0000:00/a/c") == 4 &&
	    nic_common_depth("/sys/devices/x", "/sys/devices/xy") == 2 && nic_common_depth("/a", "") == -1,
	    "nic_common_depth: whole components only, -1 for a device without a path");

	ok(strcmp(pick(n, cnt, "0000:02:00.0", NULL, &why), "mlx5_0") == 0 && why == NIC_NEAREST,
	    "GPU behind the switch: mlx5_0, nearest by PCI (mlx4_0 as near, but its port is down)");
	ok(strcmp(pick(n, cnt, "00000000:81:00.0", NULL, &why), "mlx5_1") == 0 && why == NIC_NEAREST,
	    "GPU on root complex 80: mlx5_1 (same root complex)");
	ok(strcmp(pick(n, cnt, "0000:41:00.0", NULL, &why), "mlx5_1") == 0,
	    "equally far NICs: the one on the GPU's NUMA node");
	ok(strcmp(pick(n, cnt, "0000:c1:00.0", NULL, &why), "mlx5_0") == 0,
	    "equally far NICs, NUMA unknown: the first by name with an active port");
	ok(strcmp(pick(n, cnt, "0000:02:00.0", "mlx5_1", &why), "mlx5_1") == 0 && why == NIC_CONFIGURED,
	    "nic_for_gpuN names a NIC: that one, configured");
	ok(strcmp(pick(n, cnt, "0000:02:00.0", "mlx9_9", &why), "mlx5_0") == 0 && why == NIC_NEAREST,
	    "nic_for_gpuN names no NIC: the nearest");
	ok(strcmp(pick(n, cnt, "0000:99:00.0", NULL, &why), "mlx5_0") == 0 && why == NIC_NEAREST,
	    "a GPU sysfs does not know: the first NIC with an active port");
	i = find(n, cnt, "rxe0");
	ok(strcmp(pick(&n[i], 1, "0000:02:00.0", NULL, &why), "rxe0") == 0 && why == NIC_ONLY,
	    "one NIC: that one, only one");
	ok(nic_for_gpu(n, 0, "0000:02:00.0", "mlx5_0", &why) == -1 && why == NIC_NONE, "no NIC: none");
	ok(strcmp(nic_why_str(NIC_NEAREST), "nearest by PCI") == 0 && strcmp(nic_why_str(NIC_ONLY), "only one") == 0 &&
	    strcmp(nic_why_str(NIC_CONFIGURED), "configured") == 0, "nic_why_str: what gpxctl topo shows");

	nic_sysfs_root = "/nonexistent-gpx-sysfs";
	ok(nic_scan(n, NIC_MAX) == 0, "nic_scan: no class/infiniband, no NIC");
}

static int
load(const char *text, struct conf *c, char *err, size_t errlen)
{
	char p[128];
	FILE *f;

	snprintf(p, sizeof(p), "%s/gpxd.conf", root);
	if ((f = fopen(p, "w")) == NULL)
		tap_bail("cannot write %s", p);
	fputs(text, f);
	fclose(f);
	conf_defaults(c);
	return conf_load(c, p, err, errlen);
}

static void
test_conf(void)
{
	struct conf c;
	char err[512];

	ok(load("[fabric]\nnic_for_gpu0 = mlx5_1\nnic_for_gpu15 = mlx5_0\n", &c, err, sizeof(err)) == 0 &&
	    strcmp(c.fabric_nic_for_gpu[0], "mlx5_1") == 0 && strcmp(c.fabric_nic_for_gpu[15], "mlx5_0") == 0 &&
	    c.fabric_nic_for_gpu[1] == NULL, "conf: nic_for_gpu0 and nic_for_gpu15");
	conf_free(&c);
	ok(load("[fabric]\nnic_for_gpu16 = mlx5_1\n", &c, err, sizeof(err)) < 0 && strstr(err, "nic_for_gpu16"),
	    "conf: nic_for_gpu16 is refused (%s)", err);
	conf_free(&c);
	ok(load("[fabric]\nnic_for_gpu01 = mlx5_1\n", &c, err, sizeof(err)) < 0, "conf: nic_for_gpu01 is refused");
	conf_free(&c);
	ok(load("[daemon]\nnic_for_gpu0 = mlx5_1\n", &c, err, sizeof(err)) < 0, "conf: nic_for_gpu0 belongs in [fabric]");
	conf_free(&c);
}

int
main(void)
{
	char cmd[128];

	setvbuf(stdout, NULL, _IOLBF, 0);
	log_init(LOG_L_ERR, NULL, false);
	snprintf(root, sizeof(root), "%s/gpx-nic.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
	if (mkdtemp(root) == NULL)
		tap_bail("mkdtemp");
	nic_sysfs_root = root;
	test_tree();
	test_conf();
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
	(void)!system(cmd);
	return tap_done();
}
