/*
 * Blocking work off the event loop.  A small pool of task threads runs work functions (mapping
 * and pinning host memory, opening CUDA handles); each finished task is queued back to the loop
 * thread, which is woken through an eventfd and runs the task's done function there.  The loop
 * thread therefore never waits on a slow system or driver call.
 */
#include "config.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/eventfd.h>
#include <event2/event.h>

#include "daemon/gpxd.h"

STAILQ_HEAD(task_list, defer_task);

static pthread_mutex_t defer_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t defer_cond = PTHREAD_COND_INITIALIZER;
static struct task_list defer_todo = STAILQ_HEAD_INITIALIZER(defer_todo);
/*
 * Finished tasks, newest first: pushed by the task threads, taken all at once by the loop
 * thread, without a lock, so that the loop never waits for a task thread the scheduler has
 * set aside while it held one.
 */
static _Atomic(struct defer_task *) defer_done;
static pthread_t *defer_threads;
static int defer_nthreads;
static bool defer_quit;
static int defer_efd = -1;
static struct event *defer_ev;

static void *
defer_main(void *unused)
{
	(void)unused;
	thread_name("task");
	pthread_mutex_lock(&defer_lock);
	for (;;) {
		while (STAILQ_EMPTY(&defer_todo) && !defer_quit)
			pthread_cond_wait(&defer_cond, &defer_lock);
		if (STAILQ_EMPTY(&defer_todo))
			break;
		struct defer_task *t = STAILQ_FIRST(&defer_todo);
		STAILQ_REMOVE_HEAD(&defer_todo, entry);
		pthread_mutex_unlock(&defer_lock);

		t->work(t->arg);

		/* The first of a batch wakes the loop; it takes whatever is there by then. */
		struct defer_task *head = atomic_load(&defer_done);
		do
			t->next_done = head;
		while (!atomic_compare_exchange_weak(&defer_done, &head, t));
		if (head == NULL) {
			uint64_t one = 1;
			(void)!write(defer_efd, &one, sizeof(one));
		}
		pthread_mutex_lock(&defer_lock);
	}
	pthread_mutex_unlock(&defer_lock);
	return NULL;
}

/*
 * Loop thread: runs the done functions of finished tasks, in the order their work ended, for
 * the turn's slice (loop_turn_over; at least one): a client that had thousands of tasks end at
 * once (the unmapping of its regions when it goes) does not hold the loop for all of them.
 * The rest wait in `ready`, and a count written to the eventfd brings the loop back to them
 * after it has looked at the sockets.  At shutdown (reap_all) every one runs.
 */
static struct defer_task *ready, **ready_tail = &ready;
static bool reap_all;

static void
defer_reap(evutil_socket_t fd, short what, void *unused)
{
	struct defer_task *t, *fifo = NULL, *last = NULL;
	uint64_t v;

	double t0 = loop_turn_begin();

	(void)what;
	(void)unused;
	(void)!read(fd, &v, sizeof(v));
	/* Newest first: reversed, behind those an earlier turn left. */
	for (t = atomic_exchange(&defer_done, NULL); t != NULL;) {
		struct defer_task *nx = t->next_done;
		if (last == NULL)
			last = t;
		t->next_done = fifo;
		fifo = t;
		t = nx;
	}
	if (fifo != NULL) {
		*ready_tail = fifo;
		ready_tail = &last->next_done;
	}
	while ((t = ready) != NULL) {
		if ((ready = t->next_done) == NULL)
			ready_tail = &ready;
		t->done(t->arg);         /* (which may free the record t is in) */
		bool over = loop_turn_over();     /* (counts it as the turn's work) */
		if (ready != NULL && over && !reap_all) {
			uint64_t one = 1;
			(void)!write(defer_efd, &one, sizeof(one));
			break;
		}
	}
	loop_turn_end(t0);
}

int
defer_init(struct event_base *base, int threads)
{
	defer_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (defer_efd < 0)
		return -errno;
	defer_ev = event_new(base, defer_efd, EV_READ | EV_PERSIST, defer_reap, NULL);
	event_add(defer_ev, NULL);
	defer_threads = calloc(threads, sizeof(*defer_threads));
	for (int i = 0; i < threads; i++) {
		if (pthread_create(&defer_threads[i], NULL, defer_main, NULL) != 0)
			break;
		defer_nthreads++;
	}
	return defer_nthreads > 0 ? 0 : -EAGAIN;
}

/* Finishes the queued tasks, then stops the threads and runs the remaining done functions. */
void
defer_shutdown(void)
{
	pthread_mutex_lock(&defer_lock);
	defer_quit = true;
	pthread_cond_broadcast(&defer_cond);
	pthread_mutex_unlock(&defer_lock);
	for (int i = 0; i < defer_nthreads; i++)
		pthread_join(defer_threads[i], NULL);
	reap_all = true;
	defer_reap(defer_efd, EV_READ, NULL);
	free(defer_threads);
	defer_threads = NULL;
	defer_nthreads = 0;
	if (defer_ev != NULL)
		event_free(defer_ev);
	defer_ev = NULL;
	close(defer_efd);
	defer_efd = -1;
	defer_quit = false;
}

void
defer_run(struct defer_task *t, defer_fn work, defer_fn done, void *arg)
{
	t->work = work;
	t->done = done;
	t->arg = arg;
	pthread_mutex_lock(&defer_lock);
	STAILQ_INSERT_TAIL(&defer_todo, t, entry);
	pthread_cond_signal(&defer_cond);
	pthread_mutex_unlock(&defer_lock);
}
