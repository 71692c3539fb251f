/*
 * gpx-bench-gpu's all-to-all mode: node-wide scheduling seen from the clients.
 *
 * N GPUs, M client processes per GPU.  Each client holds a source buffer on its GPU and a
 * destination buffer on every other GPU (on a one-GPU node: one more on its own), and copies
 * its source to all of them at once, keeping `depth` copies outstanding per destination, for a
 * fixed window.  The same processes and the same memory do it twice per size, back to back:
 * direct (the client's own cuMemcpyAsync between UVA pointers, cuMemcpyPeerAsync across
 * devices, on a stream of its own per destination) and through gpxd (gpx_copy).  A probe
 * process meanwhile copies 4 KiB from GPU0 to GPU1 (or within GPU0), one at a time, and times
 * each copy from submit to completion seen.
 *
 * Per size it prints the aggregate bandwidth of all clients, Jain's fairness index of the
 * clients' rates ((sum x)^2 / (n sum x^2): 1 when all got the same, 1/n when one got it all)
 * and the probe's p99.  Every phase writes a pattern of its own into the sources first and
 * checks the head and tail of every destination afterwards.
 *
 * Clients are separate processes, as on a real node: the mode re-executes this program with
 * GPX_BENCH_A2A set, and the constructor below runs the client instead of main().
 *
 *   GPX_BENCH_A2A_GPUS     GPUs used (default: all)
 *   GPX_BENCH_A2A_CLIENTS  client processes per GPU (default 4)
 *   GPX_BENCH_A2A_DEPTH    copies outstanding per client and destination (default 2)
 *   GPX_BENCH_A2A_SIZES    copy sizes (default 256K,4M,64M,256M,1G; capped by --max-size)
 *   GPX_BENCH_A2A_TIME     seconds per phase (default 1)
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
#include <cuda.h>

#include "tests/bench.h"
#include "tests/bench-gpu.h"

#define A2A_CMD_FD 100           /* where a client finds its pipes after exec */
#define A2A_RES_FD 101
#define A2A_MAX_SIZES 16
#define A2A_PROBE_LEN 4096
#define A2A_PROBE_MAX (1 << 20)  /* probe samples kept per phase */

enum { OP_RUN = 1, OP_QUIT };
enum { MSG_READY = 1, MSG_DONE };

struct a2a_cmd {
	int op;
	int gpx;                 /* through gpxd, or the client's own copies */
	uint32_t pattern;        /* this phase's source word */
	uint64_t size;           /* 0: the load clients sit this phase out */
	double start, end;       /* CLOCK_MONOTONIC: the window */
};

/* Written whole to the shared result pipe (well under PIPE_BUF, so never interleaved). */
struct a2a_msg {
	int type;
	int id;                  /* client index; -1: the probe */
	int err;                 /* 0, or what went wrong (errno-style or GPX_E*) */
	char what[64];           /* with err: where */
	uint64_t bytes, copies;  /* completed in the phase */
	double t0, t1;           /* the window as the client saw it: start, last completion */
	double p50, p99, pmax;   /* the probe: microseconds */
};

/* ---- a client process ---- */

struct client {
	int id, gpu, ndst;
	bool probe;
	unsigned depth;
	uint64_t max;
	CUcontext ctx;
	struct gbuf src, dst[BENCH_GPUS];
	CUstream s[BENCH_GPUS];
	CUevent ev[BENCH_GPUS][8];
	gpx_conn *conn;
	double *lat;
};

static bool
ck(CUresult r, struct a2a_msg *m, const char *what)
{
	if (r == CUDA_SUCCESS)
		return true;
	m->err = (int)r;
	snprintf(m->what, sizeof(m->what), "%s", what);
	return false;
}

static void
say(const struct a2a_msg *m)
{
	if (write(A2A_RES_FD, m, sizeof(*m)) != sizeof(*m))
		_exit(3);
}

static int
client_setup(struct client *c, const char *socket, int ngpu, struct a2a_msg *m)
{
	CUdevice dev;
	int r;

	if (!ck(cuInit(0), m, "cuInit") || !ck(cuDeviceGet(&dev, c->gpu), m, "cuDeviceGet") ||
	    !ck(cuDevicePrimaryCtxRetain(&c->ctx, dev), m, "cuDevicePrimaryCtxRetain") ||
	    !ck(cuCtxSetCurrent(c->ctx), m, "cuCtxSetCurrent"))
		return -1;
	/* Only this client's own context, as a program that uses one GPU has; the buffers on the
	 * other GPUs are VMM allocations placed there and mapped for every device. */
	bench_gpu_adopt(c->gpu, c->ctx, ngpu);
	if (gbuf_alloc(c->gpu, c->max, &c->src) < 0) {
		snprintf(m->what, sizeof(m->what), "source buffer");
		return m->err = -1;
	}
	for (int t = 0; t < c->ndst; t++) {
		int to = ngpu == 1 ? c->gpu : (c->gpu + 1 + t) % ngpu;
		if (c->probe)
			to = ngpu == 1 ? 0 : 1;
		if (gbuf_alloc(to, c->max, &c->dst[t]) < 0) {
			snprintf(m->what, sizeof(m->what), "destination buffer on GPU%d", to);
			return m->err = -1;
		}
		if (!ck(cuStreamCreate(&c->s[t], CU_STREAM_NON_BLOCKING), m, "cuStreamCreate"))
			return -1;
		for (unsigned q = 0; q < c->depth; q++)
			if (!ck(cuEventCreate(&c->ev[t][q], CU_EVENT_DISABLE_TIMING), m, "cuEventCreate"))
				return -1;
	}
	if ((r = gpx_connect(socket, c->probe ? "a2a-probe" : "a2a-client", &c->conn)) < 0 ||
	    (r = gpx_register_cuda(c->conn, (void *)c->src.d, c->src.len, 0, &c->src.region)) < 0) {
		snprintf(m->what, sizeof(m->what), "gpx_connect/register: %s", gpx_strerror(r));
		return m->err = r;
	}
	for (int t = 0; t < c->ndst; t++)
		if ((r = gpx_register_cuda(c->conn, (void *)c->dst[t].d, c->dst[t].len, 0, &c->dst[t].region)) < 0) {
			snprintf(m->what, sizeof(m->what), "gpx_register_cuda: %s", gpx_strerror(r));
			return m->err = r;
		}
	if (c->probe && (c->lat = malloc(A2A_PROBE_MAX * sizeof(double))) == NULL)
		return m->err = -ENOMEM;
	return 0;
}

/* Did the copies land: the head and the tail of [0, len) of every destination. */
static bool
client_check(struct client *c, uint64_t len, uint32_t pattern, struct a2a_msg *m)
{
	static uint32_t w[1024];
	uint64_t n = len < sizeof(w) ? len : sizeof(w);

	for (int t = 0; t < c->ndst; t++)
		for (int end = 0; end < 2; end++) {
			if (!ck(cuMemcpyDtoH(w, c->dst[t].d + (end ? len - n : 0), n), m, "cuMemcpyDtoH"))
				return false;
			for (uint64_t i = 0; i < n / 4; i++)
				if (w[i] != pattern) {
					m->err = -EIO;
					snprintf(m->what, sizeof(m->what), "destination %d word %llu: %08x, not %08x",
					    t, (unsigned long long)((end ? len - n : 0) / 4 + i), w[i], pattern);
					return false;
				}
		}
	return true;
}

static void
spin_until(double t)
{
	while (bench_now() < t)
		;
}

/* The load: depth copies outstanding per destination, each on its own stream. */
static void
load_direct(struct client *c, const struct a2a_cmd *k, struct a2a_msg *m)
{
	unsigned head[BENCH_GPUS] = { 0 }, n[BENCH_GPUS] = { 0 };

	m->t0 = bench_now();
	for (;;) {
		bool more = bench_now() < k->end, busy = false;
		for (int t = 0; t < c->ndst; t++) {
			if (n[t] == c->depth || (!more && n[t] > 0)) {
				if (!ck(cuEventSynchronize(c->ev[t][head[t]]), m, "cuEventSynchronize"))
					return;
				head[t] = (head[t] + 1) % c->depth;
				n[t]--;
				m->bytes += k->size;
			}
			if (more) {
				unsigned q = (head[t] + n[t]) % c->depth;
				if (!ck(cuMemcpyAsync(c->dst[t].d, c->src.d, k->size, c->s[t]), m, "cuMemcpyAsync") ||
				    !ck(cuEventRecord(c->ev[t][q], c->s[t]), m, "cuEventRecord"))
					return;
				n[t]++;
				m->copies++;
			}
			busy |= n[t] > 0;
		}
		if (!more && !busy)
			break;
	}
	m->t1 = bench_now();
}

static void
load_gpx(struct client *c, const struct a2a_cmd *k, struct a2a_msg *m)
{
	unsigned cap = c->depth * c->ndst, out = 0;
	uint64_t tag = 0;
	int t = 0, r;
	struct gpx_completion done[64];

	m->t0 = bench_now();
	for (;;) {
		bool more = bench_now() < k->end;
		while (more && out < cap) {
			if ((r = gpx_copy(c->conn, c->src.region, 0, c->dst[t].region, 0, k->size, ++tag)) < 0)
				goto fail;
			t = (t + 1) % c->ndst;
			out++;
			m->copies++;
		}
		if (out == 0)
			break;
		if ((r = gpx_wait(c->conn, done, 64, 10000)) <= 0) {
			r = r == 0 ? -ETIMEDOUT : r;
			goto fail;
		}
		for (int i = 0; i < r; i++) {
			if (done[i].status < 0) {
				r = done[i].status;
				goto fail;
			}
			m->bytes += done[i].bytes;
		}
		out -= r;
	}
	m->t1 = bench_now();
	return;
fail:
	m->err = r;
	snprintf(m->what, sizeof(m->what), "gpx_copy/gpx_wait: %s", gpx_strerror(r));
}

static int
cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* The probe: one 4 KiB copy at a time, submit to completion seen, for the whole window. */
static void
probe(struct client *c, const struct a2a_cmd *k, struct a2a_msg *m)
{
	size_t n = 0;
	struct gpx_completion done;
	uint64_t tag = 0;
	int r;

	m->t0 = bench_now();
	while (bench_now() < k->end) {
		double t0 = bench_now();
		if (k->gpx) {
			if ((r = gpx_copy(c->conn, c->src.region, 0, c->dst[0].region, 0, A2A_PROBE_LEN, ++tag)) < 0)
				goto fail;
			while ((r = gpx_poll(c->conn, &done, 1)) == 0)
				;
			if (r < 0 || (r = done.status) < 0)
				goto fail;
		} else if (!ck(cuMemcpyAsync(c->dst[0].d, c->src.d, A2A_PROBE_LEN, c->s[0]), m, "cuMemcpyAsync") ||
		    !ck(cuStreamSynchronize(c->s[0]), m, "cuStreamSynchronize"))
			return;
		if (n < A2A_PROBE_MAX)
			c->lat[n++] = (bench_now() - t0) * 1e6;
		m->bytes += A2A_PROBE_LEN;
		m->copies++;
	}
	m->t1 = bench_now();
	if (n > 0) {
		qsort(c->lat, n, sizeof(double), cmp_d);
		m->p50 = c->lat[n / 2];
		m->p99 = c->lat[(size_t)(n * 0.99)];
		m->pmax = c->lat[n - 1];
	}
	return;
fail:
	m->err = r;
	snprintf(m->what, sizeof(m->what), "probe: %s", gpx_strerror(r));
}

static int
client_main(const char *role)
{
	struct client c = { 0 };
	struct a2a_msg m = { .type = MSG_READY };
	struct a2a_cmd k;
	unsigned long long max;
	int ngpu;
	const char *socket = getenv("GPX_BENCH_A2A_SOCKET");

	if (sscanf(role, "%d %d %d %u %llu", &c.id, &c.gpu, &ngpu, &c.depth, &max) != 5 || socket == NULL ||
	    ngpu < 1 || ngpu > BENCH_GPUS || c.depth < 1 || c.depth > 8)
		return 2;
	unsetenv("GPX_BENCH_GPU_MEM");   /* the other GPUs' buffers need VMM: no context there */
	c.probe = c.id < 0;
	c.max = c.probe ? A2A_PROBE_LEN : max;
	c.ndst = c.probe || ngpu == 1 ? 1 : ngpu - 1;
	m.id = c.id;
	client_setup(&c, socket, ngpu, &m);
	say(&m);
	if (m.err)
		return 1;
	while (read(A2A_CMD_FD, &k, sizeof(k)) == sizeof(k) && k.op == OP_RUN) {
		m = (struct a2a_msg){ .type = MSG_DONE, .id = c.id };
		uint64_t len = c.probe ? A2A_PROBE_LEN : k.size;
		if (len > 0 && (!ck(cuMemsetD32(c.src.d, k.pattern, len / 4), &m, "cuMemsetD32") ||
		    !ck(cuCtxSynchronize(), &m, "cuCtxSynchronize")))
			goto out;
		spin_until(k.start);
		if (c.probe)
			probe(&c, &k, &m);
		else if (k.size == 0)
			m.t0 = m.t1 = k.start;
		else if (k.gpx)
			load_gpx(&c, &k, &m);
		else
			load_direct(&c, &k, &m);
		if (m.err == 0 && len > 0)
			client_check(&c, len, k.pattern, &m);
out:
		say(&m);
	}
	gpx_close(c.conn);
	return 0;
}

/* A client is this program run again with GPX_BENCH_A2A set: it never reaches main(). */
__attribute__((constructor)) static void
a2a_client_entry(void)
{
	const char *role = getenv("GPX_BENCH_A2A");

	if (role != NULL)
		_exit(client_main(role));
}

/* ---- the mode: starts the clients and runs the phases ---- */

struct a2a {
	struct bench_ctx *b;
	int ngpu, per, nclients;     /* load clients: ngpu * per; the probe is one more */
	pid_t pid[BENCH_GPUS * 64 + 1];
	int cmd[BENCH_GPUS * 64 + 1];
	int res;                     /* the read end of the shared result pipe */
	int nproc;
	double window;
	uint32_t phase;
};

static long
env_long(const char *name, long def, long lo, long hi)
{
	const char *s = getenv(name);
	char *end;
	long v;

	if (s == NULL || *s == '\0')
		return def;
	v = strtol(s, &end, 10);
	if (*end != '\0' || v < lo || v > hi) {
		fprintf(stderr, "gpx-bench-gpu: %s=%s: not a number in [%ld, %ld]; using %ld\n", name, s, lo, hi, def);
		return def;
	}
	return v;
}

static int
a2a_spawn(struct a2a *a, int id, int gpu, unsigned depth, uint64_t max, int res_w)
{
	extern char **environ;
	char role[128], sock[400];
	size_t n = 0;
	int p[2];

	while (environ[n] != NULL)
		n++;
	char **envp = calloc(n + 3, sizeof(char *));
	if (envp == NULL || pipe2(p, O_CLOEXEC) < 0) {
		free(envp);
		return -1;
	}
	snprintf(role, sizeof(role), "GPX_BENCH_A2A=%d %d %d %u %llu", id, gpu, a->ngpu, depth,
	    (unsigned long long)max);
	snprintf(sock, sizeof(sock), "GPX_BENCH_A2A_SOCKET=%s", a->b->socket);
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		if (strncmp(environ[i], "GPX_BENCH_A2A=", 14) != 0 && strncmp(environ[i], "GPX_BENCH_A2A_SOCKET=", 21) != 0)
			envp[k++] = environ[i];
	envp[k++] = role;
	envp[k++] = sock;
	envp[k] = NULL;
	pid_t pid = fork();
	if (pid == 0) {
		if (dup2(p[0], A2A_CMD_FD) < 0 || dup2(res_w, A2A_RES_FD) < 0)
			_exit(127);
		char *argv[] = { "gpx-bench-gpu", NULL };
		execve("/proc/self/exe", argv, envp);
		_exit(127);
	}
	free(envp);
	close(p[0]);
	if (pid < 0) {
		close(p[1]);
		return -1;
	}
	a->pid[a->nproc] = pid;
	a->cmd[a->nproc++] = p[1];
	return 0;
}

/* Reads one message per process, or gives up after `wait` seconds. */
static int
a2a_collect(struct a2a *a, struct a2a_msg *out, double wait)
{
	double until = bench_now() + wait;

	for (int got = 0; got < a->nproc;) {
		struct pollfd pf = { .fd = a->res, .events = POLLIN };
		int left = (int)((until - bench_now()) * 1000);
		if (left <= 0 || poll(&pf, 1, left) <= 0) {
			fprintf(stderr, "gpx-bench-gpu: gpu-all2all: %d of %d clients answered in %.0f s\n",
			    got, a->nproc, wait);
			return -1;
		}
		ssize_t r = read(a->res, &out[got], sizeof(*out));
		if (r != sizeof(*out)) {
			fprintf(stderr, "gpx-bench-gpu: gpu-all2all: a client went away\n");
			return -1;
		}
		if (out[got].err) {
			fprintf(stderr, "gpx-bench-gpu: gpu-all2all: client %d: %s (%d)\n", out[got].id,
			    out[got].what, out[got].err);
			return -1;
		}
		got++;
	}
	return 0;
}

static void
a2a_stop(struct a2a *a)
{
	struct a2a_cmd q = { .op = OP_QUIT };

	for (int i = 0; i < a->nproc; i++) {
		if (write(a->cmd[i], &q, sizeof(q)) != sizeof(q))
			kill(a->pid[i], SIGKILL);
		close(a->cmd[i]);
	}
	for (int i = 0; i < a->nproc; i++)
		waitpid(a->pid[i], NULL, 0);
	close(a->res);
}

struct a2a_fig {
	double gbps, jain, p50, p99, pmax;
};

static int
a2a_phase(struct a2a *a, uint64_t size, bool gpx, struct a2a_msg *msg, struct a2a_fig *f)
{
	double start = bench_now() + 0.1;   /* room for the clients' pattern fill */
	struct a2a_cmd k = { .op = OP_RUN, .gpx = gpx, .size = size, .start = start,
		.end = start + a->window, .pattern = 0x9e000000u | (++a->phase & 0xffffff) };

	for (int i = 0; i < a->nproc; i++)
		if (write(a->cmd[i], &k, sizeof(k)) != sizeof(k))
			return -1;
	if (a2a_collect(a, msg, a->window + 120) < 0)
		return -1;
	double sum = 0, sq = 0, bytes = 0, last = start;
	for (int i = 0; i < a->nproc; i++) {
		struct a2a_msg *m = &msg[i];
		if (m->id < 0) {
			f->p50 = m->p50;
			f->p99 = m->p99;
			f->pmax = m->pmax;
			continue;
		}
		double x = m->t1 > m->t0 ? m->bytes / (m->t1 - m->t0) : 0;
		sum += x;
		sq += x * x;
		bytes += m->bytes;
		if (m->t1 > last)
			last = m->t1;
	}
	f->gbps = size ? bytes / (last - start) / 1e9 : NAN;
	f->jain = size && sq > 0 ? sum * sum / (a->nclients * sq) : NAN;
	return 0;
}

static void
a2a_row(struct bench_ctx *b, const char *what, const char *metric, double d, double g, bool lower, uint64_t bytes,
    const char *target)
{
	struct bench_row r = { .what = what, .metric = metric, .direct = d, .gpx = g,
		.lower_is_better = lower, .bytes = bytes, .target = target };
	bench_table_row(b, &r);
}

static int
mode_all2all(struct bench_ctx *b)
{
	int have = 0;
	uint64_t sizes[A2A_MAX_SIZES];
	int nsizes = 0;

	if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&have) != CUDA_SUCCESS || have < 1) {
		bench_skip(b, "gpu-all2all", "needs a GPU");
		return BENCH_SKIP;
	}
	struct a2a a = { .b = b };
	a.ngpu = (int)env_long("GPX_BENCH_A2A_GPUS", have < BENCH_GPUS ? have : BENCH_GPUS, 1,
	    have < BENCH_GPUS ? have : BENCH_GPUS);
	a.per = (int)env_long("GPX_BENCH_A2A_CLIENTS", 4, 1, 64);
	a.nclients = a.ngpu * a.per;
	unsigned depth = (unsigned)env_long("GPX_BENCH_A2A_DEPTH", 2, 1, 8);
	a.window = env_long("GPX_BENCH_A2A_TIME", 1, 1, 600);
	const char *list = getenv("GPX_BENCH_A2A_SIZES");
	char buf[256];
	snprintf(buf, sizeof(buf), "%s", list != NULL && *list ? list : "256K,4M,64M,256M,1G");
	sizes[nsizes++] = 0;    /* the probe alone */
	for (char *sv, *s = strtok_r(buf, ",", &sv); s != NULL && nsizes < A2A_MAX_SIZES; s = strtok_r(NULL, ",", &sv)) {
		uint64_t v;
		if (bench_parse_size(s, &v) < 0 || v < 4096 || v % 4096) {
			fprintf(stderr, "gpx-bench-gpu: GPX_BENCH_A2A_SIZES: %s is not a multiple of 4 KiB\n", s);
			return -1;
		}
		if (v <= b->max_size)
			sizes[nsizes++] = v;
	}
	uint64_t max = 4096;
	for (int i = 0; i < nsizes; i++)
		max = sizes[i] > max ? sizes[i] : max;

	int p[2];
	if (pipe2(p, O_CLOEXEC) < 0)
		return bench_fail(b, -errno, "pipe2");
	a.res = p[0];
	for (int g = 0; g < a.ngpu; g++)
		for (int i = 0; i < a.per; i++)
			if (a2a_spawn(&a, g * a.per + i, g, depth, max, p[1]) < 0)
				goto fail;
	if (a2a_spawn(&a, -1, 0, 1, A2A_PROBE_LEN, p[1]) < 0)
		goto fail;
	close(p[1]);
	p[1] = -1;

	struct a2a_msg *msg = calloc(a.nproc, sizeof(*msg));
	if (msg == NULL || a2a_collect(&a, msg, 300) < 0) {
		free(msg);
		goto fail;
	}
	char title[300], what[64], sz[32], mpsdir[256];
	bool mps = bench_under_mps(mpsdir, sizeof(mpsdir));
	snprintf(title, sizeof(title), "%d GPU%s x %d client processes each%s, %u copies outstanding per "
	    "destination, %.0f s per phase; a 4 KiB probe GPU0 -> GPU%d; %s", a.ngpu, a.ngpu > 1 ? "s" : "",
	    a.per, a.ngpu > 1 ? ", every client to every other GPU" : ", within the GPU", depth, a.window,
	    a.ngpu > 1 ? 1 : 0, mps ? "UNDER CUDA MPS (clients, probe and gpxd)" : "without CUDA MPS (time-sliced contexts)");
	bench_table_begin(b, "gpu-all2all", title);
	for (int i = 0; i < nsizes; i++) {
		struct a2a_fig d = { 0 }, g = { 0 };
		if (a2a_phase(&a, sizes[i], false, msg, &d) < 0 || a2a_phase(&a, sizes[i], true, msg, &g) < 0) {
			free(msg);
			goto fail;
		}
		const char *s = sizes[i] ? bench_size_str(sizes[i], sz, sizeof(sz)) : "no load";
		if (sizes[i]) {
			snprintf(what, sizeof(what), "%s aggregate", s);
			a2a_row(b, what, "GB/s", d.gbps, g.gbps, false, sizes[i],
			    sizes[i] >= (256u << 10) ? "gpu.all2all.aggregate" : NULL);
			snprintf(what, sizeof(what), "%s fairness", s);
			a2a_row(b, what, "Jain index", d.jain, g.jain, false, sizes[i], "gpu.all2all.fairness");
		}
		snprintf(what, sizeof(what), "%s, 4 KiB probe", s);
		a2a_row(b, what, "p50 us", d.p50, g.p50, true, A2A_PROBE_LEN, NULL);
		a2a_row(b, what, "p99 us", d.p99, g.p99, true, A2A_PROBE_LEN,
		    sizes[i] > 0 ? "gpu.probe.p99" : NULL);    /* under every load */
		a2a_row(b, what, "max us", d.pmax, g.pmax, true, A2A_PROBE_LEN, NULL);
	}
	bench_table_end(b, "direct: the same client processes copying with their own cuMemcpyAsync; every "
	    "phase's copies checked at both ends");
	free(msg);
	a2a_stop(&a);
	return 0;
fail:
	if (p[1] >= 0)
		close(p[1]);
	a2a_stop(&a);
	return -1;
}

static const struct bench_mode a2a_modes[] = {
	{ "gpu-all2all", "N GPUs x M client processes copying to every other GPU: aggregate, fairness, "
	    "4 KiB p99 under load", mode_all2all },
};
BENCH_MODES(a2a_modes)
