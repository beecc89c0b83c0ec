/*
 * kvrelay-transfer-bench - GB/s of kvrelay's bundle transport (kvtransfer/transport.h) over
 * loopback, next to ucx_perftest's figure for the same transport (UCX_TLS) and message size,
 * run by this program, and their ratio.
 * What it measures: reserve + send + acknowledgement per bundle (the full protocol a prefill
 * node pays), one bundle at a time and K at once, sender and receiver as two UCX contexts in
 * this process; with --validate the data is a real bundle of about the size and the receiver
 * validates it before acknowledging, as a decode node does (kt_transport_reserve with a set,
 * into buffers of each bundle's size: every checksum and field), and with --import the bundle is
 * padded to the blocks of a KV pool, goes in pieces, and lands with its K and V in a run of the
 * pool's blocks, which a sequence then adopts before the ack: a decode node's whole receive path
 * (decode-node/import.c; with --mode rma the run is taken and mapped at reserve time and the
 * sender puts K and V into it, kt_transport_map_rows and kt_transport_put with rows);
 * ucx_perftest runs as a server and a client process with -t TEST -s SIZE. With --mode rma each
 * reservation is mapped and the bundle put into it (kt_transport_reserve_rma, kt_transport_put),
 * next to ucx_perftest -t ucp_put_bw. It is not a test: nothing is asserted.
 * Run: kvrelay-transfer-bench [--sizes 1,4,16,64,256,1024] [--tls tcp] [--mode am|rma]
 * [--test NAME] [--rounds 3] [--validate [--import]] (sizes in MiB; rounds alternate the two
 * and the table gives medians). Progress
 * on stderr, the table on stdout. Figures: docs/transport.md.
 */
#include <inttypes.h>
#include <pthread.h>
#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bundle-rule.h"
#include "cli.h"
#include "partbuf.h"
#include "transport.h"

/* --import: entries per block of the receiver's KV pool (the decode node's default). */
#define BENCH_BLOCK_ROWS 16

/* The transfers in flight: slot k holds one bundle (its reservation, its send) and is free
 * again once both its callbacks have run. Callbacks put the freed slot in `ready` and post
 * `done`, so the measuring thread sleeps until one comes instead of polling a core the two
 * progress threads need (this machine may have only two). */
typedef struct window window;
typedef struct slot {
    window *w;
    int k;
    atomic_int left; /* callbacks still to come */
    kr_kv_pool *pool; /* --import: the receiver's KV pool, else NULL */
    kr_seq *seq; /* --import: what the parts went into (freed when the slot is reused) */
    int32_t run_first; /* --import: the run of blocks a part's K and V were received into */
    int run_n; /* 0: none */
    int import_failed;
} slot;

/* --import: parts whose K and V landed in KV blocks, and parts copied into them. */
static atomic_long n_adopted, n_copied;

/* --import: the decode node's placement hook (decode-node/import.c, without its checks against
 * a model and a reservation): a run of the pool's blocks for the part's K and V. */
static int place_part(void *arg, const kt_bundle_set *s, const kt_bundle_view *head, void **k,
                      void **v, char *err)
{
    slot *sl = arg;
    (void)s;
    (void)err;
    return kt_part_take_run(sl->seq, sl->pool, head, &sl->run_first, &sl->run_n, k, v);
}

/* --import: the decode node's part hook (the same): each part into the slot's sequence on the
 * progress thread, before the part's ack: the run it was received into adopted, or its rows
 * copied into blocks. */
static int import_part(void *arg, const kt_bundle_set *s, uint32_t i, char *err)
{
    slot *sl = arg;
    const kt_bundle_view *part = &s->parts[i];
    char why[KR_ERR_MAX];
    void *k = NULL, *v;
    int32_t *pos;
    if (sl->run_n)
        kr_kv_pool_run_rows(sl->pool, sl->run_first, &k, &v, &pos);
    int rc = !sl->seq && kr_seq_create(sl->pool, 1, 1, &sl->seq, why) != KR_OK;
    if (!rc && k && part->k == k) {
        rc = kt_bundle_part_adopt(sl->seq, sl->pool, part, sl->run_first, sl->run_n, why) != 0;
        sl->run_n = 0;
        atomic_fetch_add(&n_adopted, 1);
    } else if (!rc) {
        rc = kt_bundle_part_to_seq(sl->seq, part, part->hdr.head_dim, NULL, why) != 0;
        atomic_fetch_add(&n_copied, 1);
    }
    if (rc) {
        snprintf(err, KT_ERR_MAX, "import: %.450s", why);
        sl->import_failed = 1;
        return -1;
    }
    return 0;
}
struct window {
    sem_t done;
    pthread_mutex_t lock;
    int *ready, n_ready; /* freed slots (which one is reused first does not matter) */
    atomic_int failed;
};

static void count_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    slot *s = arg;
    window *w = s->w;
    if (status != 0) {
        fprintf(stderr, "kvrelay-transfer-bench: transfer %" PRIu64 ": %s\n", id, err);
        atomic_fetch_add(&w->failed, 1);
    }
    if (atomic_fetch_sub(&s->left, 1) == 1) {
        pthread_mutex_lock(&w->lock);
        w->ready[w->n_ready++] = s->k;
        pthread_mutex_unlock(&w->lock);
        sem_post(&w->done);
    }
    (void)bytes;
}

/* The bundles of one measurement and where they go. */
typedef struct flight {
    kt_transport *rx, *tx;
    const uint8_t *src;
    uint8_t *dst;
    uint64_t size;
    int validate, rma;
    kr_kv_pool *pool; /* --import */
    int run_blocks; /* --import with --mode rma: blocks a bundle's K and V are put into */
    window w;
    kt_rma_key *keys; /* rma: slot k's reservation key */
    slot *slots;
    kt_bundle_view *views;
    kt_bundle_set *sets;
} flight;

/* Reserves and sends one bundle in slot k. */
static void launch(flight *f, int k)
{
    static uint64_t next_id = 1; /* reservation ids, never reused */
    char err[KT_ERR_MAX];
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    const uint64_t id = next_id++;
    f->slots[k] = (slot){.w = &f->w, .k = k, .left = 2, .pool = f->pool};
    kt_bundle_set_init(&f->sets[k], &f->views[k], 1);
    if (f->pool) {
        f->sets[k].on_part = import_part;
        f->sets[k].on_place = place_part;
        f->sets[k].on_part_arg = &f->slots[k];
    }
    /* validating, the receiver is a decode node's: parts land in buffers the transport
     * allocates at their size, owned by the set */
    uint8_t *dst = f->dst + (uint64_t)k * f->size;
    const kt_peer to = {"127.0.0.1", kt_transport_port(f->rx), id, tok};
    kt_resv_opts ro = {.timeout_s = 60.0, .set = f->validate ? &f->sets[k] : NULL, .cb = count_cb,
                       .cb_arg = &f->slots[k]};
    const kt_send_opts so = {.timeout_s = 60.0, .cb = count_cb, .cb_arg = &f->slots[k]};
    int rc;
    if (f->rma && f->pool) { /* as a decode node: a run of blocks mapped for K and V too */
        slot *sl = &f->slots[k];
        kt_rma_rows rows;
        void *kr, *vr;
        int32_t *pos;
        if (kr_kv_pool_take_run(f->pool, f->run_blocks, &sl->run_first) != KR_OK)
            cli_die(1, "no free run of %d blocks for --import", f->run_blocks);
        sl->run_n = f->run_blocks;
        kr_kv_pool_run_rows(f->pool, sl->run_first, &kr, &vr, &pos);
        ro.set = &f->sets[k];
        rc = kt_transport_reserve_rma(f->rx, id, dst, f->size, &ro, tok, &f->keys[k], err) != 0 ||
             kt_transport_map_rows(f->rx, id, kr, vr,
                                   (uint64_t)f->run_blocks * BENCH_BLOCK_ROWS * 128 * sizeof(float), &rows,
                                   err) != 0 ||
             kt_transport_put(f->tx, &to, &(kt_put_dest){.key = &f->keys[k], .rows = &rows}, f->src,
                              f->size, &so, err) != 0;
    } else if (f->rma) /* the slot's buffer mapped, validated into the set when asked */
        rc = kt_transport_reserve_rma(f->rx, id, dst, f->size, &ro, tok, &f->keys[k], err) != 0 ||
             kt_transport_put(f->tx, &to, &(kt_put_dest){.key = &f->keys[k]}, f->src, f->size, &so,
                              err) != 0;
    else
        rc = kt_transport_reserve(f->rx, id, ro.set ? NULL : dst, f->size, &ro, tok, err) != 0 ||
             kt_transport_send(f->tx, &to, f->src, f->size, &so, err) != 0;
    if (rc)
        cli_die(1, "%s", err); /* transfers in flight may still call back: stop here */
}

/* Waits for a slot to come free and returns it. */
static int wait_slot(flight *f)
{
    while (sem_wait(&f->w.done) != 0) {
    }
    pthread_mutex_lock(&f->w.lock);
    int k = f->w.ready[--f->w.n_ready];
    pthread_mutex_unlock(&f->w.lock);
    if (f->validate)
        kt_bundle_set_free(&f->sets[k]);
    kr_seq_free(f->slots[k].seq); /* the blocks back to the pool */
    f->slots[k].seq = NULL;
    if (f->slots[k].run_n) /* a run whose part failed */
        kr_kv_pool_give_run(f->pool, f->slots[k].run_first, f->slots[k].run_n);
    f->slots[k].run_n = 0;
    return k;
}

/* Seconds per bundle of `size` bytes through the transport with `inflight` bundles in flight:
 * as soon as one has landed and been acknowledged, the next is reserved and sent in its place
 * (1: one at a time, the latency a single request pays; more: a busy prefill node shipping to
 * a decode node, the regime ucx_perftest's window measures), or -1. The first `inflight`
 * transfers connect and fill the window and are not timed. dst holds `inflight` buffers of
 * `size`. */
static double bench_kvrelay(kt_transport *rx, kt_transport *tx, const uint8_t *src, uint8_t *dst,
                            uint64_t size, int iters, int inflight, int validate, int rma,
                            kr_kv_pool *pool)
{
    static kt_rma_key keys[64]; /* --inflight's most */
    int ready[inflight];
    slot slots[inflight];
    kt_bundle_view views[inflight];
    kt_bundle_set sets[inflight];
    flight f = {.rx = rx, .tx = tx, .src = src, .dst = dst, .size = size, .validate = validate, .rma = rma,
                .pool = pool, .keys = keys,
                .w = {.ready = ready, .failed = 0}, .slots = slots, .views = views, .sets = sets};
    kt_bundle_layout lay;
    if (pool && rma && kt_bundle_layout_read(src, (size_t)size, &lay, NULL) == 0) /* make_bundle's */
        f.run_blocks = (int)(lay.k_len / (BENCH_BLOCK_ROWS * 128 * sizeof(float)));
    sem_init(&f.w.done, 0, 0);
    pthread_mutex_init(&f.w.lock, NULL);
    const int total = iters + inflight;
    int launched = 0, finished = 0;
    double t0 = 0;
    for (; launched < inflight; launched++)
        launch(&f, launched);
    while (finished < launched) {
        int k = wait_slot(&f);
        if (++finished == inflight)
            t0 = cli_now();
        if (launched < total && !atomic_load(&f.w.failed))
            launch(&f, k), launched++;
    }
    const double sec = (cli_now() - t0) / iters;
    sem_destroy(&f.w.done);
    pthread_mutex_destroy(&f.w.lock);
    return atomic_load(&f.w.failed) ? -1 : sec;
}

/* A valid bundle of at most `size` bytes at src (1 layer, 1 KV head, head_dim 128, f32 rows of
 * a pattern), its list padded to whole blocks of `block_rows` rows (0: packed): its size in
 * *bytes. */
static int make_bundle(uint8_t *src, uint64_t size, uint32_t block_rows, uint64_t *bytes,
                       char *err)
{
    enum { D = 128, RUN = 256 };
    kt_bundle_header h = {.fingerprint = "0123456789abcdef", .n_layers = 1, .n_kv_heads = 1,
                          .head_dim = D, .dtype = KT_DTYPE_F32, .prompt_len = 1,
                          .block_rows = block_rows};
    snprintf(h.policy, sizeof h.policy, "full");
    uint64_t overhead;
    kt_bundle_list list = {.window = KT_BUNDLE_WINDOW_DENSE};
    h.next_pos = 1;
    if (kt_bundle_size(&h, &list, &overhead, err) != 0)
        return -1;
    list.count = (uint32_t)((size - overhead - 3 * 64) / (2 * D * sizeof(float) + 4));
    if (block_rows) /* whole blocks: no padding to outgrow the size */
        list.count -= list.count % block_rows;
    h.next_pos = h.prompt_len = (int32_t)list.count;
    kt_bundle_writer w;
    if (kt_bundle_size(&h, &list, bytes, err) != 0 ||
        kt_bundle_writer_begin(&w, &h, &list, src, size, err) != 0)
        return -1;
    static float rows[RUN * D];
    static int32_t pos[RUN];
    for (int i = 0; i < RUN * D; i++)
        rows[i] = (float)(i % 1000) * 0.001f;
    for (uint32_t at = 0; at < list.count; at += RUN) {
        uint32_t n = list.count - at < RUN ? list.count - at : RUN;
        for (uint32_t j = 0; j < n; j++)
            pos[j] = (int32_t)(at + j);
        if (kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){n, pos, KT_DTYPE_F32, rows, rows}, err) !=
            0)
            return -1;
    }
    return kt_bundle_writer_finish(&w, bytes, err);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0, n) (sorts v). */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* MiB/s of `ucx_perftest -t test -s size`, or -1 (reason in why). */
static double bench_perftest(const char *test, uint64_t size, int iters, int port, char *why,
                             size_t why_len)
{
    char ports[16], sizes[32], ns[16];
    snprintf(ports, sizeof ports, "%d", port);
    snprintf(sizes, sizeof sizes, "%" PRIu64, size);
    snprintf(ns, sizeof ns, "%d", iters);
    pid_t srv = fork();
    if (srv == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execlp("ucx_perftest", "ucx_perftest", "-p", ports, (char *)NULL);
        _exit(127);
    }
    usleep(300000);
    int p[2];
    if (pipe(p) != 0)
        return -1;
    pid_t cl = fork();
    if (cl == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        execlp("ucx_perftest", "ucx_perftest", "127.0.0.1", "-p", ports, "-t", test, "-s", sizes,
               "-n", ns, "-w", "2", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    char buf[65536];
    size_t len = 0;
    ssize_t n;
    while ((n = read(p[0], buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)n;
    close(p[0]);
    buf[len] = 0;
    int st = 0;
    waitpid(cl, &st, 0);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 127) {
        snprintf(why, why_len, "ucx_perftest not found (apt-get install ucx-utils)");
        return -1;
    }
    const char *f = strstr(buf, "Final:");
    double v[6];
    if (!f || sscanf(f + 6, "%lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
                     &v[5]) != 6) {
        snprintf(why, why_len, "ucx_perftest gave no Final line (exit status %d)", st);
        return -1;
    }
    return v[5]; /* overall bandwidth, MiB/s */
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *sizes_s = "1,4,16,64,256,1024", *tls = "tcp", *test = NULL;
    int iters_flag = 0, port = 13500, inflight_flag = 8, validate = 0, n_rounds = 3, rma = 0, import = 0;
    static const kc_flag_choice modes[] = {{"am", 0}, {"rma", 1}, {NULL, 0}};
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--sizes", .arg = "MIB,...", .dest = &sizes_s, .def = "1,4,16,64,256,1024",
         .help = "bundle sizes in MiB"},
        {.kind = KC_FLAG_STRING, .name = "--tls", .arg = "LIST", .dest = &tls,
         .def = "tcp: what endpoints in PEER error mode use on one host",
         .help = "UCX_TLS for both kvrelay and ucx_perftest"},
        {.kind = KC_FLAG_CHOICE, .name = "--mode", .arg = "am|rma", .dest = &rma, .choices = modes, .def = "am",
         .help = "am: bundles sent as active messages (rendezvous); rma: each reservation mapped and the "
                 "bundle put into it"},
        {.kind = KC_FLAG_STRING, .name = "--test", .arg = "NAME", .dest = &test,
         .def = "the mode's: ucp_am_bw or ucp_put_bw", .help = "ucx_perftest test to compare with (tag_bw also useful)"},
        {.kind = KC_FLAG_INT, .name = "--iters", .arg = "N", .dest = &iters_flag, .min = 1, .max = 100000,
         .def = "about 4 GiB moved, 3..200", .help = "transfers per size"},
        {.kind = KC_FLAG_INT, .name = "--inflight", .arg = "K", .dest = &inflight_flag, .min = 1, .max = 64,
         .def = "8, fewer for large sizes so that they fit in 1 GiB of receive buffers",
         .help = "bundles in flight at once for the pipelined column"},
        {.kind = KC_FLAG_INT, .name = "--rounds", .arg = "R", .dest = &n_rounds, .min = 1, .max = 50,
         .def = "3", .help = "rounds per size, kvrelay and ucx_perftest taking turns; the table gives "
         "medians (this machine's loopback bandwidth drifts between runs)"},
        {.kind = KC_FLAG_INT, .name = "--port", .arg = "P", .dest = &port, .min = 1024, .max = 65000,
         .def = "13500", .help = "first TCP port for ucx_perftest"},
        {.kind = KC_FLAG_BOOL, .name = "--validate", .dest = &validate,
         .help = "send real bundles (one list of f32 rows, a little under each size) and validate each on "
                 "receipt before the ack, as a decode node does"},
        {.kind = KC_FLAG_BOOL, .name = "--import", .dest = &import,
         .help = "with --validate: bundles padded to the blocks of a KV pool, whose K and V the "
                 "receiver takes straight into a run of its blocks, as a decode node does (its "
                 "whole receive path; with --mode rma the run is mapped at reserve time and K and V "
                 "put into it)"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = {.prog = "kvrelay-transfer-bench", .usage = "[options]", .table = table};
    kc_flags_main(&flags, argc, argv, 0);
    int n_sizes = 0;
    int32_t *mib = cli_ids("--sizes", sizes_s, &n_sizes);
    uint64_t max = 0;
    for (int i = 0; i < n_sizes; i++) {
        if (mib[i] < 1 || mib[i] > 4096)
            cli_die(2, "--sizes: %d MiB is outside 1..4096", mib[i]);
        if ((uint64_t)mib[i] << 20 > max)
            max = (uint64_t)mib[i] << 20;
    }
    if (!test)
        test = rma ? "ucp_put_bw" : "ucp_am_bw";
    if (import && !validate)
        cli_die(2, "--import needs --validate (it takes the rows of real bundles)");
    kr_kv_pool *pool = NULL;
    if (import) { /* room for --inflight bundles of the largest size (make_bundle's shape) */
        char perr[KR_ERR_MAX];
        const int64_t blocks =
            (int64_t)inflight_flag * (int64_t)(max / (2 * 128 * 4 + 4) / BENCH_BLOCK_ROWS + 2);
        if (blocks > INT32_MAX ||
            kr_kv_pool_create(128, BENCH_BLOCK_ROWS, (int)blocks, KR_DTYPE_F32, &pool, perr) != KR_OK)
            cli_die(1, "a KV pool for --import: %s", blocks > INT32_MAX ? "too large" : perr);
    }
    setenv("UCX_TLS", tls, 1);
    char err[KT_ERR_MAX];
    kt_transport *rx = NULL, *tx = NULL;
    const kt_transport_mode mode = rma ? KT_TRANSPORT_MODE_RMA : KT_TRANSPORT_MODE_AM;
    kt_transport_config rc = {.mode = mode, .listen_host = "127.0.0.1", .name = "bench-rx"};
    kt_transport_config tc = {.mode = mode, .name = "bench-tx"};
    if (kt_transport_create(&rc, &rx, err) != 0 || kt_transport_create(&tc, &tx, err) != 0)
        cli_die(1, "%s", err);
    /* receive buffers: `inflight` bundles of the largest size, at most 1 GiB (or one bundle) */
    uint64_t dst_bytes = max * (uint64_t)inflight_flag;
    if (dst_bytes > (1ull << 30))
        dst_bytes = max > (1ull << 30) ? max : (1ull << 30);
    /* bundle buffers as the nodes take them (partbuf.h: huge pages from 2 MiB up): a prefill
     * node's send buffer, and the receiver's memory (a decode node's KV pool is in huge pages
     * too, kr_kv_pool_create) */
    uint8_t *src = kt_partbuf_alloc(max), *dst = kt_partbuf_alloc(dst_bytes);
    if (!src || !dst)
        cli_die(1, "cannot allocate %" PRIu64 " + %" PRIu64 " bytes", max, dst_bytes);
    for (uint64_t i = 0; i < max; i++)
        src[i] = (uint8_t)(i * 131 + 7);
    memset(dst, 0, dst_bytes);

    printf("# UCX_TLS=%s, loopback; kvrelay = reserve + %s + ack per bundle%s: one at a time (1), "
           "and K in flight (K); perftest = ucx_perftest -t %s (overall); %d interleaved rounds "
           "(kvrelay then perftest), medians; ratio = median over rounds of K / perftest\n",
           tls, rma ? "put + flush + header" : "send",
           import ? " + validation, K and V received into KV blocks"
                  : validate ? " + validation on receipt" : "",
           test, n_rounds);
    printf("%10s %4s %14s %14s %14s %8s  %s\n", "size_MiB", "K", "kvrelay_1", "kvrelay_K",
           "perftest_GB/s", "ratio", "ratio_per_round");
    for (int i = 0; i < n_sizes; i++) {
        uint64_t size = (uint64_t)mib[i] << 20;
        int iters = iters_flag ? iters_flag : (int)((4ull << 30) / size);
        iters = iters_flag ? iters : (iters < 3 ? 3 : iters > 200 ? 200 : iters);
        int k = (int)(dst_bytes / size) < inflight_flag ? (int)(dst_bytes / size) : inflight_flag;
        uint64_t bytes = size; /* what one transfer moves */
        /* importing, the bundle is laid out as the pool's blocks (as a prefill node writes
         * it for a decode node), so its K and V land in them */
        if (validate && make_bundle(src, size, import ? BENCH_BLOCK_ROWS : 0, &bytes, err) != 0)
            cli_die(1, "%s", err);
        atomic_store(&n_adopted, 0);
        atomic_store(&n_copied, 0);
        double one[n_rounds], ours[n_rounds], ptg[n_rounds], ratio[n_rounds];
        char why[256] = "", per[64 * 8] = "";
        int have_pt = 1;
        for (int r = 0; r < n_rounds; r++) {
            fprintf(stderr, "kvrelay-transfer-bench: %d MiB x %d, round %d/%d: kvrelay, then "
                    "ucx_perftest -t %s\n", mib[i], iters, r + 1, n_rounds, test);
            double sec1 = bench_kvrelay(rx, tx, src, dst, bytes, iters, 1, validate, rma, pool);
            double seck = k > 1 ? bench_kvrelay(rx, tx, src, dst, bytes, iters, k, validate, rma, pool)
                                : sec1;
            one[r] = bytes / sec1 / 1e9;
            ours[r] = bytes / seck / 1e9;
            double pt = have_pt ? bench_perftest(test, size, iters, port + i * n_rounds + r, why, sizeof why) : -1;
            have_pt = pt > 0;
            ptg[r] = have_pt ? pt * 1048576.0 / 1e9 : 0;
            ratio[r] = have_pt ? ours[r] / ptg[r] : 0;
            if (have_pt && r < 8)
                snprintf(per + strlen(per), sizeof per - strlen(per), "%s%.2f", r ? "," : "",
                         ratio[r]);
        }
        if (have_pt)
            printf("%10d %4d %14.2f %14.2f %14.2f %8.2f  %s\n", mib[i], k,
                   median(one, n_rounds), median(ours, n_rounds), median(ptg, n_rounds),
                   median(ratio, n_rounds), per);
        else
            printf("%10d %4d %14.2f %14.2f %14s %8s   # %s\n", mib[i], k, median(one, n_rounds),
                   median(ours, n_rounds), "n/a", "n/a", why);
        if (import)
            fprintf(stderr, "kvrelay-transfer-bench: %d MiB: %ld parts received into KV blocks, "
                    "%ld copied into them (no free run, or not laid out as the pool's blocks)\n",
                    mib[i], atomic_load(&n_adopted), atomic_load(&n_copied));
        fflush(stdout);
    }
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
    kr_kv_pool_free(pool);
    kt_partbuf_free(src);
    kt_partbuf_free(dst);
    free(mib);
    return 0;
}
