/* The worker side of a kvrail ring's hot path, compiled (docs/ring-format.md).
 *
 * kvrail.ring drives a ring in pure Python on x86-64; this module does the
 * same steps with real atomics, so rings also work where plain stores are not
 * seen in program order (aarch64: DGX Spark's Grace CPU), and each step is one
 * C call instead of a dozen interpreted ones. Every function takes the ring's
 * mmap (buffer protocol: the mapping cannot go away under a call) and checks
 * that what it touches lies inside it. Nothing here keeps state: the worker's
 * indices live in the ring's own header words, which only the worker writes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Offsets of kvrail_core::ring's header words and slot parts. */
#define HEADER_BYTES 4096
#define STATE 28
#define SQ_TAIL 64
#define SQ_HEAD 128
#define CQ_TAIL 192
#define CQ_HEAD 256
#define SIDECAR_BELL 320
#define SIDECAR_SLEEPING 324
#define WORKER_BELL 384
#define WORKER_SLEEPING 388
#define STATE_CLOSED 2
#define SUB_FIXED 248
#define CQ_SLOT_BYTES 512

#define U64(base, off) ((uint64_t *)((base) + (off)))
#define U32(base, off) ((uint32_t *)((base) + (off)))

static PyObject *kind_names;            /* tuple: kind number -> name (set_types) */
static PyTypeObject *completion_type;  /* kvrail.ring.RingCompletion (set_types) */

static int ring_view(PyObject *mm, Py_buffer *view, Py_ssize_t need) {
    if (PyObject_GetBuffer(mm, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len < need) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "ring mapping of %zd bytes, %zd needed", view->len, need);
        return -1;
    }
    return 0;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Appends the runs of `ids` (start, count pairs of u32) at slot offset *at;
 * counts them in *runs. Writes only below `limit`; past it, keeps counting. */
static int put_runs(uint8_t *slot, Py_ssize_t limit, Py_ssize_t *at, PyObject *ids, Py_ssize_t *runs) {
    /* A tuple (the object itself when it is one): a list's item array could
     * be changed or freed by Python code an item's __index__ runs. */
    PyObject *seq = PySequence_Tuple(ids);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long long prev = -2;
    uint32_t start = 0, count = 0;
    *runs = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        long long b = -1;
        if (i < n) {
            b = PyLong_AsLongLong(items[i]);
            if (b == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            if (b < 0 || b > UINT32_MAX) {
                Py_DECREF(seq);
                PyErr_Format(PyExc_ValueError, "block id %lld is not a u32", b);
                return -1;
            }
            if (count > 0 && b == prev + 1) {
                count++;
                prev = b;
                continue;
            }
        }
        if (count > 0) {
            if (*at + 8 <= limit) {
                memcpy(slot + *at, &start, 4);
                memcpy(slot + *at + 4, &count, 4);
            }
            *at += 8;
            (*runs)++;
        }
        start = (uint32_t)b;
        count = 1;
        prev = b;
    }
    Py_DECREF(seq);
    return 0;
}

static int put_generations(uint8_t *slot, Py_ssize_t limit, Py_ssize_t *at, PyObject *gens, Py_ssize_t *count) {
    PyObject *seq = PySequence_Tuple(gens); /* as in put_runs */
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *index = PyNumber_Index(items[i]);
        if (index == NULL) {
            Py_DECREF(seq);
            return -1;
        }
        uint64_t g = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
        if (g == (uint64_t)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (*at + 8 <= limit)
            memcpy(slot + *at, &g, 8);
        *at += 8;
    }
    *count = n;
    Py_DECREF(seq);
    return 0;
}

/* One side of a submission (a Blocks object): its region, layers, and its
 * block runs and generations appended to `image` at *at (below `limit`). */
static int put_side(PyObject *blocks, uint8_t *image, Py_ssize_t limit, Py_ssize_t *at, uint64_t *region,
                    uint32_t layers[2], Py_ssize_t *runs, int runs_pass) {
    static PyObject *s_region, *s_ids, *s_start, *s_count, *s_gens;
    if (s_gens == NULL) { /* set last: all five are there once it is */
        PyObject *r = PyUnicode_InternFromString("region_id"), *i = PyUnicode_InternFromString("block_ids"),
                 *st = PyUnicode_InternFromString("layer_start"), *c = PyUnicode_InternFromString("layer_count"),
                 *g = PyUnicode_InternFromString("generations");
        if (!r || !i || !st || !c || !g) {
            Py_XDECREF(r);
            Py_XDECREF(i);
            Py_XDECREF(st);
            Py_XDECREF(c);
            Py_XDECREF(g);
            return -1;
        }
        s_region = r;
        s_ids = i;
        s_start = st;
        s_count = c;
        s_gens = g;
    }
    PyObject *attr = PyObject_GetAttr(blocks, runs_pass ? s_ids : s_gens);
    if (attr == NULL)
        return -1;
    int rc = runs_pass ? put_runs(image, limit, at, attr, runs) : put_generations(image, limit, at, attr, runs);
    Py_DECREF(attr);
    if (rc < 0 || !runs_pass)
        return rc;
    PyObject *r = PyObject_GetAttr(blocks, s_region), *ls = PyObject_GetAttr(blocks, s_start),
             *lc = PyObject_GetAttr(blocks, s_count);
    if (r && ls && lc) {
        *region = PyLong_AsUnsignedLongLong(r);
        unsigned long long start = PyLong_AsUnsignedLongLong(ls), count = PyLong_AsUnsignedLongLong(lc);
        if (!PyErr_Occurred() && (start > UINT32_MAX || count > UINT32_MAX))
            PyErr_SetString(PyExc_ValueError, "layer range out of range");
        layers[0] = (uint32_t)start;
        layers[1] = (uint32_t)count;
    }
    Py_XDECREF(r);
    Py_XDECREF(ls);
    Py_XDECREF(lc);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *too_large_error; /* kvrail.ring.RingTooLarge (set_types) */

/* submit(mm, sq_entries, slot_bytes, op, request_id: str, peer: str, src, dst)
 * -> the submission's user data (> 0) once published; 0 the queue is full;
 * -1 the sidecar closed the ring; -N (N > 1) it needs N bytes, more than a
 * slot. Nothing is published unless it returns > 0.
 *
 * The slot is built in a private buffer first (reading the Blocks may run
 * Python code, and so let another thread in); the part from reading the
 * tail to publishing it runs no Python code, so under the interpreter lock
 * two threads never claim the same slot. */
static PyObject *submit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "submit takes 8 arguments");
        return NULL;
    }
    Py_ssize_t entries = PyLong_AsSsize_t(args[1]), slot_bytes = PyLong_AsSsize_t(args[2]);
    long op = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (entries <= 0 || slot_bytes < SUB_FIXED || op < 0 || op > 255 ||
        entries > (PY_SSIZE_T_MAX - HEADER_BYTES) / slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "ring geometry out of range");
        return NULL;
    }
    Py_ssize_t rid_len, peer_len;
    const char *rid = PyUnicode_AsUTF8AndSize(args[4], &rid_len);
    if (rid == NULL)
        return NULL;
    const char *peer = PyUnicode_AsUTF8AndSize(args[5], &peer_len);
    if (peer == NULL)
        return NULL;
    if (peer_len < 1 || peer_len > 64 || rid_len < 1 || rid_len > 128) {
        PyErr_SetString(too_large_error ? too_large_error : PyExc_ValueError,
                        "request id must be 1..=128 bytes and peer 1..=64");
        return NULL;
    }
    uint8_t small[4096];
    uint8_t *image = slot_bytes <= (Py_ssize_t)sizeof small ? small : PyMem_Malloc((size_t)slot_bytes);
    if (image == NULL)
        return PyErr_NoMemory();
    memset(image, 0, SUB_FIXED);
    Py_ssize_t at = SUB_FIXED, src_runs, dst_runs, src_gens, dst_gens;
    uint64_t src_region = 0, dst_region = 0;
    uint32_t layers[4] = {0, 0, 0, 0};
    PyObject *result = NULL;
    if (put_side(args[6], image, slot_bytes, &at, &src_region, layers, &src_runs, 1) < 0 ||
        put_side(args[7], image, slot_bytes, &at, &dst_region, layers + 2, &dst_runs, 1) < 0 ||
        put_side(args[6], image, slot_bytes, &at, NULL, NULL, &src_gens, 0) < 0 ||
        put_side(args[7], image, slot_bytes, &at, NULL, NULL, &dst_gens, 0) < 0)
        goto out;
    if (at > slot_bytes || src_runs > 0xffff || dst_runs > 0xffff || src_gens > 0xffff || dst_gens > 0xffff) {
        result = PyLong_FromSsize_t(-at);
        goto out;
    }
    Py_buffer view;
    if (ring_view(args[0], &view, HEADER_BYTES + entries * slot_bytes) < 0)
        goto out;
    uint8_t *base = view.buf;
    /* From here to the tail's store: no Python code. */
    if (__atomic_load_n(U32(base, STATE), __ATOMIC_ACQUIRE) == STATE_CLOSED) {
        PyBuffer_Release(&view);
        result = PyLong_FromLong(-1);
        goto out;
    }
    uint64_t tail = __atomic_load_n(U64(base, SQ_TAIL), __ATOMIC_RELAXED); /* ours alone */
    uint64_t head = __atomic_load_n(U64(base, SQ_HEAD), __ATOMIC_ACQUIRE);
    if (tail - head >= (uint64_t)entries) {
        PyBuffer_Release(&view);
        result = PyLong_FromLong(0);
        goto out;
    }
    uint64_t user_data = tail + 1; /* unique per ring, never 0 */
    image[0] = (uint8_t)op;
    image[2] = (uint8_t)peer_len;
    image[3] = (uint8_t)rid_len;
    uint16_t counts[4] = {(uint16_t)src_runs, (uint16_t)dst_runs, (uint16_t)src_gens, (uint16_t)dst_gens};
    memcpy(image + 4, counts, 8);
    memcpy(image + 16, &user_data, 8);
    memcpy(image + 24, &src_region, 8);
    memcpy(image + 32, &dst_region, 8);
    memcpy(image + 40, layers, 16);
    memcpy(image + 56, peer, (size_t)peer_len);
    memcpy(image + 120, rid, (size_t)rid_len);
    memcpy(base + HEADER_BYTES + (Py_ssize_t)(tail % (uint64_t)entries) * slot_bytes, image, (size_t)at);
    /* The slot before the tail (release); the tail before the sleeping flag's
     * load (a full fence: a store may otherwise pass a later load). */
    __atomic_store_n(U64(base, SQ_TAIL), tail + 1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(U32(base, SIDECAR_SLEEPING), __ATOMIC_RELAXED) != 0) {
        __atomic_fetch_add(U32(base, SIDECAR_BELL), 1, __ATOMIC_SEQ_CST);
        futex(U32(base, SIDECAR_BELL), FUTEX_WAKE, INT32_MAX, NULL);
    }
    PyBuffer_Release(&view);
    result = PyLong_FromUnsignedLongLong(user_data);
out:
    if (image != small)
        PyMem_Free(image);
    return result;
}

static PyObject *decode_field(const uint8_t *p, unsigned len, unsigned max) {
    if (len > max)
        len = max;
    return PyUnicode_DecodeUTF8((const char *)p, len, "replace");
}

/* poll(mm, cq_offset, cq_entries) -> None, or the next completion as the
 * tuple (kind name, user data, transfer id, region id, bytes, elapsed us,
 * sequence, incarnation, request id, peer, failure side, code, message).
 * ValueError when the sidecar's tail is not within one ring of our head. */
static PyObject *poll(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "poll takes 3 arguments");
        return NULL;
    }
    Py_ssize_t cq_offset = PyLong_AsSsize_t(args[1]), entries = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (cq_offset < HEADER_BYTES || entries <= 0 || entries > (PY_SSIZE_T_MAX - cq_offset) / CQ_SLOT_BYTES) {
        PyErr_SetString(PyExc_ValueError, "ring geometry out of range");
        return NULL;
    }
    Py_buffer view;
    if (ring_view(args[0], &view, cq_offset + entries * CQ_SLOT_BYTES) < 0)
        return NULL;
    uint8_t *base = view.buf;
    uint64_t head = __atomic_load_n(U64(base, CQ_HEAD), __ATOMIC_RELAXED); /* ours alone */
    uint64_t tail = __atomic_load_n(U64(base, CQ_TAIL), __ATOMIC_ACQUIRE);
    if (tail == head) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    if (tail < head || tail - head > (uint64_t)entries) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "completion tail %llu is not within one ring of %llu",
                     (unsigned long long)tail, (unsigned long long)head);
        return NULL;
    }
    /* Copied out before the head moves: the sidecar may then reuse the slot. */
    uint8_t c[CQ_SLOT_BYTES];
    memcpy(c, base + cq_offset + (Py_ssize_t)(head % (uint64_t)entries) * CQ_SLOT_BYTES, CQ_SLOT_BYTES);
    __atomic_store_n(U64(base, CQ_HEAD), head + 1, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    uint64_t w[7];
    memcpy(w, c + 8, sizeof w);
    PyObject *kind = NULL;
    if (kind_names != NULL && c[0] < PyTuple_GET_SIZE(kind_names) &&
        PyTuple_GET_ITEM(kind_names, c[0]) != Py_None) {
        kind = PyTuple_GET_ITEM(kind_names, c[0]);
        Py_INCREF(kind);
    } else {
        kind = PyUnicode_FromFormat("UNKNOWN_%u", (unsigned)c[0]);
    }
    PyObject *t = Py_BuildValue("(NKKKKKKKNNiNN)", kind, (unsigned long long)w[0], (unsigned long long)w[1],
                         (unsigned long long)w[2], (unsigned long long)w[3], (unsigned long long)w[4],
                         (unsigned long long)w[5], (unsigned long long)w[6], decode_field(c + 64, c[2], 128),
                         decode_field(c + 192, c[3], 64), (int)c[1],
                         decode_field(c + 256, c[4], 32), decode_field(c + 288, c[5], 224));
    if (t == NULL || completion_type == NULL)
        return t;
    /* As RingCompletion._make(t), without its Python frame. */
    PyObject *pack = PyTuple_Pack(1, t);
    Py_DECREF(t);
    if (pack == NULL)
        return NULL;
    PyObject *c_obj = PyTuple_Type.tp_new(completion_type, pack, NULL);
    Py_DECREF(pack);
    return c_obj;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* spin(mm, seconds) -> whether a completion was published within `seconds`
 * of busy polling (the interpreter lock is held: a spin is short). */
static PyObject *spin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "spin takes 2 arguments");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (!isfinite(seconds) || seconds > 1.0) {
        PyErr_SetString(PyExc_ValueError, "a spin lasts a finite time of at most 1 s");
        return NULL;
    }
    Py_buffer view;
    if (ring_view(args[0], &view, HEADER_BYTES) < 0)
        return NULL;
    uint8_t *base = view.buf;
    uint64_t head = __atomic_load_n(U64(base, CQ_HEAD), __ATOMIC_RELAXED);
    double until = now_s() + seconds;
    int seen = 0;
    for (unsigned i = 0;; i++) {
        if (__atomic_load_n(U64(base, CQ_TAIL), __ATOMIC_ACQUIRE) != head) {
            seen = 1;
            break;
        }
        if ((i & 63) == 0 && now_s() >= until)
            break;
        cpu_relax();
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(seen);
}

/* sleep(mm, seconds): sleeps on the worker's bell until the sidecar rings it,
 * `seconds` pass, or a completion is already there (checked after the
 * sleeping flag is raised, so a ring in between is not missed). */
static PyObject *sleep_on_bell(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "sleep takes 2 arguments");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (!isfinite(seconds)) {
        PyErr_SetString(PyExc_ValueError, "a sleep lasts a finite time");
        return NULL;
    }
    if (seconds < 0)
        seconds = 0;
    if (seconds > 3600)
        seconds = 3600;
    Py_buffer view;
    if (ring_view(args[0], &view, HEADER_BYTES) < 0)
        return NULL;
    uint8_t *base = view.buf;
    uint32_t seen = __atomic_load_n(U32(base, WORKER_BELL), __ATOMIC_ACQUIRE);
    __atomic_store_n(U32(base, WORKER_SLEEPING), 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t head = __atomic_load_n(U64(base, CQ_HEAD), __ATOMIC_RELAXED);
    if (__atomic_load_n(U64(base, CQ_TAIL), __ATOMIC_ACQUIRE) == head &&
        __atomic_load_n(U32(base, STATE), __ATOMIC_ACQUIRE) != STATE_CLOSED) {
        struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
        Py_BEGIN_ALLOW_THREADS
        futex(U32(base, WORKER_BELL), FUTEX_WAIT, seen, &ts);
        Py_END_ALLOW_THREADS
    }
    __atomic_store_n(U32(base, WORKER_SLEEPING), 0, __ATOMIC_RELAXED);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* set_types(kind_names, RingCompletion, RingTooLarge): what poll and submit
 * hand back. */
static PyObject *set_types(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyTuple_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type) || !PyExceptionClass_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "set_types(kind names tuple, a tuple subclass, an exception class)");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(kind_names, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(completion_type, (PyTypeObject *)args[1]);
    Py_INCREF(args[2]);
    Py_XSETREF(too_large_error, args[2]);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"submit", (PyCFunction)(void (*)(void))submit, METH_FASTCALL, "Publishes one submission."},
    {"poll", (PyCFunction)(void (*)(void))poll, METH_FASTCALL, "Takes the next completion, if any."},
    {"spin", (PyCFunction)(void (*)(void))spin, METH_FASTCALL, "Busy-polls for a completion."},
    {"sleep", (PyCFunction)(void (*)(void))sleep_on_bell, METH_FASTCALL, "Sleeps on the worker's bell."},
    {"set_types", (PyCFunction)(void (*)(void))set_types, METH_FASTCALL, "What poll and submit hand back."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ring_native", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ring_native(void) { return PyModule_Create(&module); }
