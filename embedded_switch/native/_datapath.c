/* The embedded switch's native data path: a compiled flow cache and batched AF_PACKET I/O.
 *
 * The P4 program is still interpreted by the Python reference (embedded_switch/pipeline.py,
 * Pipeline._decide). What this module compiles is the *decision* the interpreter made for one
 * flow key (the header fields the program reads, and the ingress port): which counter cells
 * to bump, which drops to count, and per output frame the bytes that differ from the input
 * (MACs, TTL, protocol, IPv4 destination, bytes 36..45). Later frames with the same key are
 * handled here with no Python at all: verify the IPv4 checksum, patch, send. Everything else
 * (frames shorter than the key, a miss, a checksum that does not verify, a multicast group
 * changed since) goes to Pipeline.native_miss, which runs exactly the Python path.
 *
 * FlowCache   the flows of one Pipeline; process(pipeline, frames, port) -> [(port, bytearray)]
 * PortIO      the ports' sockets: epoll, recvmmsg into preallocated buffers, the flow cache,
 *             sendmmsg per egress port (the unchanged payload sent from the receive buffer);
 *             poll(timeout_ms) returns what needs Python (wake-ups, frames for
 *             special ports, port errors)
 * send_frames the benchmark's generator: sendmmsg of prepared frames
 *
 * Counters are kept per flow while a batch runs and added to the Python objects (the P4
 * counter lists, DropStats, PortStats) at the end of every batch, so they read exactly as
 * the Python path's once the batch is done. Every length is checked against the buffer it
 * describes; frames shorter than CACHED_MIN_BYTES never reach the compiled path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netpacket/packet.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* ---- frame layout (pipeline.py: _ETH_END, _IPV4_END, _KEY, _CHECKMATE_END) ---------------- */
#define ETH_END 14
#define IPV4_END 34
#define KEY_START 12
#define KEY_BYTES 58        /* _KEY.size: bytes 12..69 */
#define KEY_PADDED 64
#define CACHED_MIN_BYTES 74 /* _CHECKMATE_END: shorter frames are always interpreted */
#define HDR_BYTES 46        /* an output differs from its input in bytes 0..45 only */
#define MAX_PORT_NUMBER 511

#define FLOW_LIMIT 4096 /* _CACHE_LIMIT: when full, the cache starts over */
#define SLOT_COUNT 8192 /* open addressing, power of two, load <= 1/2 */
#define MAX_EVENTS 64
#define MAX_ROUNDS 16  /* receive batches per ready port and poll */
#define TX_SLOTS 256   /* frames queued per egress port before a sendmmsg */

static uint8_t key_mask[KEY_PADDED];

/* Interned names. */
static PyObject *s_packets, *s_bytes, *s_native_miss, *s_cache_view, *s_drops, *s_flows, *s_pipeline;
static PyObject *s_rx_packets, *s_rx_bytes, *s_tx_packets, *s_tx_bytes;

/* ---- compiled decisions ---------------------------------------------------------------- */
typedef struct {
    PyObject *counter; /* a CounterArray (owned) */
    Py_ssize_t index;
} Cell;

typedef struct {
    long reason;
    long port;
} Drop;

typedef struct {
    int port;
    uint8_t macs[12];
    uint8_t ttl, proto;
    uint8_t has_dst, has_tail;
    uint8_t dst[4];
    uint8_t tail[10];
} Out;

typedef struct {
    uint8_t key[KEY_PADDED];
    uint64_t hash;
    int port;
    int needs_checksum;
    PyObject *group_key; /* the multicast group as a Python int (owned), or NULL: none */
    PyObject *replicas;  /* the group's replica tuple (or None) the decision was made with (owned) */
    Cell *cells;         /* ingress counter cells and every output's cells: all bump alike */
    Py_ssize_t ncells;
    Drop *drops;
    Py_ssize_t ndrops;
    Out *outs;
    Py_ssize_t nouts;
    uint64_t pend_packets, pend_bytes; /* not yet added to the Python counters */
    int dirty;
} Flow;

typedef struct {
    PyObject_HEAD
    Flow *flows;
    int32_t *slots; /* flow index + 1; 0: empty */
    Py_ssize_t nflows;
    int32_t *dirty;
    Py_ssize_t ndirty;
    PyObject *token;
    unsigned long long hits, misses;
} FlowCache;

/* Where outputs go: a Python list (process) or the ports' transmit queues (PortIO). */
typedef struct Sink {
    /* A compiled output: hdr[0..HDR_BYTES) then rest[0..rest_len). */
    int (*compiled)(struct Sink *, int port, const uint8_t *hdr, const uint8_t *rest, size_t rest_len);
    /* An output the Python path built (a bytearray; the sink takes a new reference if it keeps it). */
    int (*python)(struct Sink *, PyObject *port, PyObject *frame);
} Sink;

static void flow_release(Flow *f) {
    Py_CLEAR(f->group_key);
    Py_CLEAR(f->replicas);
    for (Py_ssize_t i = 0; i < f->ncells; i++) Py_CLEAR(f->cells[i].counter);
    PyMem_Free(f->cells);
    PyMem_Free(f->drops);
    PyMem_Free(f->outs);
    f->cells = NULL;
    f->drops = NULL;
    f->outs = NULL;
    f->ncells = f->ndrops = f->nouts = 0;
    f->pend_packets = f->pend_bytes = 0;
    f->dirty = 0;
}

/* counter.<attr>[index] += delta, on whatever sequence the attribute holds now. */
static int bump(PyObject *counter, PyObject *attr, Py_ssize_t index, unsigned long long delta) {
    PyObject *seq = PyObject_GetAttr(counter, attr);
    if (seq == NULL) return -1;
    PyObject *old = PySequence_GetItem(seq, index);
    PyObject *d = old ? PyLong_FromUnsignedLongLong(delta) : NULL;
    PyObject *sum = d ? PyNumber_Add(old, d) : NULL;
    int rc = sum ? PySequence_SetItem(seq, index, sum) : -1;
    Py_XDECREF(sum);
    Py_XDECREF(d);
    Py_XDECREF(old);
    Py_DECREF(seq);
    return rc;
}

/* drops.count(reason, port, n) */
static int drops_count(PyObject *drops, long reason, long port, unsigned long long n) {
    PyObject *r = PyObject_CallMethod(drops, "count", "llK", reason, port, n);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Add a flow's pending counts to the Python objects. */
static int flow_flush(Flow *f, PyObject *drops) {
    unsigned long long packets = f->pend_packets, nbytes = f->pend_bytes;
    f->pend_packets = f->pend_bytes = 0;
    f->dirty = 0;
    if (packets == 0) return 0;
    for (Py_ssize_t i = 0; i < f->ncells; i++) {
        if (bump(f->cells[i].counter, s_packets, f->cells[i].index, packets) < 0) return -1;
        if (bump(f->cells[i].counter, s_bytes, f->cells[i].index, nbytes) < 0) return -1;
    }
    for (Py_ssize_t i = 0; i < f->ndrops; i++)
        if (drops_count(drops, f->drops[i].reason, f->drops[i].port, packets) < 0) return -1;
    return 0;
}

static int cache_flush(FlowCache *fc, PyObject *drops) {
    int rc = 0;
    for (Py_ssize_t i = 0; i < fc->ndirty; i++) {
        Flow *f = &fc->flows[fc->dirty[i]];
        if (f->dirty && flow_flush(f, drops) < 0) rc = -1; /* go on: the others still count */
    }
    fc->ndirty = 0;
    return rc;
}

static void cache_clear(FlowCache *fc) {
    for (Py_ssize_t i = 0; i < fc->nflows; i++) flow_release(&fc->flows[i]);
    memset(fc->slots, 0, sizeof(int32_t) * SLOT_COUNT);
    fc->nflows = 0;
    fc->ndirty = 0;
}

static inline uint64_t key_hash(const uint8_t *key, int port) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)(unsigned)port;
    for (int i = 0; i < KEY_PADDED; i += 8) {
        uint64_t w;
        memcpy(&w, key + i, 8);
        h ^= w;
        h *= 0xFF51AFD7ED558CCDULL;
        h ^= h >> 32;
    }
    return h;
}

static inline void make_key(const uint8_t *frame, uint8_t *key) {
    /* caller guarantees frame holds at least KEY_START + KEY_BYTES bytes */
    for (int i = 0; i < KEY_BYTES; i++) key[i] = frame[KEY_START + i] & key_mask[i];
    memset(key + KEY_BYTES, 0, KEY_PADDED - KEY_BYTES);
}

/* The slot for (port, key): the one holding it, or the empty one where it would go. */
static int32_t *cache_slot(FlowCache *fc, const uint8_t *key, int port, uint64_t hash) {
    size_t i = (size_t)hash & (SLOT_COUNT - 1);
    for (;;) {
        int32_t *slot = &fc->slots[i];
        if (*slot == 0) return slot;
        Flow *f = &fc->flows[*slot - 1];
        if (f->hash == hash && f->port == port && memcmp(f->key, key, KEY_PADDED) == 0) return slot;
        i = (i + 1) & (SLOT_COUNT - 1);
    }
}

static int get_long(PyObject *o, long lo, long hi, long *out) {
    if (!PyLong_Check(o)) return 0;
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (v < lo || v > hi) return 0;
    *out = v;
    return 1;
}

static int get_bytes(PyObject *o, Py_ssize_t n, uint8_t *out) {
    if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) != n) return 0;
    memcpy(out, PyBytes_AS_STRING(o), (size_t)n);
    return 1;
}

/* Append the cells of a tuple of (CounterArray, index) pairs to f->cells. 1: done, 0: unusable. */
static int add_cells(Flow *f, PyObject *cells, Py_ssize_t *capacity) {
    if (!PyTuple_Check(cells)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(cells); i++) {
        PyObject *cell = PyTuple_GET_ITEM(cells, i);
        long index;
        if (!PyTuple_Check(cell) || PyTuple_GET_SIZE(cell) != 2) return 0;
        if (!get_long(PyTuple_GET_ITEM(cell, 1), 0, PY_SSIZE_T_MAX, &index)) return 0;
        if (f->ncells == *capacity) {
            Py_ssize_t grown = *capacity ? *capacity * 2 : 4;
            Cell *c = PyMem_Realloc(f->cells, sizeof(Cell) * (size_t)grown);
            if (c == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            f->cells = c;
            *capacity = grown;
        }
        PyObject *counter = PyTuple_GET_ITEM(cell, 0);
        Py_INCREF(counter);
        f->cells[f->ncells].counter = counter;
        f->cells[f->ncells].index = (Py_ssize_t)index;
        f->ncells++;
    }
    return 1;
}

/* Fill f from a pipeline _Decision tuple. 1: compiled; 0: not a shape this cache takes (f emptied);
 * -1: out of memory (exception set). */
static int compile_decision(Flow *f, PyObject *d) {
    Py_ssize_t cell_capacity = 0;
    int ok;
    if (!PyTuple_Check(d) || PyTuple_GET_SIZE(d) != 6) return 0;
    PyObject *needs = PyTuple_GET_ITEM(d, 0), *group = PyTuple_GET_ITEM(d, 1);
    PyObject *replicas = PyTuple_GET_ITEM(d, 2), *counts = PyTuple_GET_ITEM(d, 3);
    PyObject *drops = PyTuple_GET_ITEM(d, 4), *outputs = PyTuple_GET_ITEM(d, 5);
    long group_id, v;
    if (!PyBool_Check(needs) || !get_long(group, 0, LONG_MAX, &group_id)) return 0;
    if (!PyTuple_Check(drops) || !PyTuple_Check(outputs)) return 0;
    f->needs_checksum = needs == Py_True;
    if (group_id != 0) {
        Py_INCREF(group);
        f->group_key = group;
        Py_INCREF(replicas);
        f->replicas = replicas;
    }
    ok = add_cells(f, counts, &cell_capacity);
    if (ok <= 0) goto fail;
    f->ndrops = PyTuple_GET_SIZE(drops);
    f->drops = PyMem_Calloc((size_t)f->ndrops + 1, sizeof(Drop));
    if (f->drops == NULL) goto nomem;
    for (Py_ssize_t i = 0; i < f->ndrops; i++) {
        PyObject *item = PyTuple_GET_ITEM(drops, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) goto unusable;
        if (!get_long(PyTuple_GET_ITEM(item, 0), LONG_MIN, LONG_MAX, &f->drops[i].reason)) goto unusable;
        if (!get_long(PyTuple_GET_ITEM(item, 1), LONG_MIN, LONG_MAX, &f->drops[i].port)) goto unusable;
    }
    f->nouts = PyTuple_GET_SIZE(outputs);
    f->outs = PyMem_Calloc((size_t)f->nouts + 1, sizeof(Out));
    if (f->outs == NULL) goto nomem;
    for (Py_ssize_t i = 0; i < f->nouts; i++) {
        PyObject *item = PyTuple_GET_ITEM(outputs, i);
        Out *o = &f->outs[i];
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 8) goto unusable;
        if (!get_long(PyTuple_GET_ITEM(item, 0), INT_MIN, INT_MAX, &v)) goto unusable;
        o->port = (int)v;
        if (!get_bytes(PyTuple_GET_ITEM(item, 1), 12, o->macs)) goto unusable;
        if (!get_long(PyTuple_GET_ITEM(item, 2), 0, 255, &v)) goto unusable;
        o->ttl = (uint8_t)v;
        if (!get_long(PyTuple_GET_ITEM(item, 3), 0, 255, &v)) goto unusable;
        o->proto = (uint8_t)v;
        /* item 4, the header delta, is not needed: the checksum is computed from the patched header */
        PyObject *dst = PyTuple_GET_ITEM(item, 5), *tail = PyTuple_GET_ITEM(item, 6);
        o->has_dst = dst != Py_None;
        if (o->has_dst && !get_bytes(dst, 4, o->dst)) goto unusable;
        o->has_tail = tail != Py_None;
        if (o->has_tail && !get_bytes(tail, 10, o->tail)) goto unusable;
        ok = add_cells(f, PyTuple_GET_ITEM(item, 7), &cell_capacity);
        if (ok < 0) goto nomem_set;
        if (ok == 0) goto unusable;
    }
    return 1;
nomem:
    PyErr_NoMemory();
nomem_set:
    flow_release(f);
    return -1;
unusable:
    flow_release(f);
    return 0;
fail:
    flow_release(f);
    if (ok < 0) return -1;
    return 0;
}

/* ---- the per-frame path ------------------------------------------------------------------- */
static inline uint32_t words_sum(const uint8_t *h, int skip) {
    /* the 16-bit words of bytes h[0..20), leaving out the word at byte offset `skip` */
    uint32_t s = 0;
    for (int i = 0; i < 20; i += 2)
        if (i != skip) s += ((uint32_t)h[i] << 8) | h[i + 1];
    return s;
}

static inline uint16_t csum_of_sum(uint32_t s) {
    /* pipeline.py: ((total - 1) % 0xFFFF + 1) ^ 0xFFFF, total congruent to s modulo 0xFFFF */
    return (uint16_t)(((s + 0xFFFEu) % 0xFFFFu + 1u) ^ 0xFFFFu);
}

typedef struct {
    FlowCache *fc;
    PyObject *pipeline;
    PyObject *groups; /* borrowed from view */
    PyObject *view;   /* owned: (token, groups) */
    PyObject *drops;  /* owned: pipeline.drops */
    PyObject *port_obj;
    Sink *sink;
} Run;

static int run_begin(Run *run, FlowCache *fc, PyObject *pipeline, int port, Sink *sink) {
    memset(run, 0, sizeof(*run));
    run->fc = fc;
    run->pipeline = pipeline;
    run->sink = sink;
    run->view = PyObject_CallMethodNoArgs(pipeline, s_cache_view);
    if (run->view == NULL) return -1;
    if (!PyTuple_Check(run->view) || PyTuple_GET_SIZE(run->view) != 2 ||
        !PyDict_Check(PyTuple_GET_ITEM(run->view, 1))) {
        PyErr_SetString(PyExc_TypeError, "cache_view() must return (token, dict of multicast groups)");
        return -1;
    }
    PyObject *token = PyTuple_GET_ITEM(run->view, 0);
    run->groups = PyTuple_GET_ITEM(run->view, 1);
    int same = fc->token == NULL ? 0 : PyObject_RichCompareBool(fc->token, token, Py_EQ);
    if (same < 0) return -1;
    if (!same) {
        cache_clear(fc);
        Py_INCREF(token);
        Py_XSETREF(fc->token, token);
    }
    run->drops = PyObject_GetAttr(pipeline, s_drops);
    if (run->drops == NULL) return -1;
    run->port_obj = PyLong_FromLong(port);
    return run->port_obj == NULL ? -1 : 0;
}

static int run_end(Run *run) {
    int rc = run->drops ? cache_flush(run->fc, run->drops) : 0;
    Py_CLEAR(run->view);
    Py_CLEAR(run->drops);
    Py_CLEAR(run->port_obj);
    return rc;
}

static int mark_dirty(Run *run, Flow *f) {
    FlowCache *fc = run->fc;
    if (f->dirty) return 0;
    /* A flow flushed early (replaced) and run again can be listed twice: never overrun the list. */
    if (fc->ndirty == FLOW_LIMIT && cache_flush(fc, run->drops) < 0) return -1;
    f->dirty = 1;
    fc->dirty[fc->ndirty++] = (int32_t)(f - fc->flows);
    return 0;
}

/* Run the compiled decision on one frame (n >= CACHED_MIN_BYTES). */
static int execute(Run *run, Flow *f, const uint8_t *frame, size_t n) {
    if (mark_dirty(run, f) < 0) return -1;
    f->pend_packets++;
    f->pend_bytes += n;
    for (Py_ssize_t i = 0; i < f->nouts; i++) {
        const Out *o = &f->outs[i];
        uint8_t hdr[HDR_BYTES];
        memcpy(hdr, frame, HDR_BYTES);
        memcpy(hdr, o->macs, 12);
        hdr[22] = o->ttl;
        hdr[23] = o->proto;
        if (o->has_dst) memcpy(hdr + 30, o->dst, 4);
        if (o->has_tail) memcpy(hdr + 36, o->tail, 10);
        uint16_t c = csum_of_sum(words_sum(hdr + ETH_END, 10));
        hdr[24] = (uint8_t)(c >> 8);
        hdr[25] = (uint8_t)c;
        if (run->sink->compiled(run->sink, o->port, hdr, frame + HDR_BYTES, n - HDR_BYTES) < 0) return -1;
    }
    return 0;
}

/* The Python path for one frame; caches the decision it returns under (port, key) when key != NULL. */
static int miss(Run *run, const uint8_t *frame, size_t n, int port, const uint8_t *key, uint64_t hash) {
    FlowCache *fc = run->fc;
    fc->misses++;
    PyObject *data = PyBytes_FromStringAndSize((const char *)frame, (Py_ssize_t)n);
    if (data == NULL) return -1;
    PyObject *res = PyObject_CallMethodObjArgs(run->pipeline, s_native_miss, data, run->port_obj, NULL);
    Py_DECREF(data);
    if (res == NULL) return -1;
    int rc = -1;
    if (!PyTuple_Check(res) || PyTuple_GET_SIZE(res) != 2 || !PyList_Check(PyTuple_GET_ITEM(res, 0))) {
        PyErr_SetString(PyExc_TypeError, "native_miss() must return (list of outputs, decision or None)");
        goto done;
    }
    PyObject *outputs = PyTuple_GET_ITEM(res, 0), *decision = PyTuple_GET_ITEM(res, 1);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(outputs); i++) {
        PyObject *item = PyList_GET_ITEM(outputs, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2 || !PyByteArray_Check(PyTuple_GET_ITEM(item, 1))) {
            PyErr_SetString(PyExc_TypeError, "native_miss() outputs must be (port, bytearray)");
            goto done;
        }
        if (run->sink->python(run->sink, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1)) < 0) goto done;
    }
    if (decision != Py_None && key != NULL) {
        int32_t *slot = cache_slot(fc, key, port, hash);
        Flow *f;
        if (*slot != 0) { /* replace: count what the old decision still owes first */
            f = &fc->flows[*slot - 1];
            if (f->dirty && flow_flush(f, run->drops) < 0) goto done;
            flow_release(f);
        } else {
            if (fc->nflows == FLOW_LIMIT) {
                if (cache_flush(fc, run->drops) < 0) goto done;
                cache_clear(fc);
                slot = cache_slot(fc, key, port, hash);
            }
            f = &fc->flows[fc->nflows];
            memset(f, 0, sizeof(*f));
            memcpy(f->key, key, KEY_PADDED);
            f->hash = hash;
            f->port = port;
        }
        int compiled = compile_decision(f, decision);
        if (compiled < 0) goto done;
        if (compiled == 0) { /* not cacheable: leave the slot empty (or the old entry removed) */
            if (*slot != 0) { /* an entry that was replaced: keep an empty, never-matching shell */
                memset(f->key, 0xFF, KEY_PADDED);
                f->port = -1;
            }
        } else if (*slot == 0) {
            *slot = (int32_t)(fc->nflows + 1);
            fc->nflows++;
        }
    }
    rc = 0;
done:
    Py_DECREF(res);
    return rc;
}

static int process_frame(Run *run, const uint8_t *frame, size_t n, int port) {
    FlowCache *fc = run->fc;
    if (n < CACHED_MIN_BYTES) return miss(run, frame, n, port, NULL, 0);
    uint8_t key[KEY_PADDED];
    make_key(frame, key);
    uint64_t hash = key_hash(key, port);
    int32_t *slot = cache_slot(fc, key, port, hash);
    if (*slot == 0) return miss(run, frame, n, port, key, hash);
    Flow *f = &fc->flows[*slot - 1];
    if (f->group_key != NULL) {
        PyObject *now = PyDict_GetItemWithError(run->groups, f->group_key);
        if (now == NULL && PyErr_Occurred()) return -1;
        if ((now ? now : Py_None) != f->replicas) return miss(run, frame, n, port, key, hash);
    }
    if (f->needs_checksum) {
        const uint8_t *ip = frame + ETH_END;
        uint32_t s = words_sum(ip, 10);
        uint16_t stored = (uint16_t)((ip[10] << 8) | ip[11]);
        if (s == 0 || csum_of_sum(s) != stored) return miss(run, frame, n, port, key, hash);
    }
    fc->hits++;
    return execute(run, f, frame, n);
}

/* ---- FlowCache --------------------------------------------------------------------------- */
static PyObject *FlowCache_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return NULL;
    FlowCache *self = (FlowCache *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->flows = PyMem_Calloc(FLOW_LIMIT, sizeof(Flow));
    self->slots = PyMem_Calloc(SLOT_COUNT, sizeof(int32_t));
    self->dirty = PyMem_Calloc(FLOW_LIMIT, sizeof(int32_t));
    if (!self->flows || !self->slots || !self->dirty) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void FlowCache_dealloc(FlowCache *self) {
    if (self->flows) cache_clear(self);
    PyMem_Free(self->flows);
    PyMem_Free(self->slots);
    PyMem_Free(self->dirty);
    Py_XDECREF(self->token);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
    Sink base;
    PyObject *list;
} ListSink;

static int list_compiled(Sink *s, int port, const uint8_t *hdr, const uint8_t *rest, size_t rest_len) {
    ListSink *ls = (ListSink *)s;
    PyObject *frame = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(HDR_BYTES + rest_len));
    if (frame == NULL) return -1;
    memcpy(PyByteArray_AS_STRING(frame), hdr, HDR_BYTES);
    memcpy(PyByteArray_AS_STRING(frame) + HDR_BYTES, rest, rest_len);
    PyObject *item = Py_BuildValue("(iN)", port, frame);
    if (item == NULL) return -1;
    int rc = PyList_Append(ls->list, item);
    Py_DECREF(item);
    return rc;
}

static int list_python(Sink *s, PyObject *port, PyObject *frame) {
    ListSink *ls = (ListSink *)s;
    PyObject *item = PyTuple_Pack(2, port, frame);
    if (item == NULL) return -1;
    int rc = PyList_Append(ls->list, item);
    Py_DECREF(item);
    return rc;
}

static PyObject *FlowCache_process(FlowCache *self, PyObject *args) {
    PyObject *pipeline, *frames;
    int port;
    if (!PyArg_ParseTuple(args, "OOi:process", &pipeline, &frames, &port)) return NULL;
    PyObject *seq = PySequence_Fast(frames, "frames must be a sequence");
    if (seq == NULL) return NULL;
    ListSink sink = {{list_compiled, list_python}, PyList_New(0)};
    Run run;
    memset(&run, 0, sizeof(run));
    int rc = sink.list ? run_begin(&run, self, pipeline, port, &sink.base) : -1;
    for (Py_ssize_t i = 0; rc == 0 && i < PySequence_Fast_GET_SIZE(seq); i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_SIMPLE) < 0) {
            rc = -1;
            break;
        }
        rc = process_frame(&run, view.buf, (size_t)view.len, port);
        PyBuffer_Release(&view);
    }
    PyObject *exc = NULL, *val = NULL, *tb = NULL;
    if (rc < 0) PyErr_Fetch(&exc, &val, &tb);
    int end = run_end(&run);
    Py_DECREF(seq);
    if (rc < 0) {
        PyErr_Restore(exc, val, tb);
        Py_XDECREF(sink.list);
        return NULL;
    }
    if (end < 0) {
        Py_XDECREF(sink.list);
        return NULL;
    }
    return sink.list;
}

static PyObject *FlowCache_clear(FlowCache *self, PyObject *Py_UNUSED(ignored)) {
    cache_clear(self);
    Py_CLEAR(self->token);
    Py_RETURN_NONE;
}

static Py_ssize_t FlowCache_len(FlowCache *self) { return self->nflows; }

static PyObject *FlowCache_stats(FlowCache *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{sKsKsn}", "hits", self->hits, "misses", self->misses, "flows", self->nflows);
}

static PyMethodDef FlowCache_methods[] = {
    {"process", (PyCFunction)FlowCache_process, METH_VARARGS,
     "process(pipeline, frames, port) -> [(egress port, bytearray)]: run frames received on one port"},
    {"clear", (PyCFunction)FlowCache_clear, METH_NOARGS, "forget every compiled flow"},
    {"stats", (PyCFunction)FlowCache_stats, METH_NOARGS, "{'hits', 'misses', 'flows'}"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods FlowCache_as_sequence = {.sq_length = (lenfunc)FlowCache_len};

static PyTypeObject FlowCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "embedded_switch.native._datapath.FlowCache",
    .tp_basicsize = sizeof(FlowCache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled decisions of one Pipeline, by (ingress port, flow key).",
    .tp_new = FlowCache_new,
    .tp_dealloc = (destructor)FlowCache_dealloc,
    .tp_methods = FlowCache_methods,
    .tp_as_sequence = &FlowCache_as_sequence,
};

/* ---- PortIO ------------------------------------------------------------------------------- */
typedef struct {
    uint8_t hdr[HDR_BYTES];
    struct iovec iov[2];
    PyObject *obj; /* a bytearray held until sent, or NULL */
    size_t len;
} TxSlot;

typedef struct {
    int fd;
    int port;
    int plain; /* frames to it are sent here; otherwise they go back to Python */
    int sees_outgoing;
    int registered;
    PyObject *stats; /* PortStats */
    uint8_t *rxbuf;
    struct mmsghdr *rxmsgs;
    struct iovec *rxiov;
    struct sockaddr_ll *rxaddr;
    TxSlot *tx;
    struct mmsghdr *txmsgs;
    int ntx;
    unsigned long long rx_packets, rx_bytes, tx_packets, tx_bytes;
    unsigned long long truncated, no_pipeline, tx_errors;
    int tx_errno;
} IoPort;

typedef struct {
    PyObject_HEAD
    int epfd;
    int wake_fd;
    int nports;
    int batch;
    size_t rx_buffer_bytes;
    IoPort *ports;
    int16_t by_number[MAX_PORT_NUMBER + 1]; /* port number -> index, -1: none */
    PyObject *drops;                        /* DropStats of the I/O layer */
    PyObject *owner;                        /* whose ``_pipeline`` runs the frames (read per port batch) */
    long reason_truncated, reason_no_pipeline, reason_tx_error;
    unsigned long long polls, rx_calls, rx_frames, tx_calls, tx_frames; /* how well the batching works */
    PyObject *specials; /* list being filled during poll */
    PyObject *errors;
    int ingress_port; /* of the batch being processed */
} PortIO;

typedef struct {
    Sink base;
    PortIO *io;
} IoSink;

static int io_flush_port(PortIO *io, IoPort *p) {
    int i = 0, n = p->ntx;
    for (int k = 0; k < n; k++) {
        TxSlot *s = &p->tx[k];
        struct msghdr *m = &p->txmsgs[k].msg_hdr;
        memset(m, 0, sizeof(*m));
        m->msg_iov = s->iov;
        m->msg_iovlen = s->obj ? 1 : 2;
    }
    while (i < n) {
        int r;
        Py_BEGIN_ALLOW_THREADS
        r = sendmmsg(p->fd, &p->txmsgs[i], (unsigned)(n - i), 0);
        Py_END_ALLOW_THREADS
        io->tx_calls++;
        if (r < 0) {
            if (errno == EINTR) continue;
            p->tx_errors++; /* the frame at i was refused: counted as TX_ERROR, the rest go on */
            p->tx_errno = errno;
            i++;
            continue;
        }
        for (int k = i; k < i + r; k++) {
            p->tx_packets++;
            p->tx_bytes += p->tx[k].len;
        }
        io->tx_frames += (unsigned long long)r;
        i += r;
    }
    for (int k = 0; k < n; k++) Py_CLEAR(p->tx[k].obj);
    p->ntx = 0;
    return 0;
}

static int io_special(PortIO *io, PyObject *port, PyObject *frame) {
    PyObject *item = Py_BuildValue("(OOi)", port, frame, io->ingress_port);
    if (item == NULL) return -1;
    int rc = PyList_Append(io->specials, item);
    Py_DECREF(item);
    return rc;
}

static inline IoPort *io_plain(PortIO *io, int port) {
    if (port < 0 || port > MAX_PORT_NUMBER) return NULL;
    int idx = io->by_number[port];
    if (idx < 0 || !io->ports[idx].plain) return NULL;
    return &io->ports[idx];
}

static int io_compiled(Sink *s, int port, const uint8_t *hdr, const uint8_t *rest, size_t rest_len) {
    PortIO *io = ((IoSink *)s)->io;
    IoPort *p = io_plain(io, port);
    if (p == NULL) { /* the long way: Python's _transmit_special */
        PyObject *frame = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(HDR_BYTES + rest_len));
        if (frame == NULL) return -1;
        memcpy(PyByteArray_AS_STRING(frame), hdr, HDR_BYTES);
        memcpy(PyByteArray_AS_STRING(frame) + HDR_BYTES, rest, rest_len);
        PyObject *port_obj = PyLong_FromLong(port);
        int rc = port_obj ? io_special(io, port_obj, frame) : -1;
        Py_XDECREF(port_obj);
        Py_DECREF(frame);
        return rc;
    }
    if (p->ntx == TX_SLOTS) io_flush_port(io, p);
    TxSlot *t = &p->tx[p->ntx++];
    memcpy(t->hdr, hdr, HDR_BYTES);
    t->iov[0].iov_base = t->hdr;
    t->iov[0].iov_len = HDR_BYTES;
    t->iov[1].iov_base = (void *)rest; /* the receive buffer: valid until the batch's flush */
    t->iov[1].iov_len = rest_len;
    t->obj = NULL;
    t->len = HDR_BYTES + rest_len;
    return 0;
}

static int io_python(Sink *s, PyObject *port_obj, PyObject *frame) {
    PortIO *io = ((IoSink *)s)->io;
    long port;
    IoPort *p = get_long(port_obj, 0, MAX_PORT_NUMBER, &port) ? io_plain(io, (int)port) : NULL;
    if (p == NULL) return io_special(io, port_obj, frame);
    if (p->ntx == TX_SLOTS) io_flush_port(io, p);
    TxSlot *t = &p->tx[p->ntx++];
    Py_INCREF(frame);
    t->obj = frame;
    t->iov[0].iov_base = PyByteArray_AS_STRING(frame);
    t->iov[0].iov_len = (size_t)PyByteArray_GET_SIZE(frame);
    t->len = t->iov[0].iov_len;
    return 0;
}

static int io_flush_all(PortIO *io) {
    for (int i = 0; i < io->nports; i++)
        if (io->ports[i].ntx) io_flush_port(io, &io->ports[i]);
    return 0;
}

static int add_attr(PyObject *obj, PyObject *name, unsigned long long delta) {
    if (delta == 0) return 0;
    PyObject *old = PyObject_GetAttr(obj, name);
    PyObject *d = old ? PyLong_FromUnsignedLongLong(delta) : NULL;
    PyObject *sum = d ? PyNumber_Add(old, d) : NULL;
    int rc = sum ? PyObject_SetAttr(obj, name, sum) : -1;
    Py_XDECREF(sum);
    Py_XDECREF(d);
    Py_XDECREF(old);
    return rc;
}

/* Port statistics and the I/O layer's drops into the Python objects. */
static int io_publish(PortIO *io) {
    int rc = 0;
    for (int i = 0; i < io->nports; i++) {
        IoPort *p = &io->ports[i];
        if (add_attr(p->stats, s_rx_packets, p->rx_packets) < 0 || add_attr(p->stats, s_rx_bytes, p->rx_bytes) < 0 ||
            add_attr(p->stats, s_tx_packets, p->tx_packets) < 0 || add_attr(p->stats, s_tx_bytes, p->tx_bytes) < 0)
            rc = -1;
        p->rx_packets = p->rx_bytes = p->tx_packets = p->tx_bytes = 0;
        if (p->truncated && drops_count(io->drops, io->reason_truncated, p->port, p->truncated) < 0) rc = -1;
        if (p->no_pipeline && drops_count(io->drops, io->reason_no_pipeline, p->port, p->no_pipeline) < 0)
            rc = -1;
        if (p->tx_errors) {
            if (drops_count(io->drops, io->reason_tx_error, p->port, p->tx_errors) < 0) rc = -1;
            PyObject *err = Py_BuildValue("(iis)", p->port, p->tx_errno, "send");
            if (err == NULL || PyList_Append(io->errors, err) < 0) rc = -1;
            Py_XDECREF(err);
        }
        p->truncated = p->no_pipeline = p->tx_errors = 0;
    }
    return rc;
}

/* Receive up to MAX_ROUNDS batches from one port and run them. 0: ok; -1: exception set. */
static int io_receive(PortIO *io, IoPort *p, FlowCache *fc, PyObject *pipeline) {
    for (int round = 0; round < MAX_ROUNDS; round++) {
        for (int k = 0; k < io->batch; k++) {
            struct msghdr *m = &p->rxmsgs[k].msg_hdr;
            memset(m, 0, sizeof(*m));
            p->rxiov[k].iov_base = p->rxbuf + (size_t)k * io->rx_buffer_bytes;
            p->rxiov[k].iov_len = io->rx_buffer_bytes;
            m->msg_iov = &p->rxiov[k];
            m->msg_iovlen = 1;
            m->msg_name = &p->rxaddr[k];
            m->msg_namelen = sizeof(struct sockaddr_ll);
            p->rxmsgs[k].msg_len = 0;
        }
        int r = recvmmsg(p->fd, p->rxmsgs, (unsigned)io->batch, MSG_DONTWAIT | MSG_TRUNC, NULL);
        io->rx_calls++;
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (errno == ENETDOWN || errno == ENXIO) {
                PyObject *err = Py_BuildValue("(iis)", p->port, errno, "receive");
                int rc = err ? PyList_Append(io->errors, err) : -1;
                Py_XDECREF(err);
                return rc;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (r == 0) return 0;
        io->rx_frames += (unsigned long long)r;
        Run run;
        IoSink sink = {{io_compiled, io_python}, io};
        io->ingress_port = p->port;
        int rc = 0;
        if (fc != NULL) rc = run_begin(&run, fc, pipeline, p->port, &sink.base);
        for (int k = 0; k < r && rc == 0; k++) {
            size_t n = p->rxmsgs[k].msg_len;
            if (p->sees_outgoing && p->rxaddr[k].sll_pkttype == PACKET_OUTGOING) continue;
            if (n > io->rx_buffer_bytes) { /* MSG_TRUNC: the frame's real length */
                p->truncated++;
                continue;
            }
            p->rx_packets++;
            p->rx_bytes += n;
            if (fc == NULL) {
                p->no_pipeline++;
                continue;
            }
            rc = process_frame(&run, p->rxbuf + (size_t)k * io->rx_buffer_bytes, n, p->port);
        }
        if (fc != NULL) {
            PyObject *exc = NULL, *val = NULL, *tb = NULL;
            if (rc < 0) PyErr_Fetch(&exc, &val, &tb);
            int end = run_end(&run); /* counters first: a receiver that sees a frame sees it counted */
            if (rc < 0) PyErr_Restore(exc, val, tb);
            else rc = end;
        }
        io_flush_all(io); /* before the receive buffers are reused */
        if (io_publish(io) < 0) rc = -1;
        if (rc < 0) return -1;
        if (r < io->batch) return 0;
    }
    return 0;
}

static void IoPort_free(IoPort *p) {
    for (int k = 0; p->tx && k < TX_SLOTS; k++) Py_CLEAR(p->tx[k].obj);
    PyMem_Free(p->rxbuf);
    PyMem_Free(p->rxmsgs);
    PyMem_Free(p->rxiov);
    PyMem_Free(p->rxaddr);
    PyMem_Free(p->tx);
    PyMem_Free(p->txmsgs);
    Py_CLEAR(p->stats);
}

static void PortIO_dealloc(PortIO *self) {
    if (self->epfd >= 0) close(self->epfd);
    for (int i = 0; self->ports && i < self->nports; i++) IoPort_free(&self->ports[i]);
    PyMem_Free(self->ports);
    Py_XDECREF(self->drops);
    Py_XDECREF(self->owner);
    Py_XDECREF(self->specials);
    Py_XDECREF(self->errors);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *PortIO_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ports", "wake_fd", "owner", "drops", "reasons", "batch", "rx_buffer_bytes", NULL};
    PyObject *ports, *owner, *drops;
    int wake_fd, batch;
    long truncated, no_pipeline, tx_error;
    Py_ssize_t rx_buffer_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiOO(lll)in:PortIO", kwlist, &ports, &wake_fd, &owner, &drops, &truncated,
                                     &no_pipeline, &tx_error, &batch, &rx_buffer_bytes))
        return NULL;
    if (batch < 1 || batch > 1024 || rx_buffer_bytes < HDR_BYTES || rx_buffer_bytes > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "batch must lie in 1..1024, rx_buffer_bytes in 46..1 MiB");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(ports, "ports must be a sequence of (port, fd, sees_outgoing, plain, stats)");
    if (seq == NULL) return NULL;
    Py_ssize_t nports = PySequence_Fast_GET_SIZE(seq);
    PortIO *self = (PortIO *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    self->epfd = -1;
    self->wake_fd = wake_fd;
    self->batch = batch;
    self->rx_buffer_bytes = (size_t)rx_buffer_bytes;
    Py_INCREF(drops);
    self->drops = drops;
    Py_INCREF(owner);
    self->owner = owner;
    self->reason_truncated = truncated;
    self->reason_no_pipeline = no_pipeline;
    self->reason_tx_error = tx_error;
    for (int i = 0; i <= MAX_PORT_NUMBER; i++) self->by_number[i] = -1;
    self->ports = PyMem_Calloc((size_t)nports + 1, sizeof(IoPort));
    if (self->ports == NULL) goto nomem;
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (self->epfd < 0) goto oserror;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, wake_fd, &ev) < 0) goto oserror;
    for (Py_ssize_t i = 0; i < nports; i++) {
        IoPort *p = &self->ports[i];
        int port, fd, sees_outgoing, plain;
        PyObject *stats;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iippO", &port, &fd, &sees_outgoing, &plain, &stats))
            goto error;
        if (port < 0 || port > MAX_PORT_NUMBER || self->by_number[port] >= 0) {
            PyErr_Format(PyExc_ValueError, "port %d: out of range or given twice", port);
            goto error;
        }
        self->nports++;
        p->fd = fd;
        p->port = port;
        p->plain = plain;
        p->sees_outgoing = sees_outgoing;
        Py_INCREF(stats);
        p->stats = stats;
        self->by_number[port] = (int16_t)i;
        p->rxbuf = PyMem_Malloc((size_t)batch * (size_t)rx_buffer_bytes);
        p->rxmsgs = PyMem_Calloc((size_t)batch, sizeof(struct mmsghdr));
        p->rxiov = PyMem_Calloc((size_t)batch, sizeof(struct iovec));
        p->rxaddr = PyMem_Calloc((size_t)batch, sizeof(struct sockaddr_ll));
        p->tx = PyMem_Calloc(TX_SLOTS, sizeof(TxSlot));
        p->txmsgs = PyMem_Calloc(TX_SLOTS, sizeof(struct mmsghdr));
        if (!p->rxbuf || !p->rxmsgs || !p->rxiov || !p->rxaddr || !p->tx || !p->txmsgs) goto nomem;
        ev.events = EPOLLIN;
        ev.data.u32 = (uint32_t)i;
        if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) goto oserror;
        p->registered = 1;
    }
    Py_DECREF(seq);
    return (PyObject *)self;
nomem:
    PyErr_NoMemory();
    goto error;
oserror:
    PyErr_SetFromErrno(PyExc_OSError);
error:
    Py_DECREF(seq);
    Py_DECREF(self);
    return NULL;
}

/* The owner's pipeline now, and its FlowCache (NULL: no pipeline). 0: ok; -1: exception set. */
static int current_pipeline(PortIO *io, PyObject **pipeline, FlowCache **fc) {
    *fc = NULL;
    *pipeline = PyObject_GetAttr(io->owner, s_pipeline);
    if (*pipeline == NULL) return -1;
    if (*pipeline == Py_None) return 0;
    PyObject *flows = PyObject_GetAttr(*pipeline, s_flows);
    if (flows == NULL || !PyObject_TypeCheck(flows, &FlowCacheType)) {
        Py_XDECREF(flows);
        Py_CLEAR(*pipeline);
        PyErr_SetString(PyExc_TypeError, "the pipeline must be a NativePipeline (with a FlowCache)");
        return -1;
    }
    *fc = (FlowCache *)flows; /* the pipeline holds it: the reference is released with it */
    Py_DECREF(flows);
    return 0;
}

static PyObject *PortIO_poll(PortIO *self, PyObject *args) {
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "i:poll", &timeout_ms)) return NULL;
    struct epoll_event events[MAX_EVENTS];
    int n;
    self->polls++;
    Py_BEGIN_ALLOW_THREADS
    n = epoll_wait(self->epfd, events, MAX_EVENTS, timeout_ms);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        if (errno == EINTR) return Py_BuildValue("(O[][])", Py_False);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int wake = 0, rc = 0;
    self->specials = PyList_New(0);
    self->errors = PyList_New(0);
    if (self->specials == NULL || self->errors == NULL) rc = -1;
    for (int i = 0; i < n && rc == 0; i++) {
        uint32_t idx = events[i].data.u32;
        if (idx == UINT32_MAX) {
            wake = 1;
            continue;
        }
        if (idx >= (uint32_t)self->nports) continue;
        IoPort *p = &self->ports[idx];
        if (events[i].events & (EPOLLERR | EPOLLHUP)) {
            if (p->registered) epoll_ctl(self->epfd, EPOLL_CTL_DEL, p->fd, NULL);
            p->registered = 0;
            PyObject *err = Py_BuildValue("(iis)", p->port, 0, "interface");
            if (err == NULL || PyList_Append(self->errors, err) < 0) rc = -1;
            Py_XDECREF(err);
            continue;
        }
        PyObject *pipeline;
        FlowCache *fc;
        rc = current_pipeline(self, &pipeline, &fc);
        if (rc == 0) rc = io_receive(self, p, fc, pipeline);
        Py_XDECREF(pipeline);
    }
    PyObject *result = NULL;
    if (rc == 0) result = Py_BuildValue("(OOO)", wake ? Py_True : Py_False, self->specials, self->errors);
    Py_CLEAR(self->specials);
    Py_CLEAR(self->errors);
    return result;
}

static PyObject *PortIO_close(PortIO *self, PyObject *Py_UNUSED(ignored)) {
    if (self->epfd >= 0) close(self->epfd);
    self->epfd = -1;
    Py_RETURN_NONE;
}

static PyObject *PortIO_stats(PortIO *self, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{sKsKsKsKsK}", "polls", self->polls, "receive_calls", self->rx_calls, "received",
                         self->rx_frames, "send_calls", self->tx_calls, "sent", self->tx_frames);
}

static PyMethodDef PortIO_methods[] = {
    {"stats", (PyCFunction)PortIO_stats, METH_NOARGS,
     "{'polls', 'receive_calls', 'received', 'send_calls', 'sent'}: system calls and frames so far"},
    {"poll", (PyCFunction)PortIO_poll, METH_VARARGS,
     "poll(timeout_ms) -> (woken, [(egress port, frame, ingress port)], [(port, errno, what)]):\n"
     "wait for frames, run them through owner._pipeline (a NativePipeline, or None: count NO_PIPELINE),\n"
     "send them; return what Python must handle (what: 'send' failures, counted as TX_ERROR; 'receive'\n"
     "errors (ENETDOWN, ENXIO); 'interface': EPOLLERR/EPOLLHUP, the port is no longer polled)"},
    {"close", (PyCFunction)PortIO_close, METH_NOARGS, "release the epoll descriptor (sockets stay open)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PortIOType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "embedded_switch.native._datapath.PortIO",
    .tp_basicsize = sizeof(PortIO),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The switch's ports: batched receive, the flow cache, batched send.",
    .tp_new = PortIO_new,
    .tp_dealloc = (destructor)PortIO_dealloc,
    .tp_methods = PortIO_methods,
};

/* ---- the benchmark's generator --------------------------------------------------------------- */
static PyObject *send_frames(PyObject *Py_UNUSED(module), PyObject *args) {
    int fd;
    PyObject *frames;
    Py_ssize_t start, count;
    if (!PyArg_ParseTuple(args, "iOnn:send_frames", &fd, &frames, &start, &count)) return NULL;
    if (!PyList_Check(frames) || PyList_GET_SIZE(frames) == 0) {
        PyErr_SetString(PyExc_TypeError, "frames must be a non-empty list of bytes");
        return NULL;
    }
    Py_ssize_t nframes = PyList_GET_SIZE(frames);
    if (start < 0 || count < 0 || count > 1024) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0 and count in 0..1024");
        return NULL;
    }
    struct mmsghdr msgs[1024];
    struct iovec iov[1024];
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *f = PyList_GET_ITEM(frames, (start + k) % nframes);
        if (!PyBytes_Check(f)) {
            PyErr_SetString(PyExc_TypeError, "frames must be bytes");
            return NULL;
        }
        iov[k].iov_base = PyBytes_AS_STRING(f);
        iov[k].iov_len = (size_t)PyBytes_GET_SIZE(f);
        memset(&msgs[k], 0, sizeof(msgs[k]));
        msgs[k].msg_hdr.msg_iov = &iov[k];
        msgs[k].msg_hdr.msg_iovlen = 1;
    }
    Py_ssize_t sent = 0, errors = 0, i = 0;
    /* the list holds the bytes objects alive while the GIL is released (callers do not mutate it) */
    Py_INCREF(frames);
    Py_BEGIN_ALLOW_THREADS
    while (i < count) {
        int r = sendmmsg(fd, &msgs[i], (unsigned)(count - i), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            errors++;
            i++;
            continue;
        }
        sent += r;
        i += r;
    }
    Py_END_ALLOW_THREADS
    Py_DECREF(frames);
    return Py_BuildValue("(nn)", sent, errors);
}

static PyMethodDef module_methods[] = {
    {"send_frames", send_frames, METH_VARARGS,
     "send_frames(fd, frames, start, count) -> (sent, errors): frames[start..start+count) (cyclic) by sendmmsg"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef datapath_module = {
    PyModuleDef_HEAD_INIT, "_datapath", "The embedded switch's native data path.", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__datapath(void) {
    /* the fields pipeline._KEY reads, as byte ranges relative to KEY_START (12) */
    static const int keep[][2] = {{12, 15}, {20, 24}, {26, 34}, {36, 40}, {42, 50}, {58, 60}, {66, 70}};
    memset(key_mask, 0, sizeof(key_mask));
    for (size_t r = 0; r < sizeof(keep) / sizeof(keep[0]); r++)
        for (int b = keep[r][0]; b < keep[r][1]; b++) key_mask[b - KEY_START] = 0xFF;
    INTERN(s_packets, "packets");
    INTERN(s_bytes, "bytes");
    INTERN(s_native_miss, "native_miss");
    INTERN(s_cache_view, "cache_view");
    INTERN(s_drops, "drops");
    INTERN(s_flows, "_flows");
    INTERN(s_pipeline, "_pipeline");
    INTERN(s_rx_packets, "rx_packets");
    INTERN(s_rx_bytes, "rx_bytes");
    INTERN(s_tx_packets, "tx_packets");
    INTERN(s_tx_bytes, "tx_bytes");
    if (PyType_Ready(&FlowCacheType) < 0 || PyType_Ready(&PortIOType) < 0) return NULL;
    PyObject *m = PyModule_Create(&datapath_module);
    if (m == NULL) return NULL;
    Py_INCREF(&FlowCacheType);
    Py_INCREF(&PortIOType);
    if (PyModule_AddObject(m, "FlowCache", (PyObject *)&FlowCacheType) < 0 ||
        PyModule_AddObject(m, "PortIO", (PyObject *)&PortIOType) < 0 ||
        PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "CACHED_MIN_BYTES", CACHED_MIN_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "FLOW_LIMIT", FLOW_LIMIT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
