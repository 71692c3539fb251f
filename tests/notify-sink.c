/*
 * notify-sink: a stand-in for systemd's notification socket, for the deployment tests.  It
 * binds a datagram Unix socket at PATH (what NOTIFY_SOCKET names), receives sd_notify(3)
 * messages and writes one line per field to OUT, prefixed with the milliseconds since it
 * started and the sender's pid (SO_PASSCRED), e.g.
 *
 *	1234 pid=4242 READY=1
 *
 * The file is flushed after every message, so a test can poll it while the daemon runs.
 * It exits on SIGTERM or SIGINT, or after -t SECONDS (default 300).
 *
 * usage: notify-sink [-t SECONDS] PATH OUT
 */
#include "config.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/un.h>

static volatile sig_atomic_t quit;

static void
on_signal(int sig)
{
	(void)sig;
	quit = 1;
}

static double
now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int
main(int argc, char **argv)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct sigaction act = { .sa_handler = on_signal };
	double limit_s = 300, t0;
	int fd, one = 1, ch;
	FILE *out;

	while ((ch = getopt(argc, argv, "t:")) != -1) {
		switch (ch) {
		case 't': limit_s = atof(optarg); break;
		default: goto usage;
		}
	}
	if (argc - optind != 2) {
usage:
		fprintf(stderr, "usage: notify-sink [-t SECONDS] PATH OUT\n");
		return 2;
	}
	if (strlen(argv[optind]) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "notify-sink: path too long\n");
		return 2;
	}
	strcpy(sa.sun_path, argv[optind]);
	if ((out = fopen(argv[optind + 1], "w")) == NULL) {
		perror(argv[optind + 1]);
		return 1;
	}
	unlink(sa.sun_path);
	if ((fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)) < 0 ||
	    bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
	    setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) < 0) {
		perror("notify-sink: socket");
		return 1;
	}
	sigaction(SIGTERM, &act, NULL);
	sigaction(SIGINT, &act, NULL);
	t0 = now_ms();
	while (!quit && now_ms() - t0 < limit_s * 1e3) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		char buf[4096 + 1];
		union {
			struct cmsghdr h;
			char b[CMSG_SPACE(sizeof(struct ucred))];
		} ctl;
		struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) - 1 };
		struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &ctl,
		    .msg_controllen = sizeof(ctl) };
		pid_t pid = 0;

		if (poll(&p, 1, 200) <= 0)
			continue;
		ssize_t n = recvmsg(fd, &m, MSG_DONTWAIT);
		if (n < 0) {
			if (errno == EAGAIN || errno == EINTR)
				continue;
			perror("notify-sink: recvmsg");
			return 1;
		}
		buf[n] = '\0';
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c != NULL; c = CMSG_NXTHDR(&m, c))
			if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
				struct ucred cr;
				memcpy(&cr, CMSG_DATA(c), sizeof(cr));
				pid = cr.pid;
			}
		double t = now_ms() - t0;
		for (char *line = strtok(buf, "\n"); line != NULL; line = strtok(NULL, "\n"))
			fprintf(out, "%.0f pid=%d %s\n", t, (int)pid, line);
		fflush(out);
	}
	unlink(sa.sun_path);
	fclose(out);
	return 0;
}
