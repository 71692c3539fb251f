/*
 * The reload storm of tests/reload.c on GPUs: 300 reloads by SIGHUP, each waited for in the
 * log, while clients copy between device buffers by every path that reads the configuration
 * from a GPU worker: one copy of a span (copy engines), vectored copies of many small
 * segments (the SM copy kernel, whose grid is sm_copy_blocks) and page lists (the page
 * kernel).  The files move sm_copy, sm_copy_blocks and busy_poll_us, which the workers read
 * on every chunk and round, and one in 25 holds a bad value that must be refused.  Every byte
 * of the destinations is checked against a mirror kept on the host after each copy.
 *
 * Run by tests/gpu-reload.test, which skips without a GPU.  Under compute-sanitizer:
 *   compute-sanitizer --target-processes all tests/gpu/gpu-reload
 */
#include "config.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cuda.h>

#include "client-lib/gpx.h"
#include "tests/gpu/gpu-util.h"
#include "tests/harness.h"
#include "tests/reload-util.h"
#include "tests/tap.h"
#include "tests/util.h"

static struct harness H;
static CUcontext ctx[GPU_MAX];
static int ndev;
static atomic_bool storm_over;

#define STORM_RELOADS 300
#define STORM_BAD_EVERY 25
#define LEN (4u << 20)
#define PAGE 4096u
#define SEGS 1024

struct copier {
	int id, sdev, ddev;
	long copies, wrong, failed;
	char why[256];
};

static int
wait_for(gpx_conn *c, uint64_t tag)
{
	struct gpx_completion e;
	int r = gpx_wait_tag(c, tag, &e, 120000);

	return r < 0 ? r : e.status;
}

static void *
copier_main(void *arg)
{
	struct copier *w = arg;
	uint64_t seed = 0x9e3779b97f4a7c15ULL * (w->id + 1);
	struct gpx_seg *segs = calloc(SEGS, sizeof(*segs));
	uint32_t *sp = calloc(LEN / PAGE, sizeof(*sp)), *dp = calloc(LEN / PAGE, sizeof(*dp));
	unsigned char *want = calloc(1, LEN);
	struct dbuf s, d;
	gpx_conn *c;

	if (segs == NULL || sp == NULL || dp == NULL || want == NULL || gpx_connect(H.sock, "gpu-reload", &c) < 0) {
		snprintf(w->why, sizeof(w->why), "setup");
		w->failed++;
		return NULL;
	}
	dbuf_new(&s, c, ctx[w->sdev], w->sdev, LEN, false, &seed);
	dbuf_new(&d, c, ctx[w->ddev], w->ddev, LEN, w->id % 2 == 1, NULL);
	for (uint64_t tag = 1; !atomic_load(&storm_over); tag++) {
		int r = 0;
		switch (tag % 3) {
		case 0: {
			/* one span: copy engines */
			uint64_t len = 1 + xorshift(&seed) % LEN;
			uint64_t so = xorshift(&seed) % (LEN - len + 1), dof = xorshift(&seed) % (LEN - len + 1);
			r = gpx_copy(c, s.r, so, d.r, dof, len, tag);
			if (r >= 0 && (r = wait_for(c, tag)) == 0)
				memcpy(want + dof, s.host + so, len);
			break;
		}
		case 1:
			/* many small segments, disjoint at the destination: the SM copy kernel */
			for (int i = 0; i < SEGS; i++) {
				uint64_t len = 1 + xorshift(&seed) % 2048;
				segs[i] = (struct gpx_seg){ xorshift(&seed) % (LEN - len), (uint64_t)i * (LEN / SEGS), len };
			}
			r = gpx_copyv(c, s.r, d.r, segs, SEGS, tag);
			if (r >= 0 && (r = wait_for(c, tag)) == 0)
				for (int i = 0; i < SEGS; i++)
					memcpy(want + segs[i].dst_offset, s.host + segs[i].src_offset, segs[i].length);
			break;
		default: {
			/* a page list, shuffled both ways: the page kernel */
			uint32_t n = LEN / PAGE;
			for (uint32_t i = 0; i < n; i++)
				sp[i] = dp[i] = i;
			for (uint32_t i = n - 1; i > 0; i--) {
				uint32_t j = xorshift(&seed) % (i + 1), k = xorshift(&seed) % (i + 1), x = sp[i];
				sp[i] = sp[j];
				sp[j] = x;
				x = dp[i];
				dp[i] = dp[k];
				dp[k] = x;
			}
			n = 1 + xorshift(&seed) % n;
			r = gpx_copy_pages(c, s.r, 0, d.r, 0, PAGE, sp, dp, n, tag);
			if (r >= 0 && (r = wait_for(c, tag)) == 0)
				for (uint32_t i = 0; i < n; i++)
					memcpy(want + (size_t)dp[i] * PAGE, s.host + (size_t)sp[i] * PAGE, PAGE);
			break;
		}
		}
		if (r < 0) {
			if (w->failed++ == 0)
				snprintf(w->why, sizeof(w->why), "%s: %s", gpx_strerror(r), gpx_last_error(c));
			continue;
		}
		w->copies++;
		if (!dbuf_holds(&d, want))
			w->wrong++;
	}
	dbuf_free(c, &s);
	dbuf_free(c, &d);
	gpx_close(c);
	free(segs);
	free(sp);
	free(dp);
	free(want);
	return NULL;
}

static void
storm_file(int i)
{
	char text[512];

	/* (the harness's file ends in [cuda]: the daemon's keys need their section named) */
	snprintf(text, sizeof(text),
	    "[daemon]\n"
	    "busy_poll_us = %d\n"
	    "%s"
	    "[cuda]\n"
	    "trust_legacy_ipc = yes\n"
	    "sm_copy = %s\n"
	    "sm_copy_blocks = %d\n",
	    (i % 4) * 2500, i % STORM_BAD_EVERY == STORM_BAD_EVERY - 1 ? "log_level = shouting\n" : "",
	    i % 5 == 4 ? "no" : "yes", 1 + (i * 37) % 128);
	reload_write(&H, text);
}

/*
 * One thread polls, not two: while the loop polls after a client's message (busy_poll_us), a
 * GPU's worker with nothing to do waits for a request for its GPU instead of spinning beside
 * the loop.  Over the second after one copy within GPU0, with the loop polling all of it, gpxd
 * takes about one core (100 ticks) where both spinning took two; and as much over 0.9 s of
 * status queries right after a copy, one after another: a client's messages that are not
 * requests for the GPU wake no worker.
 */
static void
test_one_spinner(void)
{
	int seen = reload_count(&H);
	uint64_t seed = 7;
	struct dbuf s, d;
	gpx_conn *c;

	reload_write(&H, "[daemon]\nbusy_poll_us = 1000000\n[cuda]\ntrust_legacy_ipc = yes\n");
	if (!reload_hup(&H, &seen) || reload_refused(&H, "busy_poll_us") != 0 || gpx_connect(H.sock, "spinner", &c) < 0)
		tap_bail("one spinner: setup");
	dbuf_new(&s, c, ctx[0], 0, 1 << 20, false, &seed);
	dbuf_new(&d, c, ctx[0], 0, 1 << 20, false, NULL);
	/* a second after the copy's request, and again after the next (the worker woken for it) */
	long ticks[2];
	bool right = true;
	for (int i = 0; i < 2; i++) {
		int r = gpx_copy(c, s.r, 0, d.r, 0, 4096 << i, 1 + i);
		right = right && r >= 0 && wait_for(c, 1 + i) == 0;
		long t0 = reload_cpu_ticks(&H);
		usleep(1000000);
		ticks[i] = reload_cpu_ticks(&H) - t0;
	}
	memcpy(d.host, s.host, 8192);
	right = right && dbuf_holds(&d, d.host);
	ok(right, "one spinner: two copies within GPU0, a second apart, each byte right");
	/* the loop polls the whole second (it takes what CPU it gets: on a loaded machine less) */
	ok(ticks[0] >= 0 && ticks[0] <= 140 && ticks[1] >= 0 && ticks[1] <= 140, "one spinner: gpxd's CPU over "
	    "the second after each copy, the loop polling: %ld and %ld ticks (one core: 100)", ticks[0], ticks[1]);
	/* a copy, then queries for as long as the worker would spin after it (busy_poll_us) */
	right = gpx_copy(c, s.r, 0, d.r, 0, 4096, 3) >= 0 && wait_for(c, 3) == 0;
	long q = 0, t0 = reload_cpu_ticks(&H);
	for (double end = now() + 0.9; now() < end; q++) {
		void *buf;
		size_t len;
		if (gpx_query(c, GPX_Q_STATUS, &buf, &len) < 0)
			break;
		free(buf);
	}
	long qt = reload_cpu_ticks(&H) - t0;
	ok(right && q > 100 && qt >= 0 && qt <= 130, "one spinner: %ld status queries in the 0.9 s after a copy cost "
	    "gpxd %ld ticks (one core: 90): they wake no copy worker", q, qt);
	dbuf_free(c, &s);
	dbuf_free(c, &d);
	gpx_close(c);
}

int
main(void)
{
	struct copier w[4] = { 0 };
	pthread_t t[4];
	int nw, seen, start, lost;
	long copies = 0, wrong = 0, failed = 0;

	setvbuf(stdout, NULL, _IOLBF, 0);
	signal(SIGPIPE, SIG_IGN);
	ndev = gpu_contexts(ctx);
	if (ndev == 0) {
		printf("1..0 # SKIP no GPU\n");
		return 0;
	}
	/* the copiers' sources are cudaMalloc memory, registered by legacy handle */
	if (harness_start(&H, "[cuda]\ntrust_legacy_ipc = yes\n") < 0)
		tap_bail("cannot start gpxd");
	reload_init(&H);
	seen = start = reload_count(&H);

	/* within one GPU, and (with two) from one to the other */
	nw = ndev > 1 ? 4 : 2;
	for (int i = 0; i < nw; i++) {
		w[i] = (struct copier){ .id = i, .sdev = 0, .ddev = i < 2 ? 0 : 1 };
		if (pthread_create(&t[i], NULL, copier_main, &w[i]) != 0)
			tap_bail("pthread_create");
	}
	lost = reload_storm(&H, &seen, STORM_RELOADS, storm_file);
	atomic_store(&storm_over, true);
	for (int i = 0; i < nw; i++) {
		pthread_join(t[i], NULL);
		copies += w[i].copies;
		wrong += w[i].wrong;
		failed += w[i].failed;
		if (w[i].failed)
			diag("copier %d (GPU%d to GPU%d): %ld failed, first: %s", i, w[i].sdev, w[i].ddev, w[i].failed,
			    w[i].why);
	}
	ok(lost == 0 && seen - start == STORM_RELOADS, "GPU storm: %d reloads by SIGHUP, each answered in the log "
	    "(%d answered, %d lost)", STORM_RELOADS, seen - start, lost);
	ok(copies > 0 && wrong == 0 && failed == 0, "GPU storm: %ld copies (spans, %d segments, page lists) "
	    "during the reloads, %ld with wrong bytes, %ld failed", copies, SEGS, wrong, failed);
	int refused = reload_refused(&H, "reload refused");
	ok(refused == STORM_RELOADS / STORM_BAD_EVERY && reload_refused(&H, "daemon.log_level") == refused,
	    "GPU storm: the %d bad files were refused, naming the key, and no other (%d)", STORM_RELOADS /
	    STORM_BAD_EVERY, refused);
	test_one_spinner();
	ok(harness_clients(&H) == 1, "GPU storm: gpxd still answers, with no client left");
	ok(harness_stop(&H) == 0, "gpxd stops cleanly");
	if (tap_failed)
		harness_dump_log(&H);
	harness_cleanup(&H);
	return tap_done();
}
