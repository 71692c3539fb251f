/*
 * The only file that talks to systemd: socket activation, sd_notify (READY, STATUS, RELOADING,
 * STOPPING, WATCHDOG) and the journal.  Built without libsystemd, the same functions do
 * nothing, and gpxd simply runs as a plain daemon logging to stderr.
 */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/gpxd.h"

/* Started by systemd (or systemd-socket-activate): then gpxd must not fork away. */
bool
sdn_supervised(void)
{
	const char *pid = getenv("LISTEN_PID");

	if (getenv("NOTIFY_SOCKET") != NULL)
		return true;
	return pid != NULL && strtoul(pid, NULL, 10) == (unsigned long)getpid();
}

#ifdef HAVE_LIBSYSTEMD
#include <syslog.h>
#include <systemd/sd-daemon.h>
#include <systemd/sd-journal.h>

/* The one socket systemd handed us, checked to be a listening SEQPACKET Unix socket. */
int
sdn_listen_fd(void)
{
	int n = sd_listen_fds(1);

	if (n <= 0)
		return -1;
	if (n > 1)
		log_warnx("systemd passed %d sockets; using the first", n);
	if (sd_is_socket_unix(SD_LISTEN_FDS_START, SOCK_SEQPACKET, 1, NULL, 0) <= 0) {
		log_warnx("the socket systemd passed is not a listening SOCK_SEQPACKET Unix socket");
		return -1;
	}
	return SD_LISTEN_FDS_START;
}

/*
 * JOURNAL_STREAM is "DEV:INODE" of the journal stream systemd connected our stderr to.  It is
 * inherited by everything started from a service, so it counts only while stderr really is
 * that stream (as sd_journal_stream_fd(3) and systemd.exec(5) advise).
 */
bool
sdn_journal_wanted(void)
{
	const char *e = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;

	if (e == NULL || sscanf(e, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) < 0)
		return false;
	return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

void
sdn_journal(int level, const char *msg)
{
	static const int prio[] = { LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG };
	sd_journal_send("MESSAGE=%s", msg, "PRIORITY=%d", prio[level], "SYSLOG_IDENTIFIER=gpxd", NULL);
}

void
sdn_ready(const char *status)
{
	sd_notifyf(0, "READY=1\nSTATUS=%s\nMAINPID=%lu", status, (unsigned long)getpid());
}

void
sdn_status(const char *status)
{
	sd_notifyf(0, "STATUS=%s", status);
}

void
sdn_reloading(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	sd_notifyf(0, "RELOADING=1\nMONOTONIC_USEC=%llu",
	    (unsigned long long)ts.tv_sec * 1000000ULL + ts.tv_nsec / 1000);
}

void
sdn_stopping(void)
{
	sd_notify(0, "STOPPING=1");
}

uint64_t
sdn_watchdog_usec(void)
{
	uint64_t usec = 0;

	if (sd_watchdog_enabled(0, &usec) <= 0)
		return 0;
	return usec;
}

void
sdn_watchdog(void)
{
	sd_notify(0, "WATCHDOG=1");
}

#else /* !HAVE_LIBSYSTEMD */

int sdn_listen_fd(void) { return -1; }
bool sdn_journal_wanted(void) { return false; }
void sdn_journal(int level, const char *msg) { (void)level; (void)msg; }
void sdn_ready(const char *status) { (void)status; }
void sdn_status(const char *status) { (void)status; }
void sdn_reloading(void) { }
void sdn_stopping(void) { }
uint64_t sdn_watchdog_usec(void) { return 0; }
void sdn_watchdog(void) { }

#endif
