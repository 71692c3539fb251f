/*
 * The Python module gpx._gpx: what its C files share.
 *
 * The files, top down: each calls only files below it in this list (and the library);
 * build-aux/layers.test checks that no cycle of calls appears between them.
 *
 *   _gpx.c             the module: initialisation, state, its functions, exceptions, fork
 *   conn.c             gpx.Conn: connecting, its methods, closing
 *   region.c           gpx.Region: register, import_, export, unexport, deregister
 *   transfer-submit.c  copy, copyv, copy_pages and the batches, gpx.Batch; the benchmark's C loops
 *   transfer.c         gpx.Transfer: wait, done, await, cancel
 *   route.c            completions: reading, routing, waiting; Conn.poll and Conn.wait
 *   transfer-map.c     the Transfers not yet complete, by tag; resolving one
 *   conn-lock.c        a Conn's lock, and its refusal in a child of fork()
 *   mem-lists.c        segment and page lists, read in place or converted from sequences
 *   mem.c              the memory of tensors, arrays and buffers, for register()
 *   mem-host.c         gpx.HostBuffer: host memory gpxd can map, with the buffer protocol
 *   torch-alloc.c      the VMM allocator PyTorch may allocate exportable memory from
 *   gpxpy.c            raising gpx errors, argument helpers, conversions, the clock
 *
 * Built against the stable ABI of Python 3.11 (Py_LIMITED_API is set by the build), so the
 * one module loads in every CPython from 3.11 on.
 */
#ifndef GPX_PYTHON_GPX_H
#define GPX_PYTHON_GPX_H

#ifndef Py_LIMITED_API
#error "the gpx module is built against the stable ABI: compile with -DPy_LIMITED_API=0x030B0000"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <pthread.h>

#include "client-lib/gpx.h"

/* Error codes of gpx.h (1..18 and 100..102) packed into one table index. */
#define ERR_SLOTS 22

#define INT_DTYPES 8             /* integer dtypes kept by mem_int_tensor */

/* Per-module state: the types, the exception classes and interned attribute names. */
struct modstate {
	PyTypeObject *conn_type;
	PyTypeObject *region_type;
	PyTypeObject *transfer_type;
	PyTypeObject *hostbuf_type;
	PyTypeObject *batch_type;
	PyTypeObject *completion_type;  /* a struct sequence */
	PyObject *error;                /* gpx.Error */
	PyObject *errors[ERR_SLOTS];    /* its subclass for each code */
	PyObject *await_hook;           /* the asyncio glue of __init__.py: await_hook(transfer) */
	/* attribute names looked up on tensors and arrays */
	PyObject *s_data_ptr, *s_device, *s_type, *s_is_contiguous, *s_nbytes, *s_numel,
	    *s_element_size, *s_cai, *s_dlpack, *s_dtype, *s_is_signed, *s_is_floating_point,
	    *s_is_complex, *s_wait, *s_close, *s_is_cuda, *s_is_cpu;
	/*
	 * The integer dtypes of the CPU tensors read as lists so far (torch's dtype objects are
	 * singletons): each one's size and sign, asked once (mem_int_tensor).
	 */
	struct { PyObject *dtype; uint8_t size; bool is_signed; } int_dtypes[INT_DTYPES];
};

/* gpx.HostBuffer: a memfd made by gpx_host_alloc, mapped here, with the buffer protocol. */
typedef struct hostbuf {
	PyObject_HEAD
	int fd;
	unsigned char *ptr;
	size_t len;
	Py_ssize_t exports;             /* buffer views handed out and not released */
	unsigned regs;                  /* regions registered in it, on any connection */
	bool closed;
	struct hostbuf *prev, *next;    /* the live HostBuffers, for lookups by address */
	PyObject *weakrefs;
} HostBuffer;

/*
 * What register() hands the library, and what the region keeps alive: a slice of a HostBuffer,
 * or a CUDA device pointer.
 */
struct mem_desc {
	bool cuda;
	const void *ptr;                /* CUDA: the device pointer */
	uint64_t length;
	HostBuffer *hb;                 /* host: the HostBuffer (a reference, counted in its regs) ... */
	uint64_t offset;                /* ... and where in it */
	PyObject *obj;                  /* a reference to the object registered */
	Py_buffer view;                 /* its buffer, held while registered (has_view) */
	bool has_view;
	void *dl;                       /* a DLManagedTensor owned until the region goes */
};

/* A segment list for gpx_copyv: in the caller's buffer, or in memory of our own. */
struct seglist {
	const struct gpx_seg *segs;
	size_t n;
	bool is_signed;                 /* int64 items: none may be negative (checked by the caller) */
	Py_buffer view;
	bool has_view;
	void *own;                      /* malloc'ed, when converted from a list */
};

/* A page list for gpx_copy_pages: 4-byte items in the caller's memory or our own. */
struct pagelist {
	const uint32_t *pages;
	size_t n;
	Py_buffer view;
	bool has_view;
	PyObject *keep;                 /* a tensor read through its data pointer */
	void *own;
};


#define TAG_AUTO (1ULL << 62)        /* automatic tags: TAG_AUTO | a counter; user tags are below */
#define TAG_BENCH (3ULL << 61)       /* the C loops of _c_bench */
#define PULL_MAX 64                  /* completions read from the library at once */

typedef struct transfer Transfer;

/* One transfer not yet complete (transfer.c). */
struct tagslot {
	uint64_t tag;
	Transfer *t;                 /* borrowed; NULL once the Transfer object died */
	bool used;
};

/* Transfers not yet complete, by tag: open addressing, linear probing. */
struct tagmap {
	struct tagslot *s;
	size_t cap, n;
};

/* A completion read and not yet consumed, with the Transfer it resolved (borrowed, or NULL). */
struct bentry {
	struct gpx_completion c;
	PyObject *reason;
	Transfer *t;
};

/* A registered region's object, kept until the region goes. */
struct keep {
	uint64_t region;
	struct mem_desc d;
};

/* The daemon's reason for a refused transfer, heard by the library's hook (under mu). */
struct reason {
	uint64_t tag;
	char *text;
};

/* gpx.Conn (conn.c). */
typedef struct conn {
	PyObject_HEAD
	struct modstate *st;
	gpx_conn *c;                 /* NULL once closed (changed under mu) */
	pthread_mutex_t mu;          /* every call into c, and the fields marked (mu) */
	pthread_cond_t cv;           /* threads waiting behind the fd's watcher */
	bool sync_made;              /* mu and cv were initialised */
	bool sleeping;               /* a thread watches the fd (mu) */
	uint64_t gen;                /* bumped when completions were routed (atomic, written under mu) */
	int wakefd;                  /* the doorbell: gpxd rings it, and route_kick to wake the fd's watcher */
	int fd;                      /* gpx_fd(c) */
	unsigned fork_gen;            /* gpxpy_fork_gen when it was made */
	bool closed;                 /* close() has begun: new calls are refused */
	uint64_t client_id;
	PyObject *name;
	unsigned waiters;            /* threads inside a wait on this connection */
	struct tagmap pending;
	uint64_t next_tag;
	struct bentry *back;         /* the backlog, oldest first */
	size_t nback, capback;
	struct keep *keeps;
	size_t nkeeps, capkeeps;
	struct reason *reasons;      /* (mu) */
	size_t nreasons, capreasons;
	PyObject *aio;               /* the asyncio glue's watcher, or NULL */
} Conn;

/* gpx.Transfer (transfer.c). */
struct transfer {
	PyObject_HEAD
	Conn *conn;
	uint64_t tag;
	bool resolved;               /* its completion was read */
	bool in_backlog;             /* ... and waits in the backlog */
	unsigned waiting;            /* threads waiting for it */
	int status;
	uint64_t bytes;
	PyObject *reason;
	PyObject *waker;             /* the asyncio glue's callback, called once when it resolves */
};

/* gpx.Region (region.c). */
typedef struct region {
	PyObject_HEAD
	Conn *conn;
	uint64_t id;
	uint64_t length;
	const char *kind;
	bool read_only;
	bool imported;
	bool live;
	PyObject *name;              /* the export it was imported from, or NULL */
} Region;

/* What a library call left for its error: the code, errno, and the daemon's reason. */
struct callres {
	int r;
	int err;
	char reason[256];
};

/* How a method takes its arguments: the first npos by position too, the first nreq required. */
struct argspec {
	const char *fname;
	int npos, nreq;
	const char *names[10];
};

/* A completion read from the library, with the daemon's reason for a refusal. */
struct pulled {
	struct gpx_completion c;
	char *reason;                /* the daemon's, malloc'ed, or NULL */
};

/* A method table entry of a fast-call method with keywords. */
#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL | METH_KEYWORDS

/* What route_wait_until waits for. */
typedef bool (*wait_pred)(Conn *, void *);

/* gpxpy.c */
extern unsigned gpxpy_fork_gen;      /* bumped in the child of every fork() (_gpx.c) */
int gpxpy_err_slot(int code);        /* the slot of modstate.errors for a code (either sign) */
/* The name of obj's type, for messages: valid in the statement that uses it. */
#define TNAME(obj) gpxpy_type_name((obj), (char[80]){ 0 }, 80)
const char *gpxpy_type_name(PyObject *obj, char *buf, size_t len);
struct modstate *gpxpy_state_of(PyTypeObject *tp);
/* Raise gpx.Error's subclass for code (negative, as the library returns it) with a reason. */
PyObject *gpxpy_raise(struct modstate *st, int code, const char *reason);
PyObject *gpxpy_raise_errno(struct modstate *st, int code, const char *reason, int sys_errno);
PyObject *gpxpy_raise_call(struct modstate *st, const struct callres *cr);
int gpxpy_note(struct callres *cr, gpx_conn *c, int r);
int gpxpy_args(const struct argspec *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out);
int gpxpy_u64(PyObject *o, const char *name, uint64_t *out);
int gpxpy_timeout(PyObject *o, double *out);
const char *gpxpy_str(PyObject *o, const char *name);
void gpxpy_setref(PyObject **slot, PyObject *v);
double gpxpy_now(void);

/* conn.c */
extern PyType_Spec conn_spec;
PyObject *conn_connect(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* conn-lock.c */
int conn_usable(Conn *s);
PyThreadState *conn_lock_quick(Conn *s);
PyThreadState *conn_lock_slow(Conn *s);
void conn_unlock(Conn *s, PyThreadState *ts);

/* region.c */
extern PyType_Spec region_spec;
PyObject *region_register(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *region_import(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *region_export(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *region_unexport(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
void region_drop_keeps(Conn *s);

/* transfer.c */
extern PyType_Spec transfer_spec;
/* A new Transfer, entered under its tag (tag_arg: the caller's, or NULL/None for an automatic one). */
Transfer *transfer_start(Conn *s, PyObject *tag_arg);
/* A submission failed: the Transfer goes, and the error is raised (returns NULL). */
PyObject *transfer_abort(Transfer *t, const struct callres *cr);

/* transfer-map.c */
struct tagslot *transfer_map_find(struct tagmap *m, uint64_t tag);
int transfer_map_put(struct tagmap *m, uint64_t tag, Transfer *t);
void transfer_map_del(struct tagmap *m, struct tagslot *slot);
void transfer_resolve(Transfer *t, int status, uint64_t bytes, PyObject *reason);
void transfer_wake(Transfer *t);

/* transfer-submit.c */
PyObject *transfer_copy(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copyv(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copy_pages(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copy_pages_table(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copy_pages_batch_table(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copy_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_copy_pages_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern PyType_Spec batch_spec;
PyObject *transfer_batch(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *transfer_c_bench(PyObject *op, PyObject *args);

/* route.c */
PyObject *route_poll(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *route_wait(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *route_drain(PyObject *op, PyObject *unused);
int route_wait_until(Conn *s, wait_pred pred, void *arg, double timeout, bool self_waits);
bool route_pred_resolved(Conn *s, void *arg);
bool route_pred_none_pending(Conn *s, void *arg);
void route_kick(Conn *s);
void route_after_rpc(Conn *s);
void route_resolve_all(Conn *s, int code, const char *why);
void route_on_refusal(void *arg, uint64_t tag, const char *text);
void route_backlog_take(Conn *s, Transfer *t);
void route_backlog_clear(Conn *s);

/* mem.c */
int mem_describe(struct modstate *st, PyObject *obj, bool read_only, struct mem_desc *d);
void mem_release(struct mem_desc *d);
/* A CPU tensor of integers of `size` bytes, read through its data pointer: 1, 0 (not a tensor), -1. */
int mem_int_tensor(struct modstate *st, PyObject *o, const char *what, size_t size, const void **p,
    size_t *items, bool *is_signed);

/* mem-host.c */
extern PyType_Spec mem_hostbuf_spec;
PyObject *mem_host_alloc(PyObject *module, PyObject *arg);
/* The live HostBuffer that holds [p, p+len), and where in it; NULL if none does. */
HostBuffer *mem_host_find(const void *p, uint64_t len, uint64_t *off);

/* mem-lists.c */
int mem_segments(struct modstate *st, PyObject *obj, struct seglist *l);
void mem_segments_release(struct seglist *l);
int mem_pages(struct modstate *st, PyObject *obj, const char *what, struct pagelist *l);
void mem_pages_release(struct pagelist *l);

/*
 * torch-alloc.c (torch-alloc-none.c without the CUDA headers).  gpx_torch_alloc and
 * gpx_torch_free are exported for torch.cuda.memory.CUDAPluggableAllocator.
 */
void *gpx_torch_alloc(ssize_t size, int device, void *stream);
void gpx_torch_free(void *ptr, ssize_t size, int device, void *stream);
PyObject *torch_vmm_check(PyObject *module, PyObject *device);
PyObject *torch_alloc_error(PyObject *module, PyObject *unused);

#endif
