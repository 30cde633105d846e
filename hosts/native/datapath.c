/* The native data path of hosts.transport.Transport: its receive loop, flows and the ring's
 * per-datagram work in C (module hosts.native._datapath, object Engine).
 *
 * One Engine serves one UDP socket. Its thread (cm-native) polls the socket and an eventfd,
 * reads bursts with recvmmsg (UDP GRO runs split by the reported segment size), parses and
 * checks every DATA, ACK and NACK datagram exactly as hosts/transport_receive.py does (same
 * drop counters), keeps both halves of every flow (hosts/transport_flow.py: cumulative
 * sequence + out-of-order bitmap, ACK every ack_every and at the end of a burst, NACK of a
 * persistent gap; send windows, SACK/NACK/RTO retransmissions with RETRANSMIT, RTT estimate,
 * dead peers), and for ring jobs does hosts/ring_allreduce.py's _apply: reduce (fp32; bf16 and
 * fp16 through float, rounded to nearest even like torch's add_), store, forward with
 * REPLICATE on the owner's first all-gather send. DATA is handed to a second thread
 * (cm-native-tx, Tx below) that writes it in UDP GSO runs while the engine goes on; the finals of
 * a rank's own chunk are received straight into the result where predictable (direct_read).
 * The engine's thread serves the timers: it sleeps in ppoll until the next deadline (none: until
 * woken), so an idle engine never wakes.
 *
 * Everything else (repair requests, unknown types, runts, DATA of jobs without a native ring)
 * goes up to Python as an event; so do op completions, peer failures and tap records. Events
 * are queued under the engine mutex and dispatched with the GIL after it is released: the
 * engine never holds its mutex while it waits for the GIL, and Python threads release the
 * GIL before they take the mutex, so the two cannot deadlock.
 *
 * Every length read from the wire is checked before it is used: a datagram is at most the
 * bytes recvmmsg returned, a header is read only when 32 bytes are there, ranges only when the
 * payload holds exactly element_count of them, elements only when element_count * itemsize
 * equals the payload and the slot grid has that (offset, count).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "sha256.h"

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

#define HDR 32
#define MAX_PAYLOAD 8940 /* checkmate.wire.MAX_PAYLOAD_BYTES: a 9000-byte jumbo frame less IPv4, UDP and our header */
#define TAG_BYTES 16
#define MAX_RANGES 128
#define T_DATA 1
#define T_ACK 2
#define T_NACK 3
#define F_REPLICATE 1
#define F_RETRANSMIT 2
#define F_LAST 4
#define KNOWN_FLAGS 7
#define RS_DONE 1
#define FINAL 2
#define RX_VLEN 8
#define RX_BUF 65536
#define BURST_READS 256
#define OUT_FLUSH 64
#define GSO_MAX_SEGMENTS 64
#define MAX_UDP_PAYLOAD 65507
#define DR_SEGMENTS 7 /* most datagrams of one GRO read placed directly: a GSO run's (MAX_UDP_PAYLOAD) */

/* ---- counters (names as in Transport.stats()) ------------------------------------------- */
enum {
    C_DATA_SENT, C_DATA_RECEIVED, C_ACKS_SENT, C_NACKS_SENT, C_ACKS_RECEIVED, C_NACKS_RECEIVED,
    C_RTX_TIMEOUT, C_RTX_SACK, C_RTX_NACK, C_GSO_WRITES, C_GSO_REFUSED, C_SEND_BLOCKED, C_SEND_ERROR,
    C_RECV_ERROR, C_PEER_FAILURES, C_SEND_NO_KEY, C_UNRELIABLE_SENT,
    C_DROP_MALFORMED, C_DROP_UNKNOWN_JOB, C_DROP_UNKNOWN_RANK, C_DROP_DUPLICATE, C_DROP_SEQUENCE_WINDOW,
    C_DROP_UNAUTHENTICATED, C_DROP_MALFORMED_ACK, C_DROP_UNEXPECTED_ACK, C_DROP_ACK_BEYOND_SENT,
    C_DROP_NOT_RING_PREDECESSOR, C_DROP_STALE_ITERATION, C_DROP_FUTURE_ITERATION, C_DROP_STASH_FULL,
    C_DROP_OUT_OF_RANGE, C_DROP_DTYPE_MISMATCH, C_DROP_UNEXPECTED_SLOT, C_HOST_COPIES,
    C_FAULT_SEND_DROP, C_FAULT_RECV_DROP, C_FAULT_DUPLICATE, C_FAULT_REORDER,
    C_NATIVE_BURSTS, C_NATIVE_WAKEUPS, C_PYTHON_EVENTS, C_NATIVE_DIRECT, C_NATIVE_DIRECT_MISS,
    C_COUNT
};
static const char *counter_names[C_COUNT] = {
    "data_sent", "data_received", "acks_sent", "nacks_sent", "acks_received", "nacks_received",
    "retransmit.timeout", "retransmit.sack", "retransmit.nack", "gso_writes", "gso_refused", "send_blocked",
    "send_error", "recv_error", "peer_failures", "send_no_key", "unreliable_sent",
    "drop.malformed", "drop.unknown_job", "drop.unknown_rank", "drop.duplicate", "drop.sequence_window",
    "drop.unauthenticated", "drop.malformed_ack", "drop.unexpected_ack", "drop.ack_beyond_sent",
    "drop.not_ring_predecessor", "drop.stale_iteration", "drop.future_iteration", "drop.stash_full",
    "drop.out_of_range", "drop.dtype_mismatch", "drop.unexpected_slot", "host_copies",
    "fault.send_drop", "fault.recv_drop", "fault.duplicate", "fault.reorder",
    "native.bursts", "native.wakeups", "native.python_events", "native.direct_datagrams",
    "native.direct_misses"};
/* ring counters kept per job as well (RingAllReduce.stats()) */
#define RING_FIRST C_DROP_NOT_RING_PREDECESSOR
#define RING_LAST C_HOST_COPIES

/* ---- events up to Python ------------------------------------------------------------------ */
enum { EV_RAW = 0, EV_DATA = 1, EV_DONE = 2, EV_FAIL = 3, EV_TAP = 4 };

typedef struct Event {
    struct Event *next;
    int kind;
    struct sockaddr_in addr;
    uint32_t job, iteration, bucket;
    int rank, flag;
    size_t len;
    uint8_t data[]; /* datagram bytes, or the failure's text */
} Event;

/* ---- records ------------------------------------------------------------------------------ */
struct Op;

typedef struct Item {
    uint64_t seq;
    uint8_t hdr[HDR];
    const uint8_t *payload;
    uint32_t len;
    uint8_t *owned; /* a copy of a Python caller's payload, or NULL (op memory) */
    struct Op *op;
    double first_sent, last_sent;
    uint32_t retransmits;
    struct Item *prev, *next; /* unacked, by last transmission */
    struct Item *qnext;       /* pending queue */
    uint64_t retire_at;       /* freed: reusable once the writer's ``done`` reaches this */
} Item;

typedef struct SendFlow {
    struct sockaddr_in peer;
    uint32_t job;
    int peer_rank;
    double rto;
    uint32_t peer_window;
    uint64_t next_seq, cum_acked;
    Item **slots;
    uint64_t cap; /* power of 2; every unacked seq is in [cum_acked, cum_acked + cap) */
    uint32_t n_unacked;
    Item *head, *tail;
    Item *pend_head, *pend_tail;
    uint32_t n_pending;
    double srtt, rttvar, backoff, last_progress;
    int has_srtt;
    char *failed; /* the failure's text, once failed */
} SendFlow;

typedef struct RecvFlow {
    struct sockaddr_in peer;
    uint32_t job;
    uint64_t cum;
    uint8_t *bits; /* out-of-order set: bit (seq & mask) for cum < seq <= cum + max_reorder */
    uint64_t mask;
    uint32_t n_ooo;
    uint64_t high; /* highest out-of-order seq + 1 */
    uint32_t since_ack;
    int ack_due, dirty;
    double gap_since, last_nack;
} RecvFlow;

typedef struct Op {
    struct Op *next;
    uint32_t job, iteration, bucket;
    int dtype, itemsize;
    uint8_t *work;
    const uint8_t *source; /* what this rank's own chunk is read from (the input, or work) */
    Py_buffer work_buf, source_buf;
    int has_source;
    uint64_t n;
    uint32_t nslots;
    uint64_t *offsets;
    uint32_t *counts;
    uint32_t *chunk;
    uint8_t *last;
    uint8_t *state;
    uint64_t *bounds;      /* world + 1 */
    uint32_t *first_slot;  /* world + 1 */
    uint32_t remaining;
    uint32_t shard_key;
    int done, failed, released;
    long refs; /* items that send from this op's memory */
    uint64_t queued_at; /* released: freed once the writer has written this many entries */
} Op;

typedef struct Stash {
    struct Stash *next;
    uint32_t iteration, bucket;
    size_t len;
    uint8_t data[]; /* the whole datagram */
} Stash;

typedef struct Job {
    uint32_t id;
    int rank;
    int npeers;
    int *peer_rank;
    struct sockaddr_in *peer_addr;
    uint8_t key[32];
    /* native ring */
    int ring, world, prev_rank;
    struct sockaddr_in next_addr;
    int64_t latest_iteration, released_through;
    uint32_t future_iterations;
    uint64_t max_stash_bytes, stash_bytes;
    Op *ops;
    Stash *stash;
    uint64_t ring_counters[C_COUNT];
    uint64_t stashed;
    /* host replication (no switch): REPLICATE never goes on the wire; the owner of each chunk
     * sends its reduced slots once more, outside any flow, to the shadow of the shard key */
    int host_mode, nreplicas;
    struct sockaddr_in *replica; /* by shard key; sin_port 0: no shadow for that key */
} Job;

typedef struct OutEntry {
    uint8_t hdr[HDR];
    const uint8_t *payload;
    uint32_t len;
    struct sockaddr_in addr;
} OutEntry;

/* The writer thread (cm-native-tx): the engine hands it the queued DATA and goes on reading,
 * checking and reducing while the kernel copies and delivers what was queued (on loopback a
 * send also runs the receiver's UDP path). Everything it reads stays alive until it has written
 * it: items (and through them op memory) freed by the engine are kept on ``retired`` until
 * ``done`` passes what was queued when they were freed. Its lock is never held while waiting for
 * the engine's mutex or the GIL. */
typedef struct {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    int running, stop, gso;
    OutEntry *next, *active; /* next: handed over, not yet taken (under mu); active: the thread's */
    int nnext, capnext, capactive;
    uint64_t queued, done;     /* entries handed over / written, since start (under mu) */
    uint64_t counters[C_COUNT]; /* the send counters it kept, added to the engine's in stats() */
} Tx;

typedef struct {
    PyObject_HEAD
    int fd, efd;
    pthread_mutex_t mu;
    pthread_t thread;
    int running, stop;
    PyObject *dispatch;
    /* config */
    uint32_t window, advertised_window, ack_every, dupthresh;
    uint64_t max_reorder;
    double initial_rto, min_rto, max_rto, peer_timeout, nack_delay, nack_interval, timer_tick;
    double send_block_timeout;
    int gso, gro, tap;
    double f_send_drop, f_recv_drop, f_duplicate, f_reorder;
    int faults;
    uint64_t rng;
    /* state */
    Job **jobs;
    int njobs;
    SendFlow **sflows;
    int nsflows;
    RecvFlow **rflows;
    int nrflows;
    uint64_t counters[C_COUNT];
    Event *ev_head, *ev_tail;
    Op *zombies;
    OutEntry *out;
    int nout, capout;
    uint8_t *held; /* a datagram held back by the reorder fault */
    size_t held_len;
    struct sockaddr_in held_addr;
    double held_at;
    double deadline;
    /* receive buffers */
    uint8_t *rxbuf;
    Item *spare_items; /* freed items kept for reuse (no malloc/free per datagram) */
    uint32_t n_spare_items;
    struct Stash *spare_stash; /* freed stash entries (all of the largest size), kept for reuse */
    uint32_t n_spare_stash;
    /* direct receive (rx_main): the predecessor's next DATA is expected to be the final of this
     * ring op's own-chunk slot (set by ring_apply on each such final, cleared on a miss) */
    int dr_on;
    uint32_t dr_job, dr_iteration, dr_bucket, dr_slot;
    uint8_t dr_hdr[DR_SEGMENTS][HDR];
    /* the writer thread (tx_on once started) and the items freed while it may still read them */
    Tx tx;
    int tx_on;
    Item *retired, *retired_tail;
} Engine;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)((uint16_t)p[0] << 8 | p[1]); }
static inline void wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}
static inline void wr16(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline int same_addr(const struct sockaddr_in *a, const struct sockaddr_in *b) {
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

static void pack_header(uint8_t *h, int type, int flags, int dtype, uint32_t job, uint32_t iteration,
                        uint32_t bucket, uint32_t rank, uint32_t shard, uint32_t offset, uint32_t count,
                        uint32_t seq) {
    h[0] = 1;
    h[1] = (uint8_t)type;
    h[2] = (uint8_t)flags;
    h[3] = (uint8_t)dtype;
    wr32(h + 4, job);
    wr32(h + 8, iteration);
    wr16(h + 12, bucket);
    wr16(h + 14, rank);
    wr16(h + 16, shard);
    wr16(h + 18, 0);
    wr32(h + 20, offset);
    wr32(h + 24, count);
    wr32(h + 28, seq);
}

static int itemsize_of(int dtype) { return dtype == 1 ? 4 : (dtype == 2 || dtype == 3) ? 2 : 0; }

/* ---- random faults (xorshift64*, seeded) -------------------------------------------------- */
static double rng_next(Engine *e) {
    uint64_t x = e->rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    e->rng = x;
    return (double)((x * 2685821657736338717ULL) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- events ------------------------------------------------------------------------------- */
static Event *event_new(Engine *e, int kind, size_t len) {
    Event *ev = calloc(1, sizeof(Event) + len);
    if (ev == NULL) return NULL;
    ev->kind = kind;
    ev->len = len;
    if (e->ev_tail) e->ev_tail->next = ev;
    else e->ev_head = ev;
    e->ev_tail = ev;
    e->counters[C_PYTHON_EVENTS]++;
    return ev;
}

/* ---- lookups ------------------------------------------------------------------------------ */
static Job *find_job(Engine *e, uint32_t id) {
    for (int i = 0; i < e->njobs; i++)
        if (e->jobs[i]->id == id) return e->jobs[i];
    return NULL;
}

static int job_peer_rank(Job *j, const struct sockaddr_in *a) {
    for (int i = 0; i < j->npeers; i++)
        if (same_addr(&j->peer_addr[i], a)) return j->peer_rank[i];
    return -1;
}

static const struct sockaddr_in *job_peer_addr(Job *j, int rank) {
    for (int i = 0; i < j->npeers; i++)
        if (j->peer_rank[i] == rank) return &j->peer_addr[i];
    return NULL;
}

static SendFlow *find_sflow(Engine *e, const struct sockaddr_in *a, uint32_t job) {
    for (int i = 0; i < e->nsflows; i++)
        if (e->sflows[i]->job == job && same_addr(&e->sflows[i]->peer, a)) return e->sflows[i];
    return NULL;
}

static RecvFlow *find_rflow(Engine *e, const struct sockaddr_in *a, uint32_t job) {
    for (int i = 0; i < e->nrflows; i++)
        if (e->rflows[i]->job == job && same_addr(&e->rflows[i]->peer, a)) return e->rflows[i];
    return NULL;
}

static void set_deadline(Engine *e, double t) {
    if (t < e->deadline) {
        e->deadline = t;
        if (!pthread_equal(pthread_self(), e->thread) || !e->running) {
            uint64_t one = 1;
            ssize_t r = write(e->efd, &one, sizeof one);
            (void)r;
        }
    }
}

/* ---- socket writes ------------------------------------------------------------------------ */
/* One sendmsg, waiting up to send_block_timeout for buffer space; 1 if the kernel took it,
 * 0 if not, -1 if a GSO write was refused (the caller resends datagram by datagram). Counts into
 * ``counters`` and clears ``*gso`` on a refusal: the engine's, or the writer thread's own. */
static int write_msg(Engine *e, uint64_t *counters, int *gso, const int *stop, struct iovec *iov, int niov,
                     const struct sockaddr_in *addr, int segment) {
    struct msghdr msg;
    char control[CMSG_SPACE(sizeof(uint16_t))];
    memset(&msg, 0, sizeof msg);
    msg.msg_name = (void *)addr;
    msg.msg_namelen = sizeof *addr;
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)niov;
    if (segment > 0) {
        memset(control, 0, sizeof control);
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_UDP;
        cm->cmsg_type = UDP_SEGMENT;
        cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t seg = (uint16_t)segment;
        memcpy(CMSG_DATA(cm), &seg, sizeof seg);
    }
    double deadline = -1;
    for (;;) {
        if (sendmsg(e->fd, &msg, 0) >= 0) return 1;
        int err = errno;
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS) {
            double now = mono();
            if (deadline < 0) deadline = now + e->send_block_timeout;
            else if (now >= deadline) {
                counters[C_SEND_BLOCKED]++;
                return 0;
            }
            struct pollfd p = {.fd = e->fd, .events = POLLOUT};
            int ms = (int)ceil((deadline - now) * 1000.0);
            poll(&p, 1, ms > 0 ? ms : 1);
            continue;
        }
        if (__atomic_load_n(stop, __ATOMIC_RELAXED)) return 0;
        if (segment > 0 && (err == EIO || err == EINVAL || err == EOPNOTSUPP || err == ENOPROTOOPT ||
                            err == EMSGSIZE)) {
            *gso = 0;
            counters[C_GSO_REFUSED]++;
            return -1;
        }
        counters[C_SEND_ERROR]++;
        return 0;
    }
}

static void write_plain(Engine *e, const uint8_t *a, size_t na, const uint8_t *b, size_t nb,
                        const struct sockaddr_in *addr) {
    struct iovec iov[2] = {{(void *)a, na}, {(void *)b, nb}};
    write_msg(e, e->counters, &e->gso, &e->stop, iov, nb ? 2 : 1, addr, 0);
}

/* Write queued DATA: runs of one size to one address as one GSO write. */
static void write_entries(Engine *e, uint64_t *counters, int *gso, const int *stop, OutEntry *out, int nout) {
    int i = 0;
    while (i < nout) {
        OutEntry *first = &out[i];
        uint32_t segment = HDR + first->len;
        int count = 1;
        int closed = 0;
        while (*gso && i + count < nout && count < GSO_MAX_SEGMENTS && !closed) {
            OutEntry *o = &out[i + count];
            uint32_t size = HDR + o->len;
            if (!same_addr(&o->addr, &first->addr) || size > segment ||
                (uint64_t)(count + 1) * segment > MAX_UDP_PAYLOAD)
                break;
            if (size < segment) closed = 1;
            count++;
        }
        struct iovec iov[2 * GSO_MAX_SEGMENTS];
        for (int k = 0; k < count; k++) {
            iov[2 * k].iov_base = out[i + k].hdr;
            iov[2 * k].iov_len = HDR;
            iov[2 * k + 1].iov_base = (void *)out[i + k].payload;
            iov[2 * k + 1].iov_len = out[i + k].len;
        }
        if (count == 1) {
            write_msg(e, counters, gso, stop, iov, first->len ? 2 : 1, &first->addr, 0);
        } else {
            int r = write_msg(e, counters, gso, stop, iov, 2 * count, &first->addr, (int)segment);
            if (r == 1) counters[C_GSO_WRITES]++;
            else if (r < 0)
                for (int k = 0; k < count; k++)
                    write_msg(e, counters, gso, stop, iov + 2 * k, out[i + k].len ? 2 : 1, &first->addr, 0);
        }
        i += count;
    }
}

static void item_release(Engine *e, Item *it);

/* Items freed while the writer may still read them, given back in the order they were freed
 * once it has written everything queued before (``all``: the writer is idle, all of them). */
static void free_retired(Engine *e, uint64_t done, int all) {
    while (e->retired && (all || e->retired->retire_at <= done)) {
        Item *it = e->retired;
        e->retired = it->qnext;
        if (e->retired == NULL) e->retired_tail = NULL;
        item_release(e, it);
    }
}

/* Hand the queued DATA to the writer thread (or write it here when there is none). With the
 * engine's mutex held; never waits for the writer. */
static void flush_out(Engine *e) {
    if (!e->tx_on) {
        write_entries(e, e->counters, &e->gso, &e->stop, e->out, e->nout);
        e->nout = 0;
        return;
    }
    Tx *t = &e->tx;
    uint64_t done;
    pthread_mutex_lock(&t->mu);
    if (e->nout) {
        if (t->nnext + e->nout > t->capnext) {
            int cap = t->capnext ? t->capnext : 256;
            while (cap < t->nnext + e->nout) cap *= 2;
            OutEntry *grown = realloc(t->next, (size_t)cap * sizeof *grown);
            if (grown == NULL) { /* no memory: written here, after what the writer holds */
                while (t->queued != t->done) pthread_cond_wait(&t->idle, &t->mu);
                pthread_mutex_unlock(&t->mu);
                write_entries(e, e->counters, &e->gso, &e->stop, e->out, e->nout);
                e->nout = 0;
                return;
            }
            t->next = grown;
            t->capnext = cap;
        }
        memcpy(t->next + t->nnext, e->out, (size_t)e->nout * sizeof *e->out);
        t->nnext += e->nout;
        t->queued += (uint64_t)e->nout;
        e->nout = 0;
        pthread_cond_signal(&t->work);
    }
    done = t->done;
    pthread_mutex_unlock(&t->mu);
    free_retired(e, done, 0);
}

/* Hand over what is queued and wait until the writer has written all of it (memory that is not
 * an item's is about to go: a caller's buffer, a released op). With the engine's mutex held. */
static void tx_drain(Engine *e) {
    flush_out(e);
    if (!e->tx_on) return;
    Tx *t = &e->tx;
    pthread_mutex_lock(&t->mu);
    while (t->queued != t->done) pthread_cond_wait(&t->idle, &t->mu);
    pthread_mutex_unlock(&t->mu);
    free_retired(e, 0, 1);
}

static void *tx_main(void *arg) {
    Engine *e = arg;
    Tx *t = &e->tx;
    pthread_setname_np(pthread_self(), "cm-native-tx");
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (t->nnext == 0 && !t->stop) pthread_cond_wait(&t->work, &t->mu);
        if (t->nnext == 0 && t->stop) break;
        OutEntry *batch = t->next;
        int n = t->nnext, cap = t->capnext;
        t->next = t->active;
        t->capnext = t->capactive;
        t->nnext = 0;
        t->active = batch;
        t->capactive = cap;
        pthread_mutex_unlock(&t->mu);
        uint64_t counters[C_COUNT] = {0};
        write_entries(e, counters, &t->gso, &t->stop, batch, n);
        pthread_mutex_lock(&t->mu);
        for (int i = 0; i < C_COUNT; i++) t->counters[i] += counters[i];
        t->done += (uint64_t)n;
        if (t->done == t->queued) pthread_cond_broadcast(&t->idle);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Stop the writer thread once it has written everything (GIL held, engine mutex not); from then
 * on the engine writes itself. */
static void lock_from_python(Engine *e);

static void tx_stop(Engine *e) {
    if (!e->tx.running) return;
    lock_from_python(e);
    tx_drain(e);
    e->tx_on = 0;
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_lock(&e->tx.mu);
    e->tx.stop = 1;
    pthread_cond_signal(&e->tx.work);
    pthread_mutex_unlock(&e->tx.mu);
    Py_BEGIN_ALLOW_THREADS pthread_join(e->tx.thread, NULL);
    Py_END_ALLOW_THREADS e->tx.running = 0;
}

static void queue_data(Engine *e, const uint8_t *hdr, const uint8_t *payload, uint32_t len,
                       const struct sockaddr_in *addr) {
    if (e->nout == e->capout) {
        int cap = e->capout ? 2 * e->capout : 256;
        OutEntry *o = realloc(e->out, (size_t)cap * sizeof *o);
        if (o == NULL) {
            flush_out(e);
        } else {
            e->out = o;
            e->capout = cap;
        }
    }
    if (e->nout == e->capout) return; /* out of memory even after a flush: lost like a drop */
    OutEntry *o = &e->out[e->nout++];
    memcpy(o->hdr, hdr, HDR);
    o->payload = payload;
    o->len = len;
    o->addr = *addr;
}

/* What _sendmsg does: DATA is queued (written at the end of the burst), control at once. */
static void sendmsg_one(Engine *e, const uint8_t *hdr, const uint8_t *payload, size_t len,
                        const struct sockaddr_in *addr) {
    if (hdr[1] == T_DATA) queue_data(e, hdr, payload, (uint32_t)len, addr);
    else write_plain(e, hdr, HDR, payload, len, addr);
}

static void release_held(Engine *e) {
    if (e->held == NULL) return;
    uint8_t *h = e->held;
    size_t n = e->held_len;
    e->held = NULL;
    if (h[1] == T_DATA) tx_drain(e); /* what was queued before it leaves before it */
    write_plain(e, h, n, NULL, 0, &e->held_addr);
    free(h);
}

/* What _emit does after sealing: injected faults, then the write. */
static void emit(Engine *e, const uint8_t *hdr, const uint8_t *payload, size_t len,
                 const struct sockaddr_in *addr) {
    if (!e->faults) {
        sendmsg_one(e, hdr, payload, len, addr);
        return;
    }
    double r = rng_next(e);
    if (r < e->f_send_drop) {
        e->counters[C_FAULT_SEND_DROP]++;
        return;
    }
    r -= e->f_send_drop;
    int duplicate = 0;
    if (r < e->f_duplicate) {
        e->counters[C_FAULT_DUPLICATE]++;
        duplicate = 1;
    } else {
        r -= e->f_duplicate;
        if (r < e->f_reorder) {
            e->counters[C_FAULT_REORDER]++;
            uint8_t *copy = malloc(HDR + len);
            if (copy == NULL) return;
            memcpy(copy, hdr, HDR);
            if (len) memcpy(copy + HDR, payload, len);
            release_held(e);
            e->held = copy;
            e->held_len = HDR + len;
            e->held_addr = *addr;
            e->held_at = mono();
            set_deadline(e, e->held_at + e->timer_tick);
            return;
        }
    }
    sendmsg_one(e, hdr, payload, len, addr);
    if (duplicate) sendmsg_one(e, hdr, payload, len, addr);
    release_held(e);
}

/* A control datagram (ACK, NACK) sealed with the job's MAC. */
static void emit_control(Engine *e, Job *j, const uint8_t *hdr, const uint8_t *payload, size_t len,
                         const struct sockaddr_in *addr) {
    uint8_t body[HDR + MAX_RANGES * 8 + TAG_BYTES];
    uint8_t mac[32];
    if (len > MAX_RANGES * 8) return;
    memcpy(body, hdr, HDR);
    if (len) memcpy(body + HDR, payload, len);
    cm_hmac_sha256(j->key, body, HDR + len, NULL, 0, mac);
    memcpy(body + HDR + len, mac, TAG_BYTES);
    emit(e, body, body + HDR, len + TAG_BYTES, addr);
}

/* ---- send flows --------------------------------------------------------------------------- */
static void op_unref(Engine *e, Op *op);

#define SPARE_ITEMS 16384

static void item_release(Engine *e, Item *it) {
    if (it->op) op_unref(e, it->op);
    free(it->owned);
    if (e->n_spare_items < SPARE_ITEMS) {
        it->qnext = e->spare_items;
        e->spare_items = it;
        e->n_spare_items++;
    } else {
        free(it);
    }
}

/* An item acknowledged or dropped: its payload (its own copy, or op memory it holds a reference
 * to) may still be queued for the writer thread, so it is kept until the writer has written
 * what was queued by now (what the engine still holds included). */
static void item_free(Engine *e, Item *it) {
    if (!e->tx_on) {
        item_release(e, it);
        return;
    }
    it->retire_at = e->tx.queued + (uint64_t)e->nout; /* queued changes only under the engine's mutex */
    it->qnext = NULL;
    if (e->retired_tail) e->retired_tail->qnext = it;
    else e->retired = it;
    e->retired_tail = it;
}

static Item *item_new(Engine *e) {
    Item *it = e->spare_items;
    if (it == NULL) return calloc(1, sizeof *it);
    e->spare_items = it->qnext;
    e->n_spare_items--;
    memset(it, 0, sizeof *it);
    return it;
}

static void tap_event(Engine *e, Item *it, const struct sockaddr_in *peer, int retransmit) {
    Event *ev = event_new(e, EV_TAP, HDR + it->len);
    if (ev == NULL) return;
    memcpy(ev->data, it->hdr, HDR);
    if (it->len) memcpy(ev->data + HDR, it->payload, it->len);
    ev->addr = *peer;
    ev->flag = retransmit;
}

static void time_unlink(SendFlow *f, Item *it) {
    if (it->prev) it->prev->next = it->next;
    else f->head = it->next;
    if (it->next) it->next->prev = it->prev;
    else f->tail = it->prev;
    it->prev = it->next = NULL;
}

static void time_append(SendFlow *f, Item *it) {
    it->prev = f->tail;
    it->next = NULL;
    if (f->tail) f->tail->next = it;
    else f->head = it;
    f->tail = it;
}

static Item *unacked_get(SendFlow *f, uint64_t seq) {
    if (seq < f->cum_acked || seq >= f->next_seq || f->cap == 0) return NULL;
    Item *it = f->slots[seq & (f->cap - 1)];
    return it != NULL && it->seq == seq ? it : NULL;
}

static Item *unacked_pop(SendFlow *f, uint64_t seq) {
    Item *it = unacked_get(f, seq);
    if (it == NULL) return NULL;
    f->slots[seq & (f->cap - 1)] = NULL;
    time_unlink(f, it);
    f->n_unacked--;
    return it;
}

static int unacked_put(SendFlow *f, Item *it) {
    while (f->cap == 0 || it->seq - f->cum_acked >= f->cap) {
        uint64_t cap = f->cap ? 2 * f->cap : 1024;
        Item **slots = calloc(cap, sizeof *slots);
        if (slots == NULL) return -1;
        for (Item *p = f->head; p; p = p->next) slots[p->seq & (cap - 1)] = p;
        free(f->slots);
        f->slots = slots;
        f->cap = cap;
    }
    f->slots[it->seq & (f->cap - 1)] = it;
    time_append(f, it);
    f->n_unacked++;
    return 0;
}

static void transmit(Engine *e, SendFlow *f, Item *it, double now) {
    if (f->n_unacked == 0) {
        f->last_progress = now;
        set_deadline(e, now + f->rto * f->backoff);
    }
    it->first_sent = it->last_sent = now;
    if (unacked_put(f, it) < 0) {
        item_free(e, it);
        return;
    }
    emit(e, it->hdr, it->payload, it->len, &f->peer);
    e->counters[C_DATA_SENT]++;
    if (e->tap) tap_event(e, it, &f->peer, 0);
}

static void retransmit(Engine *e, SendFlow *f, Item *it, double now, int counter) {
    if (it->retransmits == 0) it->hdr[2] |= F_RETRANSMIT;
    it->retransmits++;
    it->last_sent = now;
    time_unlink(f, it);
    time_append(f, it);
    emit(e, it->hdr, it->payload, it->len, &f->peer);
    e->counters[counter]++;
    if (e->tap) tap_event(e, it, &f->peer, 1);
}

static void fill_window(Engine *e, SendFlow *f, double now) {
    uint32_t limit = e->window < f->peer_window ? e->window : f->peer_window;
    while (f->pend_head && f->n_unacked < limit) {
        Item *it = f->pend_head;
        f->pend_head = it->qnext;
        if (f->pend_head == NULL) f->pend_tail = NULL;
        f->n_pending--;
        it->qnext = NULL;
        transmit(e, f, it, now);
    }
}

static SendFlow *get_sflow(Engine *e, Job *j, const struct sockaddr_in *peer) {
    SendFlow *f = find_sflow(e, peer, j->id);
    if (f) return f;
    f = calloc(1, sizeof *f);
    if (f == NULL) return NULL;
    SendFlow **arr = realloc(e->sflows, (size_t)(e->nsflows + 1) * sizeof *arr);
    if (arr == NULL) {
        free(f);
        return NULL;
    }
    e->sflows = arr;
    e->sflows[e->nsflows++] = f;
    f->peer = *peer;
    f->job = j->id;
    f->peer_rank = job_peer_rank(j, peer);
    f->rto = e->initial_rto;
    f->peer_window = e->window;
    f->backoff = 1.0;
    return f;
}

/* Number and send (or queue) one DATA datagram; 0, or -1 (the flow failed), -2 (no memory),
 * -3 (sequence space exhausted). Takes ``owned`` in every case. */
static int send_item(Engine *e, Job *j, const struct sockaddr_in *peer, const uint8_t *hdr,
                     const uint8_t *payload, uint32_t len, uint8_t *owned, Op *op) {
    SendFlow *f = get_sflow(e, j, peer);
    if (f == NULL) {
        free(owned);
        return -2;
    }
    if (f->failed) {
        free(owned);
        return -1;
    }
    if (f->next_seq > 0xFFFFFFFFULL) {
        free(owned);
        return -3;
    }
    Item *it = item_new(e);
    if (it == NULL) {
        free(owned);
        return -2;
    }
    it->seq = f->next_seq++;
    memcpy(it->hdr, hdr, HDR);
    wr32(it->hdr + 28, (uint32_t)it->seq);
    it->payload = payload;
    it->len = len;
    it->owned = owned;
    if (op) {
        it->op = op;
        op->refs++;
    }
    uint32_t limit = e->window < f->peer_window ? e->window : f->peer_window;
    if (f->n_unacked < limit && f->pend_head == NULL) {
        transmit(e, f, it, mono());
    } else {
        if (f->pend_tail) f->pend_tail->qnext = it;
        else f->pend_head = it;
        f->pend_tail = it;
        f->n_pending++;
    }
    return 0;
}

static void update_rtt(Engine *e, SendFlow *f, double sample) {
    if (!f->has_srtt) {
        f->srtt = sample;
        f->rttvar = sample / 2;
        f->has_srtt = 1;
    } else {
        f->rttvar = 0.75 * f->rttvar + 0.25 * fabs(f->srtt - sample);
        f->srtt = 0.875 * f->srtt + 0.125 * sample;
    }
    double rto = f->srtt + 4 * f->rttvar;
    if (rto < e->min_rto) rto = e->min_rto;
    if (rto > e->max_rto) rto = e->max_rto;
    f->rto = rto;
}

static void clear_sflow(Engine *e, SendFlow *f) {
    flush_out(e); /* nothing queued may point into what is freed */
    Item *it = f->head;
    while (it) {
        Item *next = it->next;
        item_free(e, it);
        it = next;
    }
    f->head = f->tail = NULL;
    if (f->slots) memset(f->slots, 0, f->cap * sizeof *f->slots);
    f->n_unacked = 0;
    it = f->pend_head;
    while (it) {
        Item *next = it->qnext;
        item_free(e, it);
        it = next;
    }
    f->pend_head = f->pend_tail = NULL;
    f->n_pending = 0;
}

/* ---- receive flows ------------------------------------------------------------------------ */
static RecvFlow *get_rflow(Engine *e, const struct sockaddr_in *peer, uint32_t job) {
    RecvFlow *f = find_rflow(e, peer, job);
    if (f) return f;
    f = calloc(1, sizeof *f);
    if (f == NULL) return NULL;
    RecvFlow **arr = realloc(e->rflows, (size_t)(e->nrflows + 1) * sizeof *arr);
    if (arr == NULL) {
        free(f);
        return NULL;
    }
    e->rflows = arr;
    e->rflows[e->nrflows++] = f;
    f->peer = *peer;
    f->job = job;
    return f;
}

static inline int ooo_has(RecvFlow *f, uint64_t s) {
    return f->bits && (f->bits[(s & f->mask) >> 3] >> (s & 7)) & 1;
}
static inline void ooo_set(RecvFlow *f, uint64_t s) { f->bits[(s & f->mask) >> 3] |= (uint8_t)(1u << (s & 7)); }
static inline void ooo_clear(RecvFlow *f, uint64_t s) {
    f->bits[(s & f->mask) >> 3] &= (uint8_t)~(1u << (s & 7));
}

static void send_ranges(Engine *e, Job *j, RecvFlow *f, int type, uint32_t (*ranges)[2], int n) {
    uint8_t hdr[HDR], payload[MAX_RANGES * 8];
    pack_header(hdr, type, 0, 0, f->job, 0, 0, (uint32_t)j->rank, 0, e->advertised_window, (uint32_t)n,
                (uint32_t)f->cum);
    for (int i = 0; i < n; i++) {
        wr32(payload + 8 * i, ranges[i][0]);
        wr32(payload + 8 * i + 4, ranges[i][1]);
    }
    emit_control(e, j, hdr, payload, (size_t)n * 8, &f->peer);
}

static void send_ack(Engine *e, RecvFlow *f) {
    Job *j = find_job(e, f->job);
    if (j == NULL) return;
    uint32_t ranges[MAX_RANGES][2];
    int n = 0;
    if (f->n_ooo) {
        uint32_t seen = 0;
        for (uint64_t s = f->cum + 1; s < f->high && seen < f->n_ooo; s++) {
            if (!ooo_has(f, s)) continue;
            seen++;
            if (n && ranges[n - 1][1] == (uint32_t)s) {
                ranges[n - 1][1] = (uint32_t)(s + 1);
            } else {
                if (n == MAX_RANGES) break;
                ranges[n][0] = (uint32_t)s;
                ranges[n][1] = (uint32_t)(s + 1);
                n++;
            }
        }
    }
    f->since_ack = 0;
    f->ack_due = 0;
    send_ranges(e, j, f, T_ACK, ranges, n);
    e->counters[C_ACKS_SENT]++;
}

static void send_nack(Engine *e, RecvFlow *f, double now) {
    Job *j = find_job(e, f->job);
    if (j == NULL || !f->n_ooo) return;
    uint32_t ranges[MAX_RANGES][2];
    int n = 0;
    uint64_t start = f->cum;
    uint32_t seen = 0;
    for (uint64_t s = f->cum + 1; s < f->high && seen < f->n_ooo; s++) {
        if (!ooo_has(f, s)) continue;
        seen++;
        if (s > start) {
            ranges[n][0] = (uint32_t)start;
            ranges[n][1] = (uint32_t)s;
            n++;
            if (n == MAX_RANGES) break;
        }
        start = s + 1;
    }
    if (!n) return;
    f->last_nack = now;
    send_ranges(e, j, f, T_NACK, ranges, n);
    e->counters[C_NACKS_SENT]++;
}

static double nack_due(Engine *e, RecvFlow *f) {
    double a = f->gap_since + e->nack_delay, b = f->last_nack + e->nack_interval;
    return a > b ? a : b;
}

/* _accept_data: 1 if new, 0 for a duplicate or out-of-window datagram. */
static int accept_data(Engine *e, uint32_t job, uint64_t seq, const struct sockaddr_in *addr) {
    RecvFlow *f = get_rflow(e, addr, job);
    if (f == NULL) return 0;
    f->dirty = 1;
    if (seq < f->cum || ooo_has(f, seq)) {
        f->ack_due = 1;
        e->counters[C_DROP_DUPLICATE]++;
        return 0;
    }
    if (seq - f->cum > e->max_reorder) {
        e->counters[C_DROP_SEQUENCE_WINDOW]++;
        return 0;
    }
    if (seq == f->cum) {
        f->cum++;
        while (f->n_ooo && ooo_has(f, f->cum)) {
            ooo_clear(f, f->cum);
            f->n_ooo--;
            f->cum++;
        }
    } else {
        if (f->bits == NULL) {
            uint64_t nbits = 8;
            while (nbits < e->max_reorder + 1) nbits <<= 1;
            f->bits = calloc(nbits / 8, 1);
            if (f->bits == NULL) return 0;
            f->mask = nbits - 1;
        }
        if (!f->n_ooo) {
            f->gap_since = mono();
            set_deadline(e, nack_due(e, f));
        }
        ooo_set(f, seq);
        f->n_ooo++;
        if (seq + 1 > f->high) f->high = seq + 1;
        f->ack_due = 1;
    }
    f->since_ack++;
    e->counters[C_DATA_RECEIVED]++;
    if (f->since_ack >= e->ack_every) send_ack(e, f);
    return 1;
}

static void flush_acks(Engine *e) {
    for (int i = 0; i < e->nrflows; i++) {
        RecvFlow *f = e->rflows[i];
        if (f->dirty) {
            f->dirty = 0;
            if (f->since_ack || f->ack_due) send_ack(e, f);
        }
    }
}

/* ---- ACK / NACK --------------------------------------------------------------------------- */
static void on_ack(Engine *e, const uint8_t *d, size_t n, const struct sockaddr_in *addr, int nack) {
    /* d: the opened datagram (no tag), header checked; n >= HDR */
    uint32_t count = rd32(d + 24);
    size_t plen = n - HDR;
    if ((uint64_t)count * 8 != plen) {
        e->counters[C_DROP_MALFORMED_ACK]++;
        return;
    }
    const uint8_t *p = d + HDR;
    for (uint32_t i = 0; i < count; i++)
        if (rd32(p + 8 * i) >= rd32(p + 8 * i + 4)) {
            e->counters[C_DROP_MALFORMED_ACK]++;
            return;
        }
    double now = mono();
    SendFlow *f = find_sflow(e, addr, rd32(d + 4));
    if (f == NULL || f->failed) {
        e->counters[C_DROP_UNEXPECTED_ACK]++;
        return;
    }
    uint64_t cum = rd32(d + 28);
    if (cum > f->next_seq) {
        e->counters[C_DROP_ACK_BEYOND_SENT]++;
        return;
    }
    for (uint32_t i = 0; i < count; i++)
        if (rd32(p + 8 * i + 4) > f->next_seq) {
            e->counters[C_DROP_ACK_BEYOND_SENT]++;
            return;
        }
    if (!e->tx_on) flush_out(e); /* items may be freed below (with the writer: kept until written) */
    e->counters[nack ? C_NACKS_RECEIVED : C_ACKS_RECEIVED]++;
    uint32_t window = rd32(d + 20);
    if (window) f->peer_window = window;
    double sample = -1;
    if (cum > f->cum_acked) {
        for (uint64_t s = f->cum_acked; s < cum; s++) {
            Item *it = unacked_pop(f, s);
            if (it) {
                if (it->retransmits == 0) sample = now - it->first_sent;
                item_free(e, it);
            }
        }
        f->cum_acked = cum;
        f->last_progress = now;
        f->backoff = 1.0;
    }
    double guard = f->has_srtt ? f->srtt : 0.0;
    if (guard < 0.001) guard = 0.001;
    if (nack) {
        for (uint32_t i = 0; i < count; i++) {
            uint64_t s = rd32(p + 8 * i), end = rd32(p + 8 * i + 4);
            for (uint64_t seq = s > cum ? s : cum; seq < end; seq++) {
                Item *it = unacked_get(f, seq);
                if (it && now - it->last_sent >= guard) retransmit(e, f, it, now, C_RTX_NACK);
            }
        }
    } else if (count) {
        uint64_t highest = cum;
        for (uint32_t i = 0; i < count; i++) {
            uint64_t s = rd32(p + 8 * i), end = rd32(p + 8 * i + 4);
            for (uint64_t seq = s > cum ? s : cum; seq < end; seq++) {
                Item *it = unacked_pop(f, seq);
                if (it) {
                    f->last_progress = now;
                    if (it->retransmits == 0) sample = now - it->first_sent;
                    item_free(e, it);
                }
            }
            if (end > highest) highest = end;
        }
        for (uint64_t seq = cum; seq + e->dupthresh < highest; seq++) {
            Item *it = unacked_get(f, seq);
            if (it && now - it->last_sent >= guard) retransmit(e, f, it, now, C_RTX_SACK);
        }
    }
    if (sample >= 0) update_rtt(e, f, sample);
    fill_window(e, f, now);
}

/* ---- ring ------------------------------------------------------------------------------- */
static void op_free(Op *op) {
    if (op->work_buf.obj) PyBuffer_Release(&op->work_buf);
    if (op->has_source && op->source_buf.obj) PyBuffer_Release(&op->source_buf);
    free(op->offsets);
    free(op->counts);
    free(op->chunk);
    free(op->last);
    free(op->state);
    free(op->bounds);
    free(op->first_slot);
    free(op);
}

static void op_unref(Engine *e, Op *op) {
    (void)e;
    op->refs--; /* a released op with no references left is freed by reap_zombies (with the GIL) */
}

/* The slot holding ``offset``, or -1. */
static long slot_of(Op *op, int world, uint64_t offset, uint32_t per) {
    for (int c = 0; c < world; c++) {
        if (offset >= op->bounds[c] && offset < op->bounds[c + 1]) {
            uint64_t rel = offset - op->bounds[c];
            if (rel % per) return -1;
            return (long)(op->first_slot[c] + rel / per);
        }
    }
    return -1;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0xFFFF; /* what torch's vectorized CPU add_ writes for a NaN sum (its scalar
                                  tail writes 0x7FC0): NaN payload bits are the one difference */
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

typedef float ufloat __attribute__((aligned(1), may_alias));

__attribute__((optimize("O3"))) static void add_f32(float *out, const ufloat *mine, const ufloat *wire, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) out[i] = mine[i] + wire[i];
}

static void add_bf16(uint8_t *out, const uint8_t *wire, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        uint16_t a, b;
        memcpy(&a, out + 2 * i, 2);
        memcpy(&b, wire + 2 * i, 2);
        uint16_t r = float_to_bf16(bf16_to_float(a) + bf16_to_float(b));
        memcpy(out + 2 * i, &r, 2);
    }
}

static void add_f16(uint8_t *out, const uint8_t *wire, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        _Float16 a, b;
        memcpy(&a, out + 2 * i, 2);
        memcpy(&b, wire + 2 * i, 2);
        _Float16 r = (_Float16)((float)a + (float)b);
        memcpy(out + 2 * i, &r, 2);
    }
}

static void ring_count(Engine *e, Job *j, int counter) {
    e->counters[counter]++;
    j->ring_counters[counter]++;
}

static void ring_send(Engine *e, Job *j, Op *op, uint32_t slot, int flags, int from_source) {
    uint64_t offset = op->offsets[slot];
    uint32_t count = op->counts[slot];
    if (op->last[slot]) flags |= F_LAST;
    uint8_t hdr[HDR];
    pack_header(hdr, T_DATA, flags, op->dtype, j->id, op->iteration, op->bucket, (uint32_t)j->rank,
                op->shard_key, (uint32_t)offset, count, 0);
    const uint8_t *base = from_source ? op->source : op->work;
    const uint8_t *payload = base + offset * (uint64_t)op->itemsize;
    uint32_t len = count * (uint32_t)op->itemsize;
    int host_copy = j->host_mode && (flags & F_REPLICATE);
    if (host_copy) hdr[2] &= (uint8_t)~F_REPLICATE; /* host mode: never tagged on the wire */
    uint8_t copy[HDR];
    if (host_copy) memcpy(copy, hdr, HDR); /* before the flow numbers it, as the Python ring does */
    send_item(e, j, &j->next_addr, hdr, payload, len, NULL, op);
    /* a failed flow was reported to Python as it failed; its sends are dropped here */
    if (host_copy && op->shard_key < (uint32_t)j->nreplicas && j->replica[op->shard_key].sin_port != 0) {
        emit(e, copy, payload, len, &j->replica[op->shard_key]);
        e->counters[C_UNRELIABLE_SENT]++;
        j->ring_counters[C_HOST_COPIES]++;
    }
}

static void finalize(Engine *e, Op *op, uint32_t slot) {
    op->state[slot] = FINAL;
    op->remaining--;
    if (op->remaining == 0 && !op->done) {
        op->done = 1;
        Event *ev = event_new(e, EV_DONE, 0);
        if (ev) {
            ev->job = op->job;
            ev->iteration = op->iteration;
            ev->bucket = op->bucket;
        }
    }
}

static void ring_add_into(Op *op, uint64_t lo, uint32_t count, const uint8_t *payload) {
    uint8_t *dst = op->work + lo * (uint64_t)op->itemsize;
    if (op->dtype == 1) {
        const uint8_t *mine = op->has_source ? op->source + lo * 4 : dst;
        add_f32((float *)dst, (const ufloat *)mine, (const ufloat *)payload, count);
    } else if (op->dtype == 2) {
        add_bf16(dst, payload, count);
    } else {
        add_f16(dst, payload, count);
    }
}

/* Direct receive: after the final of own-chunk slot ``slot``, the predecessor's next datagram is
 * most likely the final of ``slot + 1`` (it forwards in slot order), so rx_main reads the next
 * message with that slot's place in ``work`` as the payload's iovec. Only where nothing reads
 * those bytes before that slot's final is stored: the own chunk was sent from a separate source
 * (fp32 SUM), and a slot still in state 0 has no other reader (sends, repairs and the caller's
 * result read only FINAL slots). */
static void expect_next(Engine *e, Job *j, Op *op, uint32_t slot) {
    e->dr_on = op->has_source && slot + 1 < op->first_slot[j->rank + 1];
    e->dr_job = j->id;
    e->dr_iteration = op->iteration;
    e->dr_bucket = op->bucket;
    e->dr_slot = slot + 1;
}

/* RingAllReduce._apply for one checked DATA datagram: header ``d``, its payload at ``payload``
 * (d + HDR, or where a direct receive put it: already in its place in ``work``). */
static void ring_apply(Engine *e, Job *j, Op *op, const uint8_t *d, const uint8_t *payload, size_t n) {
    uint64_t lo = rd32(d + 20);
    uint32_t count = rd32(d + 24);
    uint32_t per = MAX_PAYLOAD / (uint32_t)op->itemsize;
    long slot = slot_of(op, j->world, lo, per);
    if (slot < 0 || op->counts[slot] != count) {
        ring_count(e, j, C_DROP_OUT_OF_RANGE);
        return;
    }
    if (d[3] != op->dtype) {
        ring_count(e, j, C_DROP_DTYPE_MISMATCH);
        return;
    }
    if (n - HDR != (size_t)count * (size_t)op->itemsize) { /* checked by the parser; kept local */
        ring_count(e, j, C_DROP_OUT_OF_RANGE);
        return;
    }
    int chunk = (int)op->chunk[slot], r = j->rank, world = j->world;
    int state = op->state[slot];
    if (chunk == (r + 1) % world) {
        if (state != 0) {
            ring_count(e, j, C_DROP_UNEXPECTED_SLOT);
            return;
        }
        ring_add_into(op, lo, count, payload);
        finalize(e, op, (uint32_t)slot);
        ring_send(e, j, op, (uint32_t)slot, F_REPLICATE, 0);
    } else if (chunk == r || state == RS_DONE) {
        if ((chunk == r && state != 0) || state == FINAL) {
            ring_count(e, j, C_DROP_UNEXPECTED_SLOT);
            return;
        }
        uint8_t *dst = op->work + lo * (uint64_t)op->itemsize;
        if (dst != payload) memcpy(dst, payload, (size_t)count * (size_t)op->itemsize);
        finalize(e, op, (uint32_t)slot);
        if (chunk == r) expect_next(e, j, op, (uint32_t)slot);
        if (chunk != (r + 2) % world) ring_send(e, j, op, (uint32_t)slot, 0, 0);
    } else if (state == 0) {
        ring_add_into(op, lo, count, payload);
        op->state[slot] = RS_DONE;
        ring_send(e, j, op, (uint32_t)slot, 0, 0);
    } else {
        ring_count(e, j, C_DROP_UNEXPECTED_SLOT);
    }
}

static Op *find_op(Job *j, uint32_t iteration, uint32_t bucket) {
    for (Op *op = j->ops; op; op = op->next)
        if (op->iteration == iteration && op->bucket == bucket) return op;
    return NULL;
}

#define SPARE_STASH 2048 /* up to 18 MB of early datagrams' buffers kept between iterations */

/* A stash entry big enough for any datagram: entries are allocated in the engine's thread and
 * freed where a bucket starts, so freeing them to malloc would trim and refault its arena every
 * iteration (measured: ~440 page faults per 1.8 MB trimmed). */
static Stash *stash_new(Engine *e) {
    Stash *s = e->spare_stash;
    if (s == NULL) return malloc(sizeof(Stash) + HDR + MAX_PAYLOAD);
    e->spare_stash = s->next;
    e->n_spare_stash--;
    return s;
}

static void stash_free(Engine *e, Stash *s) {
    if (e->n_spare_stash < SPARE_STASH) {
        s->next = e->spare_stash;
        e->spare_stash = s;
        e->n_spare_stash++;
    } else {
        free(s);
    }
}

/* RingAllReduce._on_fields after the transport accepted the datagram. */
static void ring_data(Engine *e, Job *j, const uint8_t *d, const uint8_t *payload, size_t n) {
    if (rd16(d + 14) != (uint32_t)j->prev_rank) {
        ring_count(e, j, C_DROP_NOT_RING_PREDECESSOR);
        return;
    }
    uint32_t iteration = rd32(d + 8), bucket = rd16(d + 12);
    Op *op = find_op(j, iteration, bucket);
    if (op == NULL) {
        size_t plen = n - HDR;
        if ((int64_t)iteration <= j->released_through) {
            ring_count(e, j, C_DROP_STALE_ITERATION);
        } else if (j->latest_iteration >= 0 &&
                   (int64_t)iteration > j->latest_iteration + (int64_t)j->future_iterations) {
            ring_count(e, j, C_DROP_FUTURE_ITERATION);
        } else if (j->stash_bytes + plen > j->max_stash_bytes) {
            ring_count(e, j, C_DROP_STASH_FULL);
        } else {
            Stash *s = n <= HDR + MAX_PAYLOAD ? stash_new(e) : NULL;
            if (s == NULL) {
                ring_count(e, j, C_DROP_STASH_FULL);
                return;
            }
            s->iteration = iteration;
            s->bucket = bucket;
            s->len = n;
            memcpy(s->data, d, HDR);
            memcpy(s->data + HDR, payload, n - HDR);
            s->next = j->stash;
            j->stash = s;
            j->stash_bytes += plen;
            j->stashed++;
        }
        return;
    }
    if (op->done || op->failed) {
        ring_count(e, j, C_DROP_STALE_ITERATION);
        return;
    }
    ring_apply(e, j, op, d, payload, n);
}

/* ---- the datagram parser ------------------------------------------------------------------ */
static void raw_event(Engine *e, const uint8_t *d, const uint8_t *payload, size_t n,
                      const struct sockaddr_in *addr, int kind) {
    Event *ev = event_new(e, kind, n);
    if (ev == NULL) return;
    if (n <= HDR || payload == d + HDR) {
        memcpy(ev->data, d, n);
    } else {
        memcpy(ev->data, d, HDR);
        memcpy(ev->data + HDR, payload, n - HDR);
    }
    ev->addr = *addr;
}

/* Receiver._handle for one datagram of ``n`` bytes: its header at ``d``, the rest at ``payload``
 * (d + HDR, except for a DATA datagram received straight into a ring op's result). */
static void handle(Engine *e, const uint8_t *d, const uint8_t *payload, size_t n, const struct sockaddr_in *addr) {
    if (e->faults && e->f_recv_drop > 0 && rng_next(e) < e->f_recv_drop) {
        e->counters[C_FAULT_RECV_DROP]++;
        return;
    }
    if (n >= 2 && d[1] == T_DATA) {
        /* decode_data: the same checks, the same single reason */
        int size = n >= HDR ? itemsize_of(d[3]) : 0;
        if (n < HDR || n > HDR + MAX_PAYLOAD || d[0] != 1 || !size || (d[2] & ~KNOWN_FLAGS) ||
            rd16(d + 18) != 0 || (uint64_t)(n - HDR) != (uint64_t)rd32(d + 24) * (uint64_t)size) {
            e->counters[C_DROP_MALFORMED]++;
            return;
        }
        Job *j = find_job(e, rd32(d + 4));
        if (j == NULL) {
            e->counters[C_DROP_UNKNOWN_JOB]++;
            return;
        }
        const struct sockaddr_in *pa = job_peer_addr(j, rd16(d + 14));
        if (pa == NULL || !same_addr(pa, addr)) {
            e->counters[C_DROP_UNKNOWN_RANK]++;
            return;
        }
        if (!accept_data(e, j->id, rd32(d + 28), addr)) return;
        if (j->ring) ring_data(e, j, d, payload, n);
        else raw_event(e, d, payload, n, addr, EV_DATA);
        return;
    }
    if (n >= HDR && (d[1] == T_ACK || d[1] == T_NACK)) {
        Job *j = find_job(e, rd32(d + 4));
        if (j == NULL) {
            e->counters[C_DROP_UNKNOWN_JOB]++;
            return;
        }
        if (n < HDR + TAG_BYTES) {
            e->counters[C_DROP_UNAUTHENTICATED]++;
            return;
        }
        size_t body = n - TAG_BYTES;
        uint8_t mac[32];
        cm_hmac_sha256(j->key, d, body, NULL, 0, mac);
        uint8_t diff = 0;
        for (int i = 0; i < TAG_BYTES; i++) diff |= (uint8_t)(mac[i] ^ d[body + i]);
        if (diff) {
            e->counters[C_DROP_UNAUTHENTICATED]++;
            return;
        }
        /* decode(): version, type, dtype, flags, reserved; ACK/NACK carry no elements and no
         * REPLICATE */
        if (body > HDR + MAX_PAYLOAD || d[0] != 1 || d[3] > 3 || (d[2] & ~KNOWN_FLAGS) || rd16(d + 18) != 0 ||
            (d[2] & F_REPLICATE)) {
            e->counters[C_DROP_MALFORMED]++;
            return;
        }
        const struct sockaddr_in *pa = job_peer_addr(j, rd16(d + 14));
        if (pa == NULL || !same_addr(pa, addr)) {
            e->counters[C_DROP_UNKNOWN_RANK]++;
            return;
        }
        on_ack(e, d, body, addr, d[1] == T_NACK);
        return;
    }
    raw_event(e, d, payload, n, addr, EV_RAW); /* the Python path's own checks and counters */
}

/* ---- timers ------------------------------------------------------------------------------- */
static double on_tick(Engine *e, double now) {
    double nxt = INFINITY;
    if (e->held) {
        if (now - e->held_at >= e->timer_tick) release_held(e);
        else nxt = e->held_at + e->timer_tick;
    }
    for (int i = 0; i < e->nsflows; i++) {
        SendFlow *f = e->sflows[i];
        if (f->failed || !f->n_unacked) continue;
        if (now - f->last_progress > e->peer_timeout) {
            char text[256];
            snprintf(text, sizeof text,
                     "nothing acknowledged for %.1fs (timeout %.1fs), %u datagrams outstanding",
                     now - f->last_progress, e->peer_timeout, f->n_unacked + f->n_pending);
            f->failed = strdup(text);
            clear_sflow(e, f);
            e->counters[C_PEER_FAILURES]++;
            size_t len = strlen(text);
            Event *ev = event_new(e, EV_FAIL, len);
            if (ev) {
                memcpy(ev->data, text, len);
                ev->addr = f->peer;
                ev->job = f->job;
                ev->rank = f->peer_rank;
            }
            continue;
        }
        double timeout = f->rto * f->backoff;
        double pt = f->last_progress + e->peer_timeout;
        if (pt < nxt) nxt = pt;
        if (now - f->last_progress < timeout) {
            double t = f->last_progress + timeout;
            if (t < nxt) nxt = t;
            continue;
        }
        Item *expired[64];
        int k = 0;
        for (Item *it = f->head; it && k < 64; it = it->next) {
            if (now - it->last_sent < timeout) break;
            expired[k++] = it;
        }
        if (k) {
            double b = f->backoff * 2, cap = e->max_rto / f->rto;
            f->backoff = b < cap ? b : cap;
            for (int m = 0; m < k; m++) retransmit(e, f, expired[m], now, C_RTX_TIMEOUT);
        }
        if (f->head) {
            double base = f->head->last_sent > f->last_progress ? f->head->last_sent : f->last_progress;
            double t = base + f->rto * f->backoff;
            if (t < nxt) nxt = t;
        }
    }
    for (int i = 0; i < e->nrflows; i++) {
        RecvFlow *f = e->rflows[i];
        if (!f->n_ooo) continue;
        if (now - f->gap_since >= e->nack_delay && now - f->last_nack >= e->nack_interval) send_nack(e, f, now);
        double t = nack_due(e, f);
        if (t < nxt) nxt = t;
    }
    flush_out(e);
    return nxt;
}

/* ---- events to Python (with the GIL, the mutex not held) ---------------------------------- */
static PyObject *addr_tuple(const struct sockaddr_in *a) {
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    return Py_BuildValue("(si)", ip, (int)ntohs(a->sin_port));
}

static void dispatch_events(Engine *e, Event *ev) {
    while (ev) {
        Event *next = ev->next;
        PyObject *args = NULL, *addr = addr_tuple(&ev->addr);
        switch (ev->kind) {
        case EV_RAW:
        case EV_DATA:
            args = Py_BuildValue("(iy#O)", ev->kind, (const char *)ev->data, (Py_ssize_t)ev->len, addr);
            break;
        case EV_TAP:
            args = Py_BuildValue("(iy#Oi)", ev->kind, (const char *)ev->data, (Py_ssize_t)ev->len, addr,
                                 ev->flag);
            break;
        case EV_DONE:
            args = Py_BuildValue("(iIII)", ev->kind, ev->job, ev->iteration, ev->bucket);
            break;
        case EV_FAIL:
            args = Py_BuildValue("(iIOis#)", ev->kind, ev->job, addr, ev->rank, (const char *)ev->data,
                                 (Py_ssize_t)ev->len);
            break;
        }
        Py_XDECREF(addr);
        if (args && e->dispatch) {
            PyObject *r = PyObject_CallObject(e->dispatch, args);
            if (r == NULL) PyErr_WriteUnraisable(e->dispatch);
            Py_XDECREF(r);
        } else if (args == NULL) {
            PyErr_WriteUnraisable(e->dispatch);
        }
        Py_XDECREF(args);
        free(ev);
        ev = next;
    }
}

static Event *take_events(Engine *e) {
    Event *ev = e->ev_head;
    e->ev_head = e->ev_tail = NULL;
    return ev;
}

/* Take the engine's mutex from a thread that holds the GIL. Lock order: a thread never waits
 * for the GIL while it holds the mutex (the engine's thread takes the GIL only with the mutex
 * released), so a Python thread must not wait for the mutex while it holds the GIL either: it
 * drops the GIL while it waits and takes the mutex only with a trylock once it has the GIL
 * back. (Waiting for the mutex without the GIL and then for the GIL with the mutex deadlocked
 * against a second Python thread calling in: one held the GIL and waited for the mutex, the
 * other the reverse, and the engine's thread stopped acknowledging.) */
static void lock_from_python(Engine *e) {
    while (pthread_mutex_trylock(&e->mu) != 0) {
        Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&e->mu);
        pthread_mutex_unlock(&e->mu);
        Py_END_ALLOW_THREADS
    }
}

/* Free released ops nothing sends from any more (GIL held, mutex not). */
static void reap_zombies(Engine *e) {
    Op *free_list = NULL;
    lock_from_python(e);
    uint64_t done = UINT64_MAX;
    if (e->tx_on && e->zombies) {
        pthread_mutex_lock(&e->tx.mu);
        done = e->tx.done;
        pthread_mutex_unlock(&e->tx.mu);
    }
    Op **pp = &e->zombies;
    while (*pp) {
        Op *op = *pp;
        if (op->refs <= 0 && op->queued_at <= done) {
            *pp = op->next;
            op->next = free_list;
            free_list = op;
        } else {
            pp = &op->next;
        }
    }
    pthread_mutex_unlock(&e->mu);
    while (free_list) {
        Op *next = free_list->next;
        op_free(free_list);
        free_list = next;
    }
}

/* ---- the thread --------------------------------------------------------------------------- */
static int gro_segment(struct msghdr *m) {
    int segment = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(m); cm; cm = CMSG_NXTHDR(m, cm))
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO && cm->cmsg_len >= CMSG_LEN(sizeof(int)))
            memcpy(&segment, CMSG_DATA(cm), sizeof segment);
    return segment;
}

/* One message read contiguously into ``buf``: a GRO run split by its segment size. */
static void handle_message(Engine *e, const uint8_t *buf, size_t n, int segment, const struct sockaddr_in *addr) {
    if (segment > 0 && (size_t)segment < n) {
        for (size_t start = 0; start < n; start += (size_t)segment) {
            size_t len = n - start < (size_t)segment ? n - start : (size_t)segment;
            handle(e, buf + start, buf + start + HDR, len, addr);
        }
    } else {
        handle(e, buf, buf + HDR, n, addr);
    }
    if (e->nout >= OUT_FLUSH) flush_out(e);
}

/* Read one message straight into the ring op's result where expect_next predicted it: the
 * headers of up to DR_SEGMENTS datagrams into dr_hdr, each payload into its slot's place in
 * ``work``, anything beyond into rxbuf. When every datagram of the message is the predicted one
 * (type, job, iteration, bucket, offset, count, dtype and size), each is handled where it lies
 * (the checks, flows and ACKs as for any datagram; the final is not copied again). Otherwise its
 * bytes are gathered into one buffer and handled as any message: the payloads written into the
 * predicted slots landed only in slots in state 0 (read by nothing before their own final is
 * stored), and stay in state 0 until their own datagram arrives. Returns 1 (a message was read),
 * 0 (no prediction: read in batches), -1 (nothing to read). With the mutex held. */
static int direct_read(Engine *e) {
    if (!e->dr_on) return 0;
    Job *j = find_job(e, e->dr_job);
    Op *op = j != NULL && j->ring ? find_op(j, e->dr_iteration, e->dr_bucket) : NULL;
    uint32_t first = e->dr_slot, count = 0;
    if (op != NULL && !op->done && !op->failed && op->has_source) {
        uint32_t end = op->first_slot[j->rank + 1];
        while (count < DR_SEGMENTS && first + count < end && op->state[first + count] == 0) count++;
    }
    if (count == 0) {
        e->dr_on = 0;
        return 0;
    }
    struct iovec iov[2 * DR_SEGMENTS + 1];
    size_t expect[DR_SEGMENTS];
    uint8_t *place[DR_SEGMENTS];
    int niov = 0;
    for (uint32_t k = 0; k < count; k++) {
        place[k] = op->work + op->offsets[first + k] * (uint64_t)op->itemsize;
        expect[k] = (size_t)op->counts[first + k] * (size_t)op->itemsize;
        iov[niov++] = (struct iovec){e->dr_hdr[k], HDR};
        iov[niov++] = (struct iovec){place[k], expect[k]};
    }
    iov[niov++] = (struct iovec){e->rxbuf, RX_BUF};
    struct sockaddr_in addr;
    char control[CMSG_SPACE(sizeof(int))];
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_name = &addr;
    msg.msg_namelen = sizeof addr;
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)niov;
    if (e->gro) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
    }
    ssize_t got = recvmsg(e->fd, &msg, MSG_DONTWAIT);
    if (got < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) e->counters[C_RECV_ERROR]++;
        return -1;
    }
    size_t n = (size_t)got;
    if (msg.msg_namelen < sizeof(struct sockaddr_in) || addr.sin_family != AF_INET) return 1;
    int segment = e->gro ? gro_segment(&msg) : 0;
    size_t seg = segment > 0 && (size_t)segment < n ? (size_t)segment : n;
    size_t m = n ? (n + seg - 1) / seg : 0;
    int match = m >= 1 && m <= count;
    for (size_t k = 0; match && k < m; k++) {
        size_t len = k + 1 < m ? seg : n - k * seg;
        const uint8_t *h = e->dr_hdr[k];
        match = len == HDR + expect[k] && h[1] == T_DATA && rd32(h + 4) == j->id &&
                rd32(h + 8) == op->iteration && rd16(h + 12) == op->bucket && h[3] == op->dtype &&
                rd32(h + 20) == op->offsets[first + k] && rd32(h + 24) == op->counts[first + k];
    }
    if (match) {
        e->counters[C_NATIVE_DIRECT] += m;
        for (size_t k = 0; k < m; k++) handle(e, e->dr_hdr[k], place[k], HDR + expect[k], &addr);
        if (e->nout >= OUT_FLUSH) flush_out(e);
        return 1;
    }
    e->counters[C_NATIVE_DIRECT_MISS]++;
    e->dr_on = 0;
    uint8_t *buf = e->rxbuf + RX_BUF; /* the gathered message; the iovecs' last piece is rxbuf */
    size_t at = 0;
    for (int i = 0; i < niov && at < n; i++) {
        size_t take = n - at < iov[i].iov_len ? n - at : iov[i].iov_len;
        memcpy(buf + at, iov[i].iov_base, take);
        at += take;
    }
    handle_message(e, buf, n, segment, &addr);
    return 1;
}

static void *rx_main(void *arg) {
    Engine *e = arg;
    pthread_setname_np(pthread_self(), "cm-native");
    struct mmsghdr msgs[RX_VLEN];
    struct iovec iovs[RX_VLEN];
    struct sockaddr_in addrs[RX_VLEN];
    char controls[RX_VLEN][CMSG_SPACE(sizeof(int))];
    for (;;) {
        pthread_mutex_lock(&e->mu);
        if (e->stop) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        double now = mono();
        if (now >= e->deadline) {
            e->deadline = INFINITY;
            double t = on_tick(e, now);
            if (t < e->deadline) e->deadline = t;
        }
        double deadline = e->deadline;
        Event *ev = take_events(e);
        pthread_mutex_unlock(&e->mu);
        if (ev) {
            PyGILState_STATE g = PyGILState_Ensure();
            dispatch_events(e, ev);
            PyGILState_Release(g);
            /* A handler may have called into the engine from this thread (a send, an emit held
             * by a fault), setting an earlier deadline without a wake-up (set_deadline writes the
             * eventfd only for other threads): read the deadline again before sleeping. */
            continue;
        }
        struct pollfd fds[2] = {{.fd = e->fd, .events = POLLIN}, {.fd = e->efd, .events = POLLIN}};
        struct timespec ts, *tsp = NULL;
        if (deadline < INFINITY) {
            double wait = deadline - mono();
            if (wait < e->timer_tick) wait = e->timer_tick;
            ts.tv_sec = (time_t)wait;
            ts.tv_nsec = (long)((wait - (double)ts.tv_sec) * 1e9);
            tsp = &ts;
        }
        int ready = ppoll(fds, 2, tsp, NULL);
        if (ready < 0 && errno != EINTR) break;
        pthread_mutex_lock(&e->mu);
        e->counters[C_NATIVE_WAKEUPS]++;
        pthread_mutex_unlock(&e->mu);
        if (ready > 0 && (fds[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(e->efd, &v, sizeof v);
            (void)r;
        }
        if (ready <= 0 || !(fds[0].revents & (POLLIN | POLLERR))) continue;
        pthread_mutex_lock(&e->mu);
        if (e->stop) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        e->counters[C_NATIVE_BURSTS]++;
        int reads = 0;
        while (reads < BURST_READS) {
            int direct = direct_read(e);
            if (direct > 0) {
                reads++;
                continue;
            }
            if (direct < 0) break;
            for (int i = 0; i < RX_VLEN; i++) {
                iovs[i].iov_base = e->rxbuf + (size_t)i * RX_BUF;
                iovs[i].iov_len = RX_BUF;
                memset(&msgs[i].msg_hdr, 0, sizeof msgs[i].msg_hdr);
                msgs[i].msg_hdr.msg_name = &addrs[i];
                msgs[i].msg_hdr.msg_namelen = sizeof addrs[i];
                msgs[i].msg_hdr.msg_iov = &iovs[i];
                msgs[i].msg_hdr.msg_iovlen = 1;
                if (e->gro) {
                    msgs[i].msg_hdr.msg_control = controls[i];
                    msgs[i].msg_hdr.msg_controllen = sizeof controls[i];
                }
            }
            int got = recvmmsg(e->fd, msgs, RX_VLEN, MSG_DONTWAIT, NULL);
            if (got <= 0) {
                if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                    e->counters[C_RECV_ERROR]++;
                break;
            }
            for (int i = 0; i < got; i++) {
                size_t n = msgs[i].msg_len;
                const uint8_t *buf = e->rxbuf + (size_t)i * RX_BUF;
                int segment = e->gro ? gro_segment(&msgs[i].msg_hdr) : 0;
                if (msgs[i].msg_hdr.msg_namelen < sizeof(struct sockaddr_in) ||
                    addrs[i].sin_family != AF_INET)
                    continue;
                handle_message(e, buf, n, segment, &addrs[i]);
            }
            reads += got;
            if (got < RX_VLEN) break;
        }
        flush_out(e);
        flush_acks(e);
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}

/* ---- the Python object -------------------------------------------------------------------- */
static int parse_addr(PyObject *obj, struct sockaddr_in *out) {
    const char *ip;
    int port;
    if (!PyArg_ParseTuple(obj, "si", &ip, &port)) return -1;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, ip, &out->sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", ip);
        return -1;
    }
    return 0;
}

static void after_call(Engine *e) {
    lock_from_python(e);
    Event *ev = take_events(e);
    pthread_mutex_unlock(&e->mu);
    dispatch_events(e, ev);
    reap_zombies(e);
}


static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "dispatch", "window", "advertised_window", "ack_every", "dupthresh",
                            "max_reorder", "initial_rto", "min_rto", "max_rto", "peer_timeout",
                            "nack_delay", "nack_interval", "timer_tick", "send_block_timeout", "gso",
                            "gro", "seed", "send_drop", "recv_drop", "duplicate", "reorder", NULL};
    unsigned long long seed = 0;
    unsigned long long max_reorder = 0;
    int fd;
    PyObject *dispatch;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOIIIIKddddddddppKdddd", names, &fd, &dispatch, &e->window,
                                     &e->advertised_window, &e->ack_every, &e->dupthresh, &max_reorder,
                                     &e->initial_rto, &e->min_rto, &e->max_rto, &e->peer_timeout,
                                     &e->nack_delay, &e->nack_interval, &e->timer_tick,
                                     &e->send_block_timeout, &e->gso, &e->gro, &seed, &e->f_send_drop,
                                     &e->f_recv_drop, &e->f_duplicate, &e->f_reorder))
        return -1;
    if (e->rxbuf) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is already initialised");
        return -1;
    }
    if (max_reorder == 0 || max_reorder > (1ULL << 30) || e->window == 0) {
        PyErr_SetString(PyExc_ValueError, "max_reorder and window must be positive (max_reorder <= 2**30)");
        return -1;
    }
    e->max_reorder = max_reorder;
    e->fd = fd;
    e->faults = e->f_send_drop > 0 || e->f_recv_drop > 0 || e->f_duplicate > 0 || e->f_reorder > 0;
    e->rng = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
    if (e->rng == 0) e->rng = 1;
    e->deadline = INFINITY;
    Py_INCREF(dispatch);
    e->dispatch = dispatch;
    e->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    e->rxbuf = malloc((size_t)RX_VLEN * RX_BUF);
    if (e->rxbuf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->tx.mu, NULL);
    pthread_cond_init(&e->tx.work, NULL);
    pthread_cond_init(&e->tx.idle, NULL);
    return 0;
}

static PyObject *Engine_start(Engine *e, PyObject *unused) {
    (void)unused;
    if (e->running || e->rxbuf == NULL) Py_RETURN_NONE;
    lock_from_python(e);
    e->tx.gso = e->gso;
    e->tx.stop = 0;
    if (pthread_create(&e->tx.thread, NULL, tx_main, e) == 0) { /* else: written by the engine itself */
        e->tx.running = 1;
        e->tx_on = 1;
    }
    pthread_mutex_unlock(&e->mu);
    e->running = 1;
    if (pthread_create(&e->thread, NULL, rx_main, e) != 0) {
        e->running = 0;
        tx_stop(e);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static void engine_stop(Engine *e) {
    if (!e->running) return;
    lock_from_python(e);
    e->stop = 1;
    pthread_mutex_unlock(&e->mu);
    uint64_t one = 1;
    ssize_t r = write(e->efd, &one, sizeof one);
    (void)r;
    Py_BEGIN_ALLOW_THREADS pthread_join(e->thread, NULL);
    Py_END_ALLOW_THREADS e->running = 0;
    tx_stop(e);
}

/* In a child after fork(): the threads are not there and the mutexes may have been held by them.
 * The copy stops being an engine (its memory is still freed on dealloc). */
static PyObject *Engine_forget(Engine *e, PyObject *unused) {
    (void)unused;
    if (e->rxbuf == NULL) Py_RETURN_NONE;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->tx.mu, NULL);
    pthread_cond_init(&e->tx.work, NULL);
    pthread_cond_init(&e->tx.idle, NULL);
    e->running = 0;
    e->stop = 1;
    e->tx.running = 0;
    e->tx_on = 0;
    e->tx.nnext = 0;
    e->tx.queued = e->tx.done = 0;
    free_retired(e, 0, 1);
    Py_RETURN_NONE;
}

static PyObject *Engine_stop(Engine *e, PyObject *unused) {
    (void)unused;
    if (e->rxbuf == NULL) Py_RETURN_NONE;
    engine_stop(e);
    after_call(e);
    Py_RETURN_NONE;
}

static void free_job(Job *j, Engine *e) {
    Op *op = j->ops;
    while (op) {
        Op *next = op->next;
        op->released = 1;
        op->queued_at = e->tx.queued + (uint64_t)e->nout;
        op->next = e->zombies;
        e->zombies = op;
        op = next;
    }
    Stash *s = j->stash;
    while (s) {
        Stash *next = s->next;
        stash_free(e, s);
        s = next;
    }
    free(j->peer_rank);
    free(j->peer_addr);
    free(j->replica);
    free(j);
}

/* Make ``j``'s DATA run in the engine's ring; 0, or -1 with a Python exception set (the GIL is
 * held; the mutex may be). */
static int ring_setup(Job *j, int world, unsigned int future, unsigned long long max_stash, int host_mode) {
    if (world < 2 || j->rank < 0 || j->rank >= world) {
        PyErr_Format(PyExc_KeyError, "job %u: rank %d is not in a ring of %d", j->id, j->rank, world);
        return -1;
    }
    const struct sockaddr_in *next = job_peer_addr(j, (j->rank + 1) % world);
    if (next == NULL) {
        PyErr_Format(PyExc_KeyError, "job %u has no address for rank %d", j->id, (j->rank + 1) % world);
        return -1;
    }
    j->ring = 1;
    j->world = world;
    j->prev_rank = (j->rank + world - 1) % world;
    j->next_addr = *next;
    j->future_iterations = future;
    j->max_stash_bytes = max_stash;
    j->host_mode = host_mode;
    return 0;
}

static PyObject *Engine_add_job(Engine *e, PyObject *args) {
    unsigned int job_id;
    int rank;
    PyObject *peers;
    const char *key;
    Py_ssize_t keylen;
    PyObject *ring = Py_None;
    if (!PyArg_ParseTuple(args, "IiOy#|O", &job_id, &rank, &peers, &key, &keylen, &ring)) return NULL;
    /* ring: None, or (world, future_iterations, max_stash_bytes, host_mode), set up before the job
     * is visible to the engine's thread: a job that got its ring only afterwards (ring_add) would
     * have its first DATA, accepted and acknowledged, handed to Python instead of the ring, and
     * lost to it (a peer that starts sending while this rank is still building its ring). */
    int rworld = 0, rhost = 0;
    unsigned int rfuture = 0;
    unsigned long long rstash = 0;
    if (ring != Py_None && !PyArg_ParseTuple(ring, "iIKp", &rworld, &rfuture, &rstash, &rhost)) return NULL;
    if (keylen != 32) {
        PyErr_SetString(PyExc_ValueError, "the job key must be 32 bytes");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(peers, "peers must be a sequence of (rank, (ip, port))");
    if (seq == NULL) return NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    Job *j = calloc(1, sizeof *j);
    if (j) {
        j->peer_rank = calloc((size_t)np + 1, sizeof *j->peer_rank);
        j->peer_addr = calloc((size_t)np + 1, sizeof *j->peer_addr);
    }
    if (j == NULL || j->peer_rank == NULL || j->peer_addr == NULL) {
        Py_DECREF(seq);
        if (j) {
            free(j->peer_rank);
            free(j->peer_addr);
            free(j);
        }
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < np; i++) {
        int r;
        PyObject *a;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iO", &r, &a) ||
            parse_addr(a, &j->peer_addr[i]) < 0) {
            Py_DECREF(seq);
            free(j->peer_rank);
            free(j->peer_addr);
            free(j);
            return NULL;
        }
        j->peer_rank[i] = r;
    }
    Py_DECREF(seq);
    j->npeers = (int)np;
    j->id = job_id;
    j->rank = rank;
    memcpy(j->key, key, 32);
    j->latest_iteration = -1;
    j->released_through = -1;
    if (ring != Py_None && ring_setup(j, rworld, rfuture, rstash, rhost) < 0) {
        free_job(j, e); /* no ops or stash yet: nothing reaches the engine's lists */
        return NULL;
    }
    lock_from_python(e);
    Job **arr = realloc(e->jobs, (size_t)(e->njobs + 1) * sizeof *arr);
    if (arr == NULL) {
        pthread_mutex_unlock(&e->mu);
        free_job(j, e);
        return PyErr_NoMemory();
    }
    e->jobs = arr;
    for (int i = 0; i < e->njobs; i++)
        if (e->jobs[i]->id == job_id) { /* replaced, as Transport.add_job replaces */
            free_job(e->jobs[i], e);
            e->jobs[i] = j;
            j = NULL;
            break;
        }
    if (j) e->jobs[e->njobs++] = j;
    pthread_mutex_unlock(&e->mu);
    after_call(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_remove_job(Engine *e, PyObject *args) {
    unsigned int job_id;
    if (!PyArg_ParseTuple(args, "I", &job_id)) return NULL;
    lock_from_python(e);
    tx_drain(e);
    for (int i = 0; i < e->njobs; i++)
        if (e->jobs[i]->id == job_id) {
            free_job(e->jobs[i], e);
            e->jobs[i] = e->jobs[--e->njobs];
            break;
        }
    for (int i = 0; i < e->nsflows;) {
        SendFlow *f = e->sflows[i];
        if (f->job == job_id) {
            clear_sflow(e, f);
            free(f->slots);
            free(f->failed);
            free(f);
            e->sflows[i] = e->sflows[--e->nsflows];
        } else {
            i++;
        }
    }
    for (int i = 0; i < e->nrflows;) {
        RecvFlow *f = e->rflows[i];
        if (f->job == job_id) {
            free(f->bits);
            free(f);
            e->rflows[i] = e->rflows[--e->nrflows];
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&e->mu);
    after_call(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_ring_add(Engine *e, PyObject *args) {
    unsigned int job_id, future;
    int world;
    unsigned long long max_stash;
    int host_mode = 0;
    if (!PyArg_ParseTuple(args, "IiIK|p", &job_id, &world, &future, &max_stash, &host_mode)) return NULL;
    PyObject *result = NULL;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j == NULL) PyErr_Format(PyExc_KeyError, "job %u is not registered", job_id);
    else if (ring_setup(j, world, future, max_stash, host_mode) == 0) result = Py_None;
    pthread_mutex_unlock(&e->mu);
    Py_XINCREF(result);
    return result;
}

/* ring_replica(job, shard_key, (ip, port) | None): where host replication sends the copies of
 * shard_key's slots (None: nowhere). The table grows to the largest key set. */
static PyObject *Engine_ring_replica(Engine *e, PyObject *args) {
    unsigned int job_id, key;
    PyObject *addr_obj;
    if (!PyArg_ParseTuple(args, "IIO", &job_id, &key, &addr_obj)) return NULL;
    if (key > 0xFFFF) {
        PyErr_SetString(PyExc_ValueError, "a shard key is 16 bits");
        return NULL;
    }
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof addr);
    if (addr_obj != Py_None && parse_addr(addr_obj, &addr) < 0) return NULL;
    int rc = 0;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j == NULL) {
        rc = -1;
    } else if ((int)key >= j->nreplicas) {
        struct sockaddr_in *grown = realloc(j->replica, ((size_t)key + 1) * sizeof *grown);
        if (grown == NULL) {
            rc = -2;
        } else {
            memset(grown + j->nreplicas, 0, ((size_t)key + 1 - (size_t)j->nreplicas) * sizeof *grown);
            j->replica = grown;
            j->nreplicas = (int)key + 1;
        }
    }
    if (rc == 0) j->replica[key] = addr;
    pthread_mutex_unlock(&e->mu);
    if (rc == -1) return PyErr_Format(PyExc_KeyError, "job %u is not registered", job_id);
    if (rc == -2) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* op_start(job, iteration, bucket, work, source|None, dtype, shard_key) */
static PyObject *Engine_op_start(Engine *e, PyObject *args) {
    unsigned int job_id, iteration, bucket, shard;
    int dtype;
    PyObject *work, *source;
    if (!PyArg_ParseTuple(args, "IIIOOiI", &job_id, &iteration, &bucket, &work, &source, &dtype, &shard))
        return NULL;
    int size = itemsize_of(dtype);
    if (!size) {
        PyErr_Format(PyExc_ValueError, "dtype %d has no elements", dtype);
        return NULL;
    }
    Op *op = calloc(1, sizeof *op);
    if (op == NULL) return PyErr_NoMemory();
    if (PyObject_GetBuffer(work, &op->work_buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        free(op);
        return NULL;
    }
    if (source != Py_None) {
        if (PyObject_GetBuffer(source, &op->source_buf, PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&op->work_buf);
            free(op);
            return NULL;
        }
        op->has_source = 1;
        if (op->source_buf.len != op->work_buf.len) {
            op_free(op);
            PyErr_SetString(PyExc_ValueError, "source and work differ in size");
            return NULL;
        }
    }
    if (op->work_buf.len % size) {
        op_free(op);
        PyErr_SetString(PyExc_ValueError, "work is not a whole number of elements");
        return NULL;
    }
    op->job = job_id;
    op->iteration = iteration;
    op->bucket = bucket;
    op->dtype = dtype;
    op->itemsize = size;
    op->shard_key = shard;
    op->work = op->work_buf.buf;
    op->source = op->has_source ? (const uint8_t *)op->source_buf.buf : op->work;
    op->n = (uint64_t)op->work_buf.len / (uint64_t)size;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j == NULL || !j->ring) {
        pthread_mutex_unlock(&e->mu);
        op_free(op);
        PyErr_Format(PyExc_KeyError, "job %u has no native ring", job_id);
        return NULL;
    }
    if (find_op(j, iteration, bucket)) {
        pthread_mutex_unlock(&e->mu);
        op_free(op);
        PyErr_Format(PyExc_ValueError, "bucket %u of iteration %u was already started", bucket, iteration);
        return NULL;
    }
    /* the slot grid (ring_allreduce.slot_grid) */
    int world = j->world;
    uint32_t per = MAX_PAYLOAD / (uint32_t)size;
    op->bounds = calloc((size_t)world + 1, sizeof *op->bounds);
    op->first_slot = calloc((size_t)world + 1, sizeof *op->first_slot);
    uint64_t nslots = 0;
    if (op->bounds && op->first_slot) {
        for (int c = 0; c <= world; c++) op->bounds[c] = (uint64_t)c * op->n / (uint64_t)world;
        for (int c = 0; c < world; c++) {
            op->first_slot[c] = (uint32_t)nslots;
            nslots += (op->bounds[c + 1] - op->bounds[c] + per - 1) / per;
        }
        op->first_slot[world] = (uint32_t)nslots;
    }
    op->nslots = (uint32_t)nslots;
    op->offsets = calloc(nslots + 1, sizeof *op->offsets);
    op->counts = calloc(nslots + 1, sizeof *op->counts);
    op->chunk = calloc(nslots + 1, sizeof *op->chunk);
    op->last = calloc(nslots + 1, 1);
    op->state = calloc(nslots + 1, 1);
    if (!op->bounds || !op->first_slot || !op->offsets || !op->counts || !op->chunk || !op->last ||
        !op->state) {
        pthread_mutex_unlock(&e->mu);
        op_free(op);
        return PyErr_NoMemory();
    }
    uint32_t k = 0;
    for (int c = 0; c < world; c++)
        for (uint64_t o = op->bounds[c]; o < op->bounds[c + 1]; o += per) {
            op->offsets[k] = o;
            op->counts[k] = (uint32_t)(op->bounds[c + 1] - o < per ? op->bounds[c + 1] - o : per);
            op->chunk[k] = (uint32_t)c;
            op->last[k] = o + per >= op->bounds[c + 1];
            k++;
        }
    op->remaining = op->nslots;
    op->next = j->ops;
    j->ops = op;
    if ((int64_t)iteration > j->latest_iteration) j->latest_iteration = iteration;
    for (uint32_t s = op->first_slot[j->rank]; s < op->first_slot[j->rank + 1]; s++)
        ring_send(e, j, op, s, 0, 1);
    Stash **pp = &j->stash, *mine = NULL;
    while (*pp) {
        Stash *s = *pp;
        if (s->iteration == iteration && s->bucket == bucket) {
            *pp = s->next;
            s->next = mine;
            mine = s;
        } else {
            pp = &s->next;
        }
    }
    /* the stash was pushed at the front: reverse to apply in arrival order */
    Stash *ordered = NULL;
    while (mine) {
        Stash *next = mine->next;
        mine->next = ordered;
        ordered = mine;
        mine = next;
    }
    while (ordered) {
        Stash *next = ordered->next;
        j->stash_bytes -= ordered->len - HDR;
        if (!op->failed) ring_apply(e, j, op, ordered->data, ordered->data + HDR, ordered->len);
        stash_free(e, ordered);
        ordered = next;
    }
    if (op->remaining == 0 && !op->done) {
        op->done = 1;
        Event *ev = event_new(e, EV_DONE, 0);
        if (ev) {
            ev->job = job_id;
            ev->iteration = iteration;
            ev->bucket = bucket;
        }
    }
    flush_out(e);
    pthread_mutex_unlock(&e->mu);
    after_call(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_release_through(Engine *e, PyObject *args) {
    unsigned int job_id;
    long long through;
    if (!PyArg_ParseTuple(args, "IL", &job_id, &through)) return NULL;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j && through > j->released_through) {
        j->released_through = through;
        Op **pp = &j->ops;
        while (*pp) {
            Op *op = *pp;
            if ((int64_t)op->iteration <= through && (op->done || op->failed)) {
                *pp = op->next;
                op->released = 1;
                op->queued_at = e->tx.queued + (uint64_t)e->nout; /* host copies send from it */
                op->next = e->zombies;
                e->zombies = op;
            } else {
                pp = &op->next;
            }
        }
        Stash **sp = &j->stash;
        while (*sp) {
            Stash *s = *sp;
            if ((int64_t)s->iteration <= through) {
                *sp = s->next;
                j->stash_bytes -= s->len - HDR;
                stash_free(e, s);
            } else {
                sp = &s->next;
            }
        }
    }
    pthread_mutex_unlock(&e->mu);
    after_call(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_fail_ops(Engine *e, PyObject *args) {
    unsigned int job_id;
    if (!PyArg_ParseTuple(args, "I", &job_id)) return NULL;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j)
        for (Op *op = j->ops; op; op = op->next)
            if (!op->done) op->failed = 1;
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_op_state(Engine *e, PyObject *args) {
    unsigned int job_id, iteration, bucket;
    if (!PyArg_ParseTuple(args, "III", &job_id, &iteration, &bucket)) return NULL;
    PyObject *out = NULL;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    Op *op = j ? find_op(j, iteration, bucket) : NULL;
    if (op) out = PyBytes_FromStringAndSize((const char *)op->state, op->nslots);
    pthread_mutex_unlock(&e->mu);
    if (out == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return out;
}

/* send(ip_port, job, header32, payload) -> 0 / -1 failed flow / -2 no memory / -3 sequence exhausted */
static PyObject *Engine_send(Engine *e, PyObject *args) {
    PyObject *addr_obj;
    unsigned int job_id;
    Py_buffer hdr, payload;
    if (!PyArg_ParseTuple(args, "OIy*y*", &addr_obj, &job_id, &hdr, &payload)) return NULL;
    struct sockaddr_in addr;
    if (parse_addr(addr_obj, &addr) < 0 || hdr.len != HDR || payload.len > MAX_PAYLOAD) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a 32-byte header and at most 8940 bytes");
        PyBuffer_Release(&hdr);
        PyBuffer_Release(&payload);
        return NULL;
    }
    uint8_t *copy = NULL;
    if (payload.len) {
        copy = malloc((size_t)payload.len);
        if (copy == NULL) {
            PyBuffer_Release(&hdr);
            PyBuffer_Release(&payload);
            return PyErr_NoMemory();
        }
        memcpy(copy, payload.buf, (size_t)payload.len);
    }
    uint8_t h[HDR];
    memcpy(h, hdr.buf, HDR);
    uint32_t len = (uint32_t)payload.len;
    PyBuffer_Release(&hdr);
    PyBuffer_Release(&payload);
    int rc;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j == NULL) {
        free(copy);
        rc = -4;
    } else {
        rc = send_item(e, j, &addr, h, copy, len, copy, NULL);
        flush_out(e);
    }
    pthread_mutex_unlock(&e->mu);
    after_call(e);
    return PyLong_FromLong(rc);
}

/* emit(datagram, ip_port): one datagram outside any flow, with the injected faults. */
static PyObject *Engine_emit(Engine *e, PyObject *args) {
    Py_buffer data;
    PyObject *addr_obj;
    if (!PyArg_ParseTuple(args, "y*O", &data, &addr_obj)) return NULL;
    struct sockaddr_in addr;
    if (parse_addr(addr_obj, &addr) < 0 || data.len < HDR) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a datagram has at least 32 bytes");
        PyBuffer_Release(&data);
        return NULL;
    }
    lock_from_python(e);
    const uint8_t *d = data.buf;
    emit(e, d, d + HDR, (size_t)data.len - HDR, &addr);
    tx_drain(e); /* the caller's buffer is released below */
    pthread_mutex_unlock(&e->mu);
    PyBuffer_Release(&data);
    after_call(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_flow_error(Engine *e, PyObject *args) {
    PyObject *addr_obj;
    unsigned int job_id;
    if (!PyArg_ParseTuple(args, "OI", &addr_obj, &job_id)) return NULL;
    struct sockaddr_in addr;
    if (parse_addr(addr_obj, &addr) < 0) return NULL;
    PyObject *out = NULL;
    lock_from_python(e);
    SendFlow *f = find_sflow(e, &addr, job_id);
    if (f && f->failed) out = Py_BuildValue("(is)", f->peer_rank, f->failed);
    pthread_mutex_unlock(&e->mu);
    if (out == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return out;
}

static PyObject *Engine_set_tap(Engine *e, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    lock_from_python(e);
    e->tap = on;
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_stats(Engine *e, PyObject *unused) {
    (void)unused;
    uint64_t c[C_COUNT];
    long flows_send, flows_recv, unacked = 0;
    int gso;
    lock_from_python(e);
    memcpy(c, e->counters, sizeof c);
    pthread_mutex_lock(&e->tx.mu);
    for (int i = 0; i < C_COUNT; i++) c[i] += e->tx.counters[i];
    pthread_mutex_unlock(&e->tx.mu);
    flows_send = e->nsflows;
    flows_recv = e->nrflows;
    for (int i = 0; i < e->nsflows; i++) unacked += e->sflows[i]->n_unacked + e->sflows[i]->n_pending;
    gso = e->gso;
    pthread_mutex_unlock(&e->mu);
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int i = 0; i < C_COUNT; i++) {
        if (!c[i]) continue;
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (v == NULL || PyDict_SetItemString(d, counter_names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyObject *extra = Py_BuildValue("(lll)", flows_send, flows_recv, unacked);
    if (extra == NULL) {
        Py_DECREF(d);
        return NULL;
    }
    PyDict_SetItemString(d, "flows.send", PyTuple_GET_ITEM(extra, 0));
    PyDict_SetItemString(d, "flows.recv", PyTuple_GET_ITEM(extra, 1));
    PyDict_SetItemString(d, "unacked", PyTuple_GET_ITEM(extra, 2));
    Py_DECREF(extra);
    (void)gso;
    return d;
}

static PyObject *Engine_ring_stats(Engine *e, PyObject *args) {
    unsigned int job_id;
    if (!PyArg_ParseTuple(args, "I", &job_id)) return NULL;
    uint64_t c[C_COUNT];
    uint64_t stash_bytes = 0, stashed = 0;
    int found = 0;
    lock_from_python(e);
    Job *j = find_job(e, job_id);
    if (j) {
        memcpy(c, j->ring_counters, sizeof c);
        stashed = j->stashed;
        stash_bytes = j->stash_bytes;
        found = 1;
    }
    pthread_mutex_unlock(&e->mu);
    PyObject *d = PyDict_New();
    if (d == NULL || !found) return d;
    for (int i = RING_FIRST; i <= RING_LAST; i++)
        if (c[i]) {
            PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
            PyDict_SetItemString(d, counter_names[i], v);
            Py_XDECREF(v);
        }
    if (stashed) {
        PyObject *v = PyLong_FromUnsignedLongLong(stashed);
        PyDict_SetItemString(d, "stashed", v);
        Py_XDECREF(v);
    }
    PyObject *v = PyLong_FromUnsignedLongLong(stash_bytes);
    PyDict_SetItemString(d, "stash_bytes", v);
    Py_XDECREF(v);
    return d;
}

static PyObject *Engine_busy(Engine *e, PyObject *unused) {
    (void)unused;
    int busy = 0;
    lock_from_python(e);
    for (int i = 0; i < e->nsflows; i++) {
        SendFlow *f = e->sflows[i];
        if (!f->failed && (f->n_unacked || f->n_pending)) busy = 1;
    }
    pthread_mutex_unlock(&e->mu);
    return PyBool_FromLong(busy);
}

static PyObject *Engine_deadline(Engine *e, PyObject *unused) {
    (void)unused;
    double d;
    lock_from_python(e);
    d = e->deadline;
    pthread_mutex_unlock(&e->mu);
    return PyFloat_FromDouble(d);
}

static void Engine_dealloc(Engine *e) {
    if (e->rxbuf) {
        engine_stop(e);
        for (int i = 0; i < e->nsflows; i++) {
            clear_sflow(e, e->sflows[i]);
            free(e->sflows[i]->slots);
            free(e->sflows[i]->failed);
            free(e->sflows[i]);
        }
        for (int i = 0; i < e->nrflows; i++) {
            free(e->rflows[i]->bits);
            free(e->rflows[i]);
        }
        for (int i = 0; i < e->njobs; i++) free_job(e->jobs[i], e);
        Op *op = e->zombies;
        while (op) {
            Op *next = op->next;
            op_free(op);
            op = next;
        }
        Event *ev = e->ev_head;
        while (ev) {
            Event *next = ev->next;
            free(ev);
            ev = next;
        }
        while (e->spare_stash) {
            Stash *next = e->spare_stash->next;
            free(e->spare_stash);
            e->spare_stash = next;
        }
        while (e->spare_items) {
            Item *next = e->spare_items->qnext;
            free(e->spare_items);
            e->spare_items = next;
        }
        free(e->held);
        free(e->sflows);
        free(e->rflows);
        free(e->jobs);
        free(e->out);
        free(e->tx.next);
        free(e->tx.active);
        free(e->rxbuf);
        close(e->efd);
        pthread_mutex_destroy(&e->mu);
    }
    Py_XDECREF(e->dispatch);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *hmac_tag(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer key, data;
    if (!PyArg_ParseTuple(args, "y*y*", &key, &data)) return NULL;
    if (key.len != 32) {
        PyBuffer_Release(&key);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "a 32-byte key");
        return NULL;
    }
    uint8_t mac[32];
    cm_hmac_sha256(key.buf, data.buf, (size_t)data.len, NULL, 0, mac);
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)mac, 32);
}

static PyObject *reduce_into(PyObject *self, PyObject *args) {
    /* reduce_into(dtype, out, wire): out += wire, as the ring adds (for tests) */
    (void)self;
    int dtype;
    Py_buffer out, wire;
    if (!PyArg_ParseTuple(args, "iw*y*", &dtype, &out, &wire)) return NULL;
    int size = itemsize_of(dtype);
    if (!size || out.len != wire.len || out.len % size) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&wire);
        PyErr_SetString(PyExc_ValueError, "equal buffers of whole elements of a known dtype");
        return NULL;
    }
    uint32_t n = (uint32_t)(out.len / size);
    if (dtype == 1) add_f32(out.buf, out.buf, wire.buf, n);
    else if (dtype == 2) add_bf16(out.buf, wire.buf, n);
    else add_f16(out.buf, wire.buf, n);
    PyBuffer_Release(&out);
    PyBuffer_Release(&wire);
    Py_RETURN_NONE;
}

static PyMethodDef Engine_methods[] = {
    {"start", (PyCFunction)Engine_start, METH_NOARGS, "Start the engine's thread."},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS, "Stop and join the engine's thread."},
    {"forget", (PyCFunction)Engine_forget, METH_NOARGS, "In a forked child: drop the parent's thread."},
    {"add_job", (PyCFunction)Engine_add_job, METH_VARARGS,
     "add_job(job, rank, [(rank, (ip, port))], key32, ring=None | (world, future, max_stash, host_mode))"},
    {"remove_job", (PyCFunction)Engine_remove_job, METH_VARARGS, "remove_job(job)"},
    {"ring_add", (PyCFunction)Engine_ring_add, METH_VARARGS,
     "ring_add(job, world, future_iterations, max_stash_bytes, host_mode=False): the job's DATA is "
     "reduced here; host_mode: REPLICATE stays off the wire and the owner sends ring_replica copies"},
    {"ring_replica", (PyCFunction)Engine_ring_replica, METH_VARARGS,
     "ring_replica(job, shard_key, (ip, port) | None): where host mode copies shard_key's slots"},
    {"op_start", (PyCFunction)Engine_op_start, METH_VARARGS,
     "op_start(job, iteration, bucket, work, source|None, dtype, shard_key)"},
    {"release_through", (PyCFunction)Engine_release_through, METH_VARARGS, "release_through(job, iteration)"},
    {"fail_ops", (PyCFunction)Engine_fail_ops, METH_VARARGS, "fail_ops(job): every running op fails"},
    {"op_state", (PyCFunction)Engine_op_state, METH_VARARGS, "op_state(job, iteration, bucket) -> bytes"},
    {"send", (PyCFunction)Engine_send, METH_VARARGS, "send((ip, port), job, header32, payload) -> rc"},
    {"emit", (PyCFunction)Engine_emit, METH_VARARGS, "emit(datagram, (ip, port))"},
    {"flow_error", (PyCFunction)Engine_flow_error, METH_VARARGS, "flow_error((ip, port), job)"},
    {"set_tap", (PyCFunction)Engine_set_tap, METH_VARARGS, "set_tap(on)"},
    {"stats", (PyCFunction)Engine_stats, METH_NOARGS, "counters"},
    {"ring_stats", (PyCFunction)Engine_ring_stats, METH_VARARGS, "ring_stats(job)"},
    {"busy", (PyCFunction)Engine_busy, METH_NOARGS, "whether data is outstanding"},
    {"deadline", (PyCFunction)Engine_deadline, METH_NOARGS, "the timer's next deadline (inf: none)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hosts.native._datapath.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native data path of one transport socket (see hosts/native/datapath.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

static PyMethodDef module_methods[] = {
    {"hmac_tag", hmac_tag, METH_VARARGS, "hmac_tag(key32, data) -> HMAC-SHA256 (for tests)"},
    {"reduce_into", reduce_into, METH_VARARGS, "reduce_into(dtype, out, wire): the ring's add (for tests)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_datapath",
                                       "The native data path (hosts/native/datapath.c).", -1, module_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__datapath(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "HEADER_BYTES", HDR);
    PyModule_AddIntConstant(m, "MAX_PAYLOAD_BYTES", MAX_PAYLOAD);
    return m;
}
