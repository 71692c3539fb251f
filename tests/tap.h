/*
 * A tiny TAP producer for the gpx tests: one `ok N - description` (or `not ok`) line per check,
 * comments as `# ...`, skips as `ok N # SKIP why`, and the plan `1..N` printed at the end.
 * Automake's tap-driver.sh counts these lines.  Checks may come from several threads; the
 * numbering stays consistent.  Header-only; a program of several files includes it in each,
 * and they count on one set of counters.
 */
#ifndef GPX_TAP_H
#define GPX_TAP_H

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/*
 * The counters and their lock, one set per program however many of its files include this
 * header: weak definitions, which the linker merges into one, so that a program's checks in
 * several files number on (tests/integ.c and its parts).
 */
__attribute__((weak)) pthread_mutex_t tap_lock = PTHREAD_MUTEX_INITIALIZER;
__attribute__((weak)) int tap_count;
__attribute__((weak)) int tap_failed;

static inline void tap_vline(int pass, const char *file, int line, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

static inline void
tap_vline(int pass, const char *file, int line, const char *fmt, va_list ap)
{
	pthread_mutex_lock(&tap_lock);
	tap_count++;
	if (!pass)
		tap_failed++;
	printf("%sok %d - ", pass ? "" : "not ", tap_count);
	vprintf(fmt, ap);
	printf("\n");
	if (!pass)
		printf("# failed at %s:%d\n", file, line);
	fflush(stdout);
	pthread_mutex_unlock(&tap_lock);
}

static inline int tap_ok(int pass, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline int
tap_ok(int pass, const char *file, int line, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	tap_vline(pass, file, line, fmt, ap);
	va_end(ap);
	return pass;
}

/* ok(condition, "printf-style description"): one check; returns the condition. */
#define ok(cond, ...) tap_ok(!!(cond), __FILE__, __LINE__, __VA_ARGS__)

static inline void diag(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A comment line (the driver shows it in the log, never counts it). */
static inline void
diag(const char *fmt, ...)
{
	va_list ap;

	pthread_mutex_lock(&tap_lock);
	printf("# ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	pthread_mutex_unlock(&tap_lock);
}

/* n checks that cannot run here, each reported as skipped with the reason. */
static inline void
tap_skip(int n, const char *why)
{
	pthread_mutex_lock(&tap_lock);
	for (int i = 0; i < n; i++)
		printf("ok %d # SKIP %s\n", ++tap_count, why);
	fflush(stdout);
	pthread_mutex_unlock(&tap_lock);
}

/* Stops the whole program: the setup is broken, the remaining checks cannot mean anything. */
static inline void tap_bail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

static inline void
tap_bail(const char *fmt, ...)
{
	va_list ap;

	printf("Bail out! ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	exit(99);
}

/* Prints the plan; the exit status says whether every check passed. */
static inline int
tap_done(void)
{
	printf("1..%d\n", tap_count);
	fflush(stdout);
	return tap_failed ? 1 : 0;
}

#endif
