/*
 * test_dn_free_unlocked.c - the decode node frees a reservation's sequence and bundle parts
 * outside its lock (dn_node.lock), on every path: Release, a failed transfer (the transport's
 * callback), and expiry on the batching loop's thread. Freeing a sequence takes the pool's lock
 * and freeing parts may unmap tens of MB: done under the node's lock it would hold up every
 * handler, the transport's callbacks and the loop meanwhile.
 * How: the decode node's sources are compiled into this test with kr_seq_free and
 * kt_bundle_set_free routed through wrappers that ask the node's lock, an error-checking mutex
 * here, whether the calling thread holds it (EDEADLK). Reservations are built by hand (no
 * model, no transport, no gRPC). Also checks that the blocks come out of the accounting.
 * Run: ctest -R test_dn_free_unlocked (under a second).
 */
#include "kr_test.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "bundle.h"
#include "kr.h"

/* every free of a sequence or of a set's parts in the decode node's sources goes through these */
#define kr_seq_free dn_test_seq_free
#define kt_bundle_set_free dn_test_set_free
void dn_test_seq_free(kr_seq *s);
void dn_test_set_free(kt_bundle_set *s);

#include "../../decode-node/import.c"
#include "../../decode-node/loop.c"
#include "../../decode-node/resv.c"

#undef kr_seq_free
#undef kt_bundle_set_free

static dn_node *g_node;
static atomic_int g_frees, g_under_lock;

static void note_free(void)
{
    int e = pthread_mutex_lock(&g_node->lock);
    if (e == EDEADLK)
        atomic_fetch_add(&g_under_lock, 1); /* this thread holds the node's lock */
    else if (e == 0)
        pthread_mutex_unlock(&g_node->lock);
    atomic_fetch_add(&g_frees, 1);
}

void dn_test_seq_free(kr_seq *s)
{
    if (s)
        note_free();
    kr_seq_free(s);
}

void dn_test_set_free(kt_bundle_set *s)
{
    if (s->region || s->n_parts)
        note_free();
    kt_bundle_set_free(s);
}

enum { CAP = 4, BLOCKS = 64 };

/* A reservation in `state` holding a sequence and an RMA region, linked into the table and
 * counted in reserved_sum. */
static dn_resv *add_resv(dn_node *n, uint64_t id, dn_resv_state state)
{
    char err[KR_ERR_MAX];
    dn_resv *r = calloc(1, sizeof *r);
    REQUIRE(r && (r->parts = calloc(CAP, sizeof *r->parts)), "out of memory");
    kt_bundle_set_init(&r->set, r->parts, CAP);
    r->set.region = kt_partbuf_alloc(1 << 16);
    REQUIRE(r->set.region, "kt_partbuf_alloc");
    REQUIRE(kr_seq_create(n->pool, 1, 1, &r->seq, err) == KR_OK, "kr_seq_create: %s", err);
    r->id = id;
    r->node = n;
    r->state = state;
    r->xfer_open = state == DN_RESV_WAITING;
    snprintf(r->request_id, sizeof r->request_id, "req-%" PRIu64, id);
    r->blocks = r->blocks_bound = 8;
    r->expires = state == DN_RESV_READY ? 0.0 : dn_now() + 600.0; /* READY: expired already */
    pthread_mutex_lock(&n->lock);
    r->next = n->resvs;
    n->resvs = r;
    n->n_resvs++;
    n->reserved_sum += r->blocks;
    pthread_mutex_unlock(&n->lock);
    return r;
}

static int64_t reserved_sum(dn_node *n)
{
    pthread_mutex_lock(&n->lock);
    int64_t s = n->reserved_sum;
    pthread_mutex_unlock(&n->lock);
    return s;
}

static void test_release(dn_node *n)
{
    add_resv(n, 11, DN_RESV_READY);
    int before = atomic_load(&g_frees);
    CHECK(dn_resv_release(n, 11, "req-11") == 1, "release of a READY reservation");
    CHECK(atomic_load(&g_frees) - before >= 2, "the sequence and the parts were freed");
    CHECK(atomic_load(&g_under_lock) == 0, "Release freed %d things under the node's lock",
          atomic_load(&g_under_lock));
    CHECK(reserved_sum(n) == 0 && n->n_resvs == 0, "accounting after Release: %" PRId64,
          reserved_sum(n));
}

static void test_failed_transfer(dn_node *n)
{
    add_resv(n, 12, DN_RESV_WAITING);
    atomic_store(&g_under_lock, 0);
    int before = atomic_load(&g_frees);
    on_transfer(n, 12, 1, 0, "the sender died");
    CHECK(atomic_load(&g_frees) - before >= 2, "the sequence and the parts were freed");
    CHECK(atomic_load(&g_under_lock) == 0, "the transfer's callback freed %d things under the "
          "node's lock", atomic_load(&g_under_lock));
    CHECK(reserved_sum(n) == 0, "a failed reservation counts no blocks: %" PRId64, reserved_sum(n));
    pthread_mutex_lock(&n->lock);
    dn_resv *r = dn_resv_find_locked(n, 12);
    CHECK(r && r->state == DN_RESV_FAILED && strstr(r->err, "sender died"), "the tombstone");
    pthread_mutex_unlock(&n->lock);
    CHECK(dn_resv_release(n, 12, "req-12") == 1, "release of the tombstone");
}

static void test_expiry_on_the_loop(dn_node *n)
{
    char err[256];
    atomic_store(&g_under_lock, 0);
    int before = atomic_load(&g_frees);
    add_resv(n, 13, DN_RESV_READY); /* expired: the loop drops it at its next look */
    REQUIRE(dn_loop_start(n, err) == 0, "dn_loop_start: %s", err);
    for (int i = 0; i < 500 && atomic_load(&g_frees) - before < 2; i++)
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    dn_loop_stop(n);
    CHECK(atomic_load(&g_frees) - before >= 2, "the loop freed the expired reservation");
    CHECK(atomic_load(&g_under_lock) == 0, "the loop freed %d things under the node's lock",
          atomic_load(&g_under_lock));
    CHECK(reserved_sum(n) == 0 && n->n_resvs == 0, "accounting after expiry: %" PRId64,
          reserved_sum(n));
}

int main(void)
{
    char err[KR_ERR_MAX];
    kc_log_init("decode", KC_LOG_WARN);
    static kr_config mcfg = {.vocab_size = 32, .n_layers = 1, .n_kv_heads = 1, .head_dim = 8};
    static dn_node node;
    dn_node *n = &node;
    g_node = n;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ERRORCHECK);
    pthread_mutex_init(&n->lock, &a);
    pthread_mutexattr_destroy(&a);
    pthread_cond_init(&n->cond, NULL);
    n->cfg.id = "decode-test";
    n->cfg.max_batch = 1;
    n->mcfg = &mcfg;
    REQUIRE(kr_kv_pool_create(mcfg.head_dim, 4, BLOCKS, KR_DTYPE_F32, &n->pool, err) == KR_OK,
            "kr_kv_pool_create: %s", err);
    n->total_blocks = BLOCKS;

    test_release(n);
    test_failed_transfer(n);
    test_expiry_on_the_loop(n);

    kr_kv_pool_free(n->pool);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    if (kt_failures)
        fprintf(stderr, "%d checks failed\n", kt_failures);
    return kt_failures ? 1 : 0;
}
