/*
 * The only file of gpxd that includes cuda.h.  It loads libcuda.so.1 at run time (dlopen, then
 * every entry point through cuGetProcAddress), so one gpxd binary serves host memory on a node
 * without a driver, and wraps the driver calls the GPU back end (gpu.c) needs behind plain C
 * types.  Every call goes through CU(): a failure becomes a log line naming the call and the
 * driver's error, and a gpx status; a sticky error, after which the context can do nothing
 * right any more, ends the daemon with a clear line so that systemd restarts it.
 */
#include "config.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cuda.h>

#include "daemon/gpxd.h"
#include "daemon/gpu/internal.h"

/* Entry points, resolved by name; the types come from this cuda.h. */
#define CUDA_FUNCS(X) \
	X(cuInit) X(cuDriverGetVersion) X(cuGetErrorName) X(cuGetErrorString) \
	X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetName) X(cuDeviceGetUuid) \
	X(cuDeviceGetAttribute) X(cuDeviceTotalMem) X(cuDeviceGetPCIBusId) \
	X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxGetExecAffinity) \
	X(cuDeviceCanAccessPeer) X(cuDeviceGetP2PAttribute) X(cuCtxEnablePeerAccess) \
	X(cuStreamCreate) X(cuStreamCreateWithPriority) X(cuCtxGetStreamPriorityRange) \
	X(cuStreamDestroy) X(cuStreamQuery) X(cuStreamSynchronize) \
	X(cuStreamWriteValue64) X(cuMemcpyAsync) X(cuMemcpyPeerAsync) \
	X(cuMemFree) X(cuMemHostAlloc) X(cuMemFreeHost) \
	X(cuMemHostRegister) X(cuMemHostUnregister) \
	X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) \
	X(cuMemImportFromShareableHandle) X(cuMemAddressReserve) X(cuMemAddressFree) \
	X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) X(cuMemRelease) \
	X(cuMemGetAllocationPropertiesFromHandle) X(cuMemGetAllocationGranularity) \
	X(cuModuleLoadData) X(cuModuleGetFunction) X(cuLaunchKernel) \
	X(cuMemGetHandleForAddressRange) X(cuPointerGetAttribute) X(cuMemGetAddressRange) \
	X(cuMemPoolImportFromShareableHandle) X(cuMemPoolImportPointer) X(cuMemPoolGetAccess) \
	X(cuMemPoolSetAccess) X(cuMemPoolDestroy)

#define DECL(f) static __typeof__(&f) p_##f;
CUDA_FUNCS(DECL)
#undef DECL

extern const unsigned char gpx_copy_fatbin[];

static void *libcuda;
static int ndev;
static CUdevice *devs;          /* these four: ndev each, allocated when the driver is loaded */
static CUcontext *ctxs;
static CUfunction *kfn, *kfn_pages, *kfn_few;
static int driver_version;

static bool
sticky(CUresult r)
{
	switch (r) {
	case CUDA_ERROR_ILLEGAL_ADDRESS:
	case CUDA_ERROR_LAUNCH_FAILED:
	case CUDA_ERROR_HARDWARE_STACK_ERROR:
	case CUDA_ERROR_ILLEGAL_INSTRUCTION:
	case CUDA_ERROR_MISALIGNED_ADDRESS:
	case CUDA_ERROR_INVALID_ADDRESS_SPACE:
	case CUDA_ERROR_INVALID_PC:
	case CUDA_ERROR_ASSERT:
	case CUDA_ERROR_ECC_UNCORRECTABLE:
	case CUDA_ERROR_UNKNOWN:
		return true;
	default:
		return false;
	}
}

const char *
cuda_errstr(int code)
{
	const char *name = NULL;

	if (p_cuGetErrorName == NULL || p_cuGetErrorName((CUresult)code, &name) != CUDA_SUCCESS)
		return "unknown CUDA error";
	return name;
}

/* Logs a failed driver call; exits on a sticky error.  Returns 0 or -GPX status. */
static int
cu_check(CUresult r, const char *call, int line)
{
	const char *name = "?", *text = "?";

	if (r == CUDA_SUCCESS)
		return 0;
	if (p_cuGetErrorName != NULL)
		p_cuGetErrorName(r, &name);
	if (p_cuGetErrorString != NULL)
		p_cuGetErrorString(r, &text);
	if (sticky(r))
		fatalx("cuda: %s failed with sticky error %s (%s): the CUDA context is unusable, exiting "
		    "(cuda.c:%d)", call, name, text, line);
	log_warnx("cuda: %s failed: %s (%s)", call, name, text);
	switch (r) {
	case CUDA_ERROR_OUT_OF_MEMORY:
		return -GPX__STATUS__ENOMEM;
	case CUDA_ERROR_INVALID_VALUE:
	case CUDA_ERROR_INVALID_HANDLE:
	case CUDA_ERROR_NOT_FOUND:
		return -GPX__STATUS__EINVAL;
	case CUDA_ERROR_NOT_SUPPORTED:
	case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
		return -GPX__STATUS__ENOTSUP;
	default:
		return -GPX__STATUS__EIO;
	}
}
#define CU(call) cu_check(p_##call, #call, __LINE__)

int
cuda_load(char *why, size_t whylen)
{
	CUresult (*getproc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
	CUdriverProcAddressQueryResult st;

	if ((libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) == NULL) {
		snprintf(why, whylen, "no CUDA driver (%s)", dlerror());
		return -1;
	}
	*(void **)&getproc = dlsym(libcuda, "cuGetProcAddress_v2");
	if (getproc == NULL) {
		snprintf(why, whylen, "the CUDA driver is too old (no cuGetProcAddress_v2)");
		return -1;
	}
#define RESOLVE(f) \
	if (getproc(#f, (void **)&p_##f, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || \
	    p_##f == NULL) { \
		snprintf(why, whylen, "the CUDA driver lacks %s", #f); \
		return -1; \
	}
	CUDA_FUNCS(RESOLVE)
#undef RESOLVE
	/*
	 * The driver puts the streams of a context onto a few hardware work queues, in order of
	 * creation, and a queue runs what it holds in order, whatever the streams' priorities.
	 * Under MPS a client is given fewer queues unless it asks, and gpxd's quick stream
	 * shared one with a bulk stream: a 4 KiB copy waited for the 1 GiB copies queued before
	 * it (p50 5 ms on an H100).  Ask for the number a context has without MPS (8: a queue for
	 * each of the copy workers' streams), unless the operator chose one.
	 */
	setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 0);
	CUresult r = p_cuInit(0);
	if (r != CUDA_SUCCESS) {
		snprintf(why, whylen, "cuInit failed: %s", cuda_errstr(r));
		return -1;
	}
	p_cuDriverGetVersion(&driver_version);
	if (p_cuDeviceGetCount(&ndev) != CUDA_SUCCESS || ndev == 0) {
		snprintf(why, whylen, "the CUDA driver sees no device");
		ndev = 0;
		return -1;
	}
	if (ndev > GPX_MAX_GPUS) {
		log_warnx("the driver shows %d GPUs; gpxd drives the first %d", ndev, GPX_MAX_GPUS);
		ndev = GPX_MAX_GPUS;
	}
	if ((devs = calloc(ndev, sizeof(*devs))) == NULL || (ctxs = calloc(ndev, sizeof(*ctxs))) == NULL ||
	    (kfn = calloc(ndev, sizeof(*kfn))) == NULL || (kfn_pages = calloc(ndev, sizeof(*kfn_pages))) == NULL ||
	    (kfn_few = calloc(ndev, sizeof(*kfn_few))) == NULL) {
		snprintf(why, whylen, "out of memory");
		return -1;
	}
	for (int i = 0; i < ndev; i++) {
		if (CU(cuDeviceGet(&devs[i], i)) < 0 || CU(cuDevicePrimaryCtxRetain(&ctxs[i], devs[i])) < 0) {
			snprintf(why, whylen, "cannot open device %d", i);
			return -1;
		}
	}
	return ndev;
}

int
cuda_driver_version(void)
{
	return driver_version;
}

/* Makes dev's primary context current on the calling thread. */
int
cuda_use(int dev)
{
	return CU(cuCtxSetCurrent(ctxs[dev]));
}

int
cuda_device_info(int dev, struct gpu_info *g)
{
	CUuuid u;
	size_t mem;
	int v;

	memset(g, 0, sizeof(*g));
	if (CU(cuDeviceGetName(g->name, sizeof(g->name), devs[dev])) < 0 ||
	    CU(cuDeviceGetUuid(&u, devs[dev])) < 0 || CU(cuDeviceTotalMem(&mem, devs[dev])) < 0 ||
	    CU(cuDeviceGetPCIBusId(g->pci, sizeof(g->pci), devs[dev])) < 0)
		return -1;
	memcpy(g->uuid, u.bytes, 16);
	g->memory = mem;
	if (p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, devs[dev]) == CUDA_SUCCESS)
		g->copy_engines = v;
	if (p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, devs[dev]) == CUDA_SUCCESS)
		g->sms = v;
	if (p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
	    devs[dev]) == CUDA_SUCCESS)
		g->vmm_fd = v;
	return 0;
}

/* Whether GPU dev is shared through CUDA MPS (gpxd's context is then an MPS client). */
bool
cuda_mps(int dev)
{
	int v = 0;

	if (p_cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, devs[dev]) != CUDA_SUCCESS || v == 0)
		return false;
	log_info("GPU%d: shared through CUDA MPS", dev);
	return true;
}

/* What the driver says about a -> b, and peer access enabled from a's context when possible. */
int
cuda_peer(int a, int b, struct gpu_link *l)
{
	int v = 0;

	memset(l, 0, sizeof(*l));
	if (CU(cuDeviceCanAccessPeer(&v, devs[a], devs[b])) < 0)
		return -1;
	l->access = v;
	if (p_cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, devs[a], devs[b]) == CUDA_SUCCESS)
		l->rank = v;
	if (p_cuDeviceGetP2PAttribute(&v, CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, devs[a], devs[b]) == CUDA_SUCCESS)
		l->atomics = v;
	if (l->access) {
		CUresult r;
		cuda_use(a);
		r = p_cuCtxEnablePeerAccess(ctxs[b], 0);
		if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
			cu_check(r, "cuCtxEnablePeerAccess", __LINE__);
			l->access = 0;
		}
	}
	return 0;
}

/*
 * The SMs the current context may use, said in the log when fewer than all.  Under CUDA MPS
 * with an active thread percentage (the control daemon's, or CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
 * in gpxd's environment) that is the context's share, which its execution affinity reports:
 * the copy kernels' blocks run there only.
 */
static void
log_ctx_sms(int dev)
{
	CUexecAffinityParam a;
	int all = 0;

	p_cuDeviceGetAttribute(&all, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, devs[dev]);
	if (p_cuCtxGetExecAffinity(&a, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS && a.param.smCount.val > 0 &&
	    all > 0 && a.param.smCount.val < (unsigned)all)
		log_info("GPU%d: gpxd's context may use %u of its %d SMs (CUDA MPS active thread percentage)", dev,
		    a.param.smCount.val, all);
}

int
cuda_load_kernel(int dev)
{
	CUmodule m;

	if (cuda_use(dev) < 0 || CU(cuModuleLoadData(&m, gpx_copy_fatbin)) < 0 ||
	    CU(cuModuleGetFunction(&kfn[dev], m, "gpx_copy_segments")) < 0 ||
	    CU(cuModuleGetFunction(&kfn_pages[dev], m, "gpx_copy_pages")) < 0 ||
	    CU(cuModuleGetFunction(&kfn_few[dev], m, "gpx_copy_few")) < 0)
		return -1;
	log_ctx_sms(dev);
	return 0;
}

int
cuda_stream_new(void **s)
{
	return CU(cuStreamCreate((CUstream *)s, CU_STREAM_NON_BLOCKING));
}

/*
 * A stream of the greatest priority the context allows.  Copy engines honour it: a small copy
 * on it runs within microseconds although a 1 GiB copy of a lower stream is under way (on an
 * H100 within the GPU: 23 us submit to completion against 712 us at equal priority, the long
 * copy as fast as alone).
 */
int
cuda_stream_new_urgent(void **s)
{
	int least, greatest;

	if (CU(cuCtxGetStreamPriorityRange(&least, &greatest)) < 0)
		return -1;
	return CU(cuStreamCreateWithPriority((CUstream *)s, CU_STREAM_NON_BLOCKING, greatest));
}

void
cuda_stream_free(void *s)
{
	CU(cuStreamDestroy((CUstream)s));
}

/* 0 when all work on s is done, 1 while it runs, negative on error. */
int
cuda_stream_busy(void *s)
{
	CUresult r = p_cuStreamQuery((CUstream)s);

	if (r == CUDA_SUCCESS)
		return 0;
	if (r == CUDA_ERROR_NOT_READY)
		return 1;
	return cu_check(r, "cuStreamQuery", __LINE__);
}

int
cuda_stream_sync(void *s)
{
	return CU(cuStreamSynchronize((CUstream)s));
}

int
cuda_copy(void *s, uint64_t dst, uint64_t src, uint64_t n)
{
	return CU(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s));
}

/*
 * Between two GPUs the contexts are named: memory opened from a legacy IPC handle belongs to
 * the context it was opened in, and an unnamed copy of it to another GPU takes a staged path
 * at a tenth of the link's speed.
 */
int
cuda_copy_peer(void *s, uint64_t dst, int dst_dev, uint64_t src, int src_dev, uint64_t n)
{
	return CU(cuMemcpyPeerAsync((CUdeviceptr)dst, ctxs[dst_dev], (CUdeviceptr)src, ctxs[src_dev], n, (CUstream)s));
}

/* The stream stores val into a word of mapped host memory once everything before it is done. */
int
cuda_signal(void *s, uint64_t word_dev, uint64_t val)
{
	return CU(cuStreamWriteValue64((CUstream)s, (CUdeviceptr)word_dev, val, CU_STREAM_WRITE_VALUE_DEFAULT));
}

/*
 * A copy kernel over n items (segments or pages), a warp each, 8 warps a block, at most
 * `blocks` (cuda.sm_copy_blocks).  By default that is a block for every 8 items, as a
 * program's own gather kernel is launched: each block ends with its items, so the GPU
 * schedules the launch beside other work block by block (the quick stream's kernels, and under
 * MPS the clients' own) and the launch may fill every SM.  On two H100 that moved a
 * 338-tensor weight push from 0.87x to 0.92x of one flat copy and, under MPS beside the
 * program's matmuls, a KV handoff from 0.70x to 1.01x of the program's own kernel, slowing
 * the matmul step about as much as that kernel does (1,332 us against its 1,552):
 * tests/results/gpu2-h100-grid.txt.  A smaller number bounds the grid; its warps then loop
 * over the items and its blocks stay until it ends.
 */
static int
launch(CUfunction f, void *s, uint32_t n, uint32_t blocks, void **args)
{
	uint32_t need = (n + 7) / 8;

	if (blocks > need)
		blocks = need;
	return CU(cuLaunchKernel(f, blocks, 1, 1, 256, 1, 1, 0, (CUstream)s, args, NULL));
}

int
cuda_kernel_copy(int dev, void *s, const struct gpu_kseg *segs, uint32_t n, uint32_t blocks)
{
	void *args[] = { &segs, &n };

	return launch(kfn[dev], s, n, blocks, args);
}

/*
 * The segments travel in the launch itself (struct gpx_kfew of copy-kernel.cu: a count, the
 * completion word and its value, then the segments), so nothing is uploaded first.  A block of
 * 256 threads for every 8 KiB, at most `blocks`: a 4 KiB copy is one block, a 1 MiB one 128.
 * With `word`, the kernel's last block writes seq there once every block is done, in place of
 * a cuda_signal after it.
 */
int
cuda_kernel_copy_few(int dev, void *s, const struct gpu_kseg *segs, uint32_t n, uint64_t bytes, uint32_t blocks,
    uint64_t word, uint64_t seq)
{
	struct {
		uint64_t n;
		uint64_t done;
		uint64_t seq;
		struct gpu_kseg seg[GPU_KFEW_MAX];
	} f;
	void *args[] = { &f };
	uint64_t need = (bytes + 8191) / 8192;

	if (n == 0 || n > GPU_KFEW_MAX)
		return -GPX__STATUS__EINVAL;
	f.n = n;
	f.done = word;
	f.seq = seq;
	memcpy(f.seg, segs, n * sizeof(*segs));
	if (blocks > need)
		blocks = (uint32_t)need;
	if (blocks == 0)
		blocks = 1;
	return CU(cuLaunchKernel(kfn_few[dev], blocks, 1, 1, 256, 1, 1, 0, (CUstream)s, args, NULL));
}

int
cuda_kernel_pages(int dev, void *s, const struct gpu_plist *l, uint32_t npages, const void *pairs, uint32_t item0,
    uint32_t nitems, uint64_t size, uint64_t head, uint64_t bytes, uint32_t blocks)
{
	struct gpu_plist a = *l;
	void *args[] = { &a.sp, &a.dp, &a.stride, &npages, &pairs, &item0, &nitems, &size, &head, &bytes, &a.lim_src,
		&a.lim_dst, &a.oob };

	return launch(kfn_pages[dev], s, nitems, blocks, args);
}

/* Pinned, mapped host memory, usable from every context (for signal words and staging). */
int
cuda_host_alloc(void **p, size_t n)
{
	return CU(cuMemHostAlloc(p, n, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
}

void
cuda_host_free(void *p)
{
	CU(cuMemFreeHost(p));
}

int
cuda_host_register(void *p, size_t n, bool read_only)
{
	unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;

	if (read_only)
		flags |= CU_MEMHOSTREGISTER_READ_ONLY;
	return CU(cuMemHostRegister(p, n, flags));
}

void
cuda_host_unregister(void *p)
{
	CU(cuMemHostUnregister(p));
}

int
cuda_ipc_open(int dev, const uint8_t handle[64], uint64_t *dptr)
{
	CUipcMemHandle h;
	CUdeviceptr d;
	CUresult r;

	memcpy(h.reserved, handle, sizeof(h.reserved));
	if (cuda_use(dev) < 0)
		return -GPX__STATUS__EIO;
	r = p_cuIpcOpenMemHandle(&d, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	if (r != CUDA_SUCCESS) {
		/* A forged or stale handle is the client's fault, not the daemon's: no sticky exit. */
		const char *n = cuda_errstr(r);
		log_warnx("cuda: cuIpcOpenMemHandle refused a handle: %s", n);
		return r == CUDA_ERROR_OUT_OF_MEMORY ? -GPX__STATUS__ENOMEM : -GPX__STATUS__EINVAL;
	}
	*dptr = d;
	return 0;
}

void
cuda_ipc_close(int dev, uint64_t dptr)
{
	cuda_use(dev);
	CU(cuIpcCloseMemHandle((CUdeviceptr)dptr));
}

/*
 * Imported pools and pool allocations, counted.  Whether the driver hands back the same pool
 * (or pointer) when one is imported again, as it does for a legacy IPC handle opened twice, is
 * not documented; either way each must be freed once, after its last user.  The lock also
 * keeps an import from picking up a pool that a release is destroying.
 */
struct held {
	uint64_t v;
	int refs;
	struct held *next;
};
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static struct held *held_pools, *held_ptrs;

/* One more user of v; false when out of memory.  pool_lock held. */
static bool
held_add(struct held **list, uint64_t v)
{
	struct held *h;

	for (h = *list; h != NULL && h->v != v; h = h->next)
		;
	if (h == NULL) {
		if ((h = calloc(1, sizeof(*h))) == NULL)
			return false;
		h->v = v;
		h->next = *list;
		*list = h;
	}
	h->refs++;
	return true;
}

/* One user of v fewer; true when it was the last.  pool_lock held. */
static bool
held_drop(struct held **list, uint64_t v)
{
	struct held **hp, *h;

	for (hp = list; (h = *hp) != NULL; hp = &h->next)
		if (h->v == v) {
			if (--h->refs > 0)
				return false;
			*hp = h->next;
			free(h);
			return true;
		}
	return true;    /* never counted: its only user */
}

/* A driver call refused what a client sent: its fault, so a warning and never a sticky exit. */
static int
pool_refused(const char *call, CUresult r, int status)
{
	log_warnx("cuda: %s refused what the client sent: %s", call, cuda_errstr(r));
	return r == CUDA_ERROR_OUT_OF_MEMORY ? -GPX__STATUS__ENOMEM : status;
}

/* Frees an imported pool allocation and, after its last one, the imported pool.  pool_lock held. */
static void
pool_put(int owner, CUdeviceptr d, CUmemoryPool p)
{
	CUresult r;

	cuda_use(owner);
	/*
	 * Synchronous, so the import is gone once this returns, as the exporter's free must come
	 * after it.  A failure is the owner's doing (it freed the memory while still registered,
	 * say): a warning, never an exit.
	 */
	if (d != 0 && held_drop(&held_ptrs, d) && (r = p_cuMemFree(d)) != CUDA_SUCCESS)
		log_warnx("cuda: cuMemFree of an imported pool allocation: %s (freed by its owner "
		    "while still registered?)", cuda_errstr(r));
	if (held_drop(&held_pools, (uint64_t)(uintptr_t)p) && (r = p_cuMemPoolDestroy(p)) != CUDA_SUCCESS)
		log_warnx("cuda: cuMemPoolDestroy of an imported pool: %s", cuda_errstr(r));
}

/*
 * Imports allocation `data` (a CUmemPoolPtrExportData) of the pool exported as POSIX fd `fd`,
 * memory of device `owner`, for every device in `access_mask`.  An imported pool is reachable
 * from its own device only, and access is the pool's, so it is granted before the pointer is
 * imported.  *dptr: the allocation's address here; *pool: what cuda_pool_release takes back.
 */
int
cuda_pool_import(int owner, int fd, const uint8_t data[64], uint32_t access_mask, uint64_t *dptr,
    uint64_t *pool)
{
	CUmemPoolPtrExportData x;
	CUmemoryPool p;
	CUdeviceptr d = 0;
	CUresult r;
	int ord = -1, e = 0;

	if (cuda_use(owner) < 0)
		return -GPX__STATUS__EIO;
	pthread_mutex_lock(&pool_lock);
	r = p_cuMemPoolImportFromShareableHandle(&p, (void *)(uintptr_t)fd,
	    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (r != CUDA_SUCCESS) {
		pthread_mutex_unlock(&pool_lock);
		return pool_refused("cuMemPoolImportFromShareableHandle", r, -GPX__STATUS__EBADFD);
	}
	if (!held_add(&held_pools, (uint64_t)(uintptr_t)p)) {
		e = -GPX__STATUS__ENOMEM;
		goto fail;
	}
	for (int i = 0; i < ndev && e == 0; i++) {
		CUmemAccessDesc a = { { CU_MEM_LOCATION_TYPE_DEVICE, devs[i] }, CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
		CUmemAccess_flags f = CU_MEM_ACCESS_FLAGS_PROT_NONE;
		if (!(access_mask & (1u << i)))
			continue;
		/* Only where it is missing: the pool's own device has it from the start. */
		if (p_cuMemPoolGetAccess(&f, p, &a.location) == CUDA_SUCCESS && f == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
			continue;
		if ((r = p_cuMemPoolSetAccess(p, &a, 1)) != CUDA_SUCCESS)
			e = pool_refused("cuMemPoolSetAccess", r, -GPX__STATUS__EINVAL);
	}
	if (e < 0)
		goto fail;
	memcpy(x.reserved, data, sizeof(x.reserved));
	if ((r = p_cuMemPoolImportPointer(&d, p, &x)) != CUDA_SUCCESS) {
		e = pool_refused("cuMemPoolImportPointer", r, -GPX__STATUS__EINVAL);
		d = 0;
		goto fail;
	}
	if (!held_add(&held_ptrs, d)) {
		p_cuMemFree(d);
		d = 0;
		e = -GPX__STATUS__ENOMEM;
		goto fail;
	}
	/* The UUID the client named must be the memory's: the copy workers rely on it. */
	if (p_cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d) != CUDA_SUCCESS || ord != owner) {
		log_warnx("cuda: the pool allocation is not memory of the device the client named");
		e = -GPX__STATUS__EINVAL;
		goto fail;
	}
	pthread_mutex_unlock(&pool_lock);
	*dptr = d;
	*pool = (uint64_t)(uintptr_t)p;
	return 0;
fail:
	pool_put(owner, d, p);
	pthread_mutex_unlock(&pool_lock);
	return e;
}

void
cuda_pool_release(int owner, uint64_t dptr, uint64_t pool)
{
	pthread_mutex_lock(&pool_lock);
	pool_put(owner, (CUdeviceptr)dptr, (CUmemoryPool)(uintptr_t)pool);
	pthread_mutex_unlock(&pool_lock);
}

int
cuda_addr_range(uint64_t dptr, uint64_t *base, uint64_t *size)
{
	CUdeviceptr b;
	size_t n;
	int r = CU(cuMemGetAddressRange(&b, &n, (CUdeviceptr)dptr));

	*base = b;
	*size = n;
	return r;
}

/* A range of `size` bytes of this process's address space for VMM mappings. */
int
cuda_vmm_reserve(uint64_t size, uint64_t *va)
{
	CUdeviceptr d = 0;
	int r = CU(cuMemAddressReserve(&d, size, 2ull << 20, 0, 0));

	*va = d;
	return r == -GPX__STATUS__EIO ? -GPX__STATUS__EINVAL : r;
}

void
cuda_vmm_unreserve(uint64_t va, uint64_t size)
{
	CU(cuMemAddressFree((CUdeviceptr)va, size));
}

/*
 * Imports a POSIX-fd VMM handle that must be memory of device `owner`.  A refusal is the
 * client's doing (a stale or foreign fd): a warning, never a sticky exit.
 */
int
cuda_vmm_import(int owner, int fd, uint64_t *handle)
{
	CUmemGenericAllocationHandle h;
	CUmemAllocationProp prop;
	CUresult r;

	cuda_use(owner);
	r = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r != CUDA_SUCCESS) {
		log_warnx("cuda: cuMemImportFromShareableHandle refused the fd: %s", cuda_errstr(r));
		return -GPX__STATUS__EBADFD;
	}
	memset(&prop, 0, sizeof(prop));
	if (CU(cuMemGetAllocationPropertiesFromHandle(&prop, h)) < 0 ||
	    prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != devs[owner]) {
		log_warnx("cuda: the VMM handle is not memory of the device the client named");
		p_cuMemRelease(h);
		return -GPX__STATUS__EINVAL;
	}
	*handle = (uint64_t)h;
	return 0;
}

/*
 * Maps the whole of an imported handle (`size` bytes: the driver refuses anything but its
 * size) at va and grants access to every device in `access_mask`.
 */
int
cuda_vmm_map(uint64_t va, uint64_t size, uint64_t handle, uint32_t access_mask)
{
	CUmemAccessDesc acc[GPX_MAX_GPUS];
	CUresult e;
	int n = 0, r;

	if ((e = p_cuMemMap((CUdeviceptr)va, size, 0, (CUmemGenericAllocationHandle)handle, 0)) != CUDA_SUCCESS) {
		/* A size that is not the allocation's is the client's mistake. */
		log_warnx("cuda: cuMemMap of a client's VMM piece (%llu bytes): %s", (unsigned long long)size,
		    cuda_errstr(e));
		return e == CUDA_ERROR_OUT_OF_MEMORY ? -GPX__STATUS__ENOMEM : -GPX__STATUS__EINVAL;
	}
	for (int i = 0; i < ndev; i++)
		if (access_mask & (1u << i)) {
			memset(&acc[n], 0, sizeof(acc[n]));
			acc[n].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
			acc[n].location.id = devs[i];
			acc[n].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
			n++;
		}
	if ((r = CU(cuMemSetAccess((CUdeviceptr)va, size, acc, n))) < 0)
		p_cuMemUnmap((CUdeviceptr)va, size);
	return r;
}

void
cuda_vmm_unmap(uint64_t va, uint64_t size)
{
	CU(cuMemUnmap((CUdeviceptr)va, size));
}

void
cuda_vmm_release(uint64_t handle)
{
	CU(cuMemRelease((CUmemGenericAllocationHandle)handle));
}

/*
 * A dma-buf fd for the host pages around [dptr, dptr+len) of device memory (the driver takes
 * whole pages only), for RDMA registration: dptr lies *off bytes into it, and it holds *size
 * bytes.  Or minus the CUDA error code (cuda_errstr names it).  Any thread with a context
 * current.
 */
int
cuda_dmabuf(uint64_t dptr, uint64_t len, uint64_t *off, uint64_t *size)
{
	uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
	uint64_t a0 = dptr & ~(pg - 1), a1 = (dptr + len + pg - 1) & ~(pg - 1);
	int fd = -1;
	CUresult r = p_cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)a0, a1 - a0,
	    CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);

	*off = dptr - a0;
	*size = a1 - a0;
	return r == CUDA_SUCCESS ? fd : -(int)r;
}
