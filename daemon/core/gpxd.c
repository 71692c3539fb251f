/*
 * What every layer may read of the daemon itself: its clock, when it started, the socket it
 * serves, and how long the event loop's turns take.  levent.c sets the start and the socket at
 * start, before any client is admitted.
 */
#include "config.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/prctl.h>

#include "daemon/gpxd.h"

double gpxd_start_time;
const char *gpxd_socket_path = "";

void
thread_name(const char *fmt, ...)
{
	char name[16] = "gpxd-";     /* the kernel keeps 15 characters */
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(name + 5, sizeof(name) - 5, fmt, ap);
	va_end(ap);
	prctl(PR_SET_NAME, name);
}

/*
 * The loop's naps.  While clients keep sending, the loop polls without sleeping (daemon.
 * busy_poll_us); while they only wait for copies in flight, it naps in epoll.  The end of a
 * transfer wakes it (loop_wake, from whichever thread posts the completion); but a client
 * that spins on its ring sees the completion at once, and its next request then waited for
 * the loop's wake-up.  So a GPU worker whose nap through a long copy ran its length, tens of
 * microseconds before the copy ends, wakes the loop then (loop_wake_early), and the loop
 * polls by the time the request comes.
 */
static atomic_bool loop_napping;
static int loop_wake_fd = -1;
static atomic_uint_fast64_t naps, nap_wakes, early_wakes;

void
loop_nap_init(int efd)
{
	loop_wake_fd = efd;
}

void
loop_nap(bool on)
{
	if (on)
		atomic_fetch_add_explicit(&naps, 1, memory_order_relaxed);
	atomic_store(&loop_napping, on);
}

void
loop_nap_counts(uint64_t *n, uint64_t *wakes, uint64_t *early)
{
	*n = atomic_load_explicit(&naps, memory_order_relaxed);
	*wakes = atomic_load_explicit(&nap_wakes, memory_order_relaxed);
	*early = atomic_load_explicit(&early_wakes, memory_order_relaxed);
}

/* Ends the loop's nap, if it naps: true if this call ended it. */
static bool
wake(void)
{
	static const uint64_t one = 1;

	if (!atomic_load_explicit(&loop_napping, memory_order_relaxed) || !atomic_exchange(&loop_napping, false))
		return false;
	if (write(loop_wake_fd, &one, sizeof(one)) < 0) {
		/* the counter is full: the loop has been woken already */
	}
	return true;
}

void
loop_wake(void)
{
	if (wake())
		atomic_fetch_add_explicit(&nap_wakes, 1, memory_order_relaxed);
}

void
loop_wake_early(void)
{
	if (wake())
		atomic_fetch_add_explicit(&early_wakes, 1, memory_order_relaxed);
}

unsigned long long
sysctl_number(const char *path)
{
	FILE *f = fopen(path, "re");
	unsigned long long n = 0;

	if (f != NULL) {
		if (fscanf(f, "%llu", &n) != 1)
			n = 0;
		fclose(f);
	}
	return n;
}

double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

uint64_t
now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * The loop's longest turn: the most time one of its callbacks took (a connection's messages,
 * a pass over the submission queues, the ends of finished tasks, a timer, a signal), since
 * start; and the most bytes of request lists one turn copied and checked, which the engine
 * (xfer.c) keeps within a constant, however long the lists clients send (longer ones go to a
 * task thread).  gpxctl status and the metrics show both.  The time is wall time: on a busy
 * machine it also holds what the scheduler gave other threads during a turn, and the waits for
 * locks that such threads held.  With GPXD_LOOP_CLOCKS=1 the loop thread's own CPU time in
 * each turn is measured too (two reads of the thread's CPU clock a turn, a system call each),
 * which tells the loop's work from the machine's load.
 */
static double turn_max, turn_cpu_top[LOOP_TURN_TOP];    /* the CPU times: longest first */
static uint64_t turn_list, turn_list_max;    /* bytes of lists checked in this turn; the most */
static uint32_t turn_work, turn_work_max;    /* requests taken and handles given back in it; the most */
static int loop_clocks = -1;                 /* GPXD_LOOP_CLOCKS, read at the first turn */
static double turn_cpu0;
static double turn_t0;                       /* when this turn began; 0 between turns */

static double
thread_cpu_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

double
loop_turn_begin(void)
{
	if (loop_clocks < 0) {
		const char *e = getenv("GPXD_LOOP_CLOCKS");
		loop_clocks = e != NULL && strcmp(e, "1") == 0;
	}
	if (loop_clocks)
		turn_cpu0 = thread_cpu_s();
	turn_work = 0;
	return turn_t0 = now_s();
}

bool
loop_turn_over(void)
{
	turn_work++;
	return turn_t0 > 0 && now_s() - turn_t0 > LOOP_TURN_SLICE_S;
}

uint32_t
loop_turn_work_max(void)
{
	return turn_work_max;
}

void
loop_turn_end(double since)
{
	double d = now_s() - since;

	turn_t0 = 0;
	if (d > turn_max)
		turn_max = d;
	if (turn_list > turn_list_max)
		turn_list_max = turn_list;
	turn_list = 0;
	if (turn_work > turn_work_max)
		turn_work_max = turn_work;
	turn_work = 0;
	if (loop_clocks > 0 && (d = thread_cpu_s() - turn_cpu0) > turn_cpu_top[LOOP_TURN_TOP - 1]) {
		int i = LOOP_TURN_TOP - 1;
		for (; i > 0 && turn_cpu_top[i - 1] < d; i--)
			turn_cpu_top[i] = turn_cpu_top[i - 1];
		turn_cpu_top[i] = d;
	}
}

void
loop_turn_checked(uint64_t bytes)
{
	turn_list += bytes;
}

uint64_t
loop_turn_list(void)
{
	return turn_list;
}

double
loop_turn_max(void)
{
	return turn_max;
}

uint64_t
loop_turn_list_max(void)
{
	return turn_list_max;
}

double
loop_turn_cpu_max(void)
{
	return loop_clocks > 0 ? turn_cpu_top[0] : -1;
}

const double *
loop_turn_cpu_top(void)
{
	return loop_clocks > 0 ? turn_cpu_top : NULL;
}
