/*
 * A probe, not a test: how long a thread asleep on a condition variable takes to run once
 * another thread signals it, by how long it had slept, and whether it slept in one wait or in
 * timed waits of a slice that end and begin again.  The signalling thread keeps its CPU busy
 * meanwhile, as gpxd's polling loop does.  On the machine where gpxd's GPU figures were taken,
 * a thread asleep 1 ms woke in 21 us (p50), one asleep 100 us in 6, and one that waits in
 * slices of 100 us in 7-8 whatever it had slept: a CPU left idle longer sinks into a deeper
 * sleep state.  A GPU's idle worker (engine_idle) was tried that way, and does not wait so:
 * see there.
 *
 *   wake-probe [samples]
 */
#include "config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond;
static bool flag;
static int slice_us;
static _Atomic uint64_t woke_at;

static uint64_t
now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static void *
sleeper(void *unused)
{
	(void)unused;
	for (;;) {
		pthread_mutex_lock(&lock);
		while (!flag) {
			if (slice_us == 0) {
				pthread_cond_wait(&cond, &lock);
				continue;
			}
			struct timespec t;
			clock_gettime(CLOCK_MONOTONIC, &t);
			t.tv_nsec += slice_us * 1000L;
			if (t.tv_nsec >= 1000000000L) {
				t.tv_sec++;
				t.tv_nsec -= 1000000000L;
			}
			pthread_cond_timedwait(&cond, &lock, &t);
		}
		flag = false;
		pthread_mutex_unlock(&lock);
		atomic_store(&woke_at, now_ns());
	}
	return NULL;
}

static int
cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

int
main(int argc, char **argv)
{
	static const int slices[] = { 0, 50, 100 }, asleep[] = { 5, 20, 50, 100, 200, 500, 1000, 2000 };
	int n = argc > 1 ? atoi(argv[1]) : 300;
	double *d = malloc((n > 0 ? n : 1) * sizeof(*d));
	pthread_condattr_t ca;
	pthread_t t;

	if (n < 10 || d == NULL)
		return 2;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&cond, &ca);
	if (pthread_create(&t, NULL, sleeper, NULL) != 0)
		return 1;
	printf("wake-up of a thread asleep on a condition variable, signalled by a busy thread (%d samples each)\n", n);
	for (size_t s = 0; s < sizeof(slices) / sizeof(*slices); s++) {
		slice_us = slices[s];
		for (size_t a = 0; a < sizeof(asleep) / sizeof(*asleep); a++) {
			for (int i = 0; i < n; i++) {
				uint64_t t0 = now_ns();
				while (now_ns() - t0 < asleep[a] * 1000ull)
					;
				atomic_store(&woke_at, 0);
				uint64_t w = now_ns();
				pthread_mutex_lock(&lock);
				flag = true;
				pthread_cond_signal(&cond);
				pthread_mutex_unlock(&lock);
				while (atomic_load(&woke_at) == 0)
					;
				d[i] = (atomic_load(&woke_at) - w) / 1e3;
			}
			qsort(d, n, sizeof(*d), cmp);
			char how[32];
			snprintf(how, sizeof(how), slices[s] ? "waits of %d us" : "one wait", slices[s]);
			printf("  %-15s asleep %5d us: p50 %6.1f us  p90 %6.1f  p99 %6.1f\n", how, asleep[a], d[n / 2],
			    d[n * 9 / 10], d[n * 99 / 100]);
		}
	}
	free(d);
	return 0;
}
