/*
 * Memory kind `host`: a memfd passed with SCM_RIGHTS, mapped shared into the daemon.
 *
 * Only a memfd sealed against shrinking is accepted.  A file that its owner can truncate under a
 * live mapping turns the daemon's next access into SIGBUS; the seal makes that impossible, so no
 * copy ever needs a fault handler.  The fd's access mode decides whether the region is writable.
 * Pages are populated at registration (on a task thread) so that copies run without faults.
 * With a GPU present the mapping is also registered with the driver, for DMA at copy-engine
 * speed.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "gpxd.h"

static const char *
fd_type(mode_t m)
{
	if (S_ISSOCK(m)) return "a socket";
	if (S_ISFIFO(m)) return "a pipe";
	if (S_ISCHR(m)) return "a character device";
	if (S_ISBLK(m)) return "a block device";
	if (S_ISDIR(m)) return "a directory";
	return "not a regular file";
}

/* Cheap checks, run on the loop thread before anything is queued. */
bool
mem_host_fd_ok(int fd, char *err, size_t errlen)
{
	struct stat st;
	int seals;

	if (fstat(fd, &st) < 0) {
		snprintf(err, errlen, "fstat on the passed fd: %s", strerror(errno));
		return false;
	}
	if (!S_ISREG(st.st_mode)) {
		/* eventfds and other anonymous inodes are neither regular files nor memfds. */
		snprintf(err, errlen, "the passed fd is %s, not a memfd", fd_type(st.st_mode));
		return false;
	}
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		snprintf(err, errlen, "the passed fd is a file, not a memfd (no seals)");
		return false;
	}
	if (!(seals & F_SEAL_SHRINK)) {
		snprintf(err, errlen, "the memfd is not sealed with F_SEAL_SHRINK");
		return false;
	}
	return true;
}

static int
host_open(struct region *r, char *err, size_t errlen)
{
	struct stat st;
	long pg = sysconf(_SC_PAGESIZE);
	int prot = PROT_READ, acc;

	if (fstat(r->fd, &st) < 0) {
		snprintf(err, errlen, "fstat: %s", strerror(errno));
		return -GPX__STATUS__EBADFD;
	}
	if (r->length == 0 || r->offset > (uint64_t)st.st_size ||
	    r->length > (uint64_t)st.st_size - r->offset) {
		snprintf(err, errlen, "offset %llu + length %llu exceeds the memfd's %lld bytes",
		    (unsigned long long)r->offset, (unsigned long long)r->length, (long long)st.st_size);
		return -GPX__STATUS__ERANGE;
	}
	acc = fcntl(r->fd, F_GETFL) & O_ACCMODE;
	if (acc == O_RDWR && !(fcntl(r->fd, F_GET_SEALS) & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)))
		prot |= PROT_WRITE;
	else
		r->read_only = true;
	uint64_t start = r->offset & ~(uint64_t)(pg - 1);
	r->map_len = r->length + (r->offset - start);
	r->map = mmap(NULL, r->map_len, prot, MAP_SHARED | MAP_POPULATE, r->fd, start);
	if (r->map == MAP_FAILED) {
		r->map = NULL;
		snprintf(err, errlen, "mmap of %llu bytes: %s", (unsigned long long)r->map_len,
		    strerror(errno));
		return -GPX__STATUS__ENOMEM;
	}
	r->host = (char *)r->map + (r->offset - start);
	if (gpu_count() > 0)
		gpu_host_register(r);
	return 0;
}

static void
host_close(struct region *r)
{
	if (r->priv != NULL)
		gpu_host_unregister(r);
	if (r->map != NULL)
		munmap(r->map, r->map_len);
	r->map = NULL;
	r->host = NULL;
	if (r->fd >= 0)
		close(r->fd);
	r->fd = -1;
}

const struct mem_ops mem_host_ops = {
	.name = "host",
	.open = host_open,
	.close = host_close,
};
