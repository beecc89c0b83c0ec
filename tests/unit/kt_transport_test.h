/*
 * kt_transport_test.h - what the transport's two test programs share (test_transport.c: the
 * protocol over active messages, refusals, timeouts and peer death; test_transport_pieces.c:
 * parts in pieces and RMA puts): a completion box, transports on loopback, and the bundles they
 * send (segments of a 2-layer test model, whole or padded to blocks), and a placement hook.
 * Header-only (static inline): tests/unit/ builds one program per test_*.c.
 */
#ifndef KT_TRANSPORT_TEST_H
#define KT_TRANSPORT_TEST_H

#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "kr_test.h"
#include "bundle.h"
#include "transport.h"

#define HOST "127.0.0.1"

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* One awaited completion. */
typedef struct done_box {
    pthread_mutex_t m;
    pthread_cond_t c;
    int done, status;
    uint64_t bytes;
    char msg[KT_ERR_MAX];
} done_box;

static inline void box_init(done_box *b)
{
    memset(b, 0, sizeof *b);
    pthread_mutex_init(&b->m, NULL);
    pthread_cond_init(&b->c, NULL);
}

static inline void box_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    done_box *b = arg;
    pthread_mutex_lock(&b->m);
    b->done++;
    b->status = status;
    b->bytes = bytes;
    snprintf(b->msg, sizeof b->msg, "%s", err ? err : "");
    pthread_cond_broadcast(&b->c);
    pthread_mutex_unlock(&b->m);
    (void)id;
}

/* 1 when the box completed within `secs`, 0 otherwise. */
static inline int box_wait(done_box *b, double secs)
{
    double end = now_s() + secs;
    pthread_mutex_lock(&b->m);
    while (!b->done && now_s() < end) {
        pthread_mutex_unlock(&b->m);
        sleep_ms(2);
        pthread_mutex_lock(&b->m);
    }
    int d = b->done;
    pthread_mutex_unlock(&b->m);
    return d;
}

static inline void fill(uint8_t *p, size_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
    }
}

static inline kt_transport *make(const char *name, int listen, uint16_t port, char *err)
{
    kt_transport_config cfg = {.mode = KT_TRANSPORT_MODE_AM, .listen_host = listen ? HOST : NULL,
                               .listen_port = port, .name = name};
    kt_transport *t = NULL;
    if (kt_transport_create(&cfg, &t, err) != 0)
        return NULL;
    return t;
}

/* The receiver ("test-rx", listening on HOST) and sender ("test-tx") every test program uses;
 * 0, or KT_SKIP (said on stdout) where UCX cannot listen here. */
static inline int make_pair(kt_transport **rx, kt_transport **tx)
{
    char err[KT_ERR_MAX];
    *rx = make("test-rx", 1, 0, err);
    if (!*rx) {
        printf("SKIPPED: UCX cannot listen on %s here: %s\n", HOST, err);
        return KT_SKIP;
    }
    *tx = make("test-tx", 0, 0, err);
    REQUIRE(*tx, "sender transport: %s", err);
    return 0;
}

/* A header of the test model's 2 KV heads: `layers` layers of head_dim `dim`, a prompt of
 * `prompt` tokens. */
static inline kt_bundle_header test_header(uint32_t layers, uint32_t dim, kt_dtype dtype,
                                    int32_t first_token, int32_t prompt, const char *policy)
{
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.fingerprint, sizeof h.fingerprint, "0123456789abcdef");
    h.n_layers = layers;
    h.n_kv_heads = 2;
    h.head_dim = dim;
    h.dtype = dtype;
    h.first_token = first_token;
    h.prompt_len = prompt;
    h.next_pos = prompt;
    snprintf(h.policy, sizeof h.policy, "%s", policy);
    return h;
}

/* Writes layer `layer` of the 2-layer test model as a layer segment into buf (cap bytes);
 * returns its size. Layer 0 carries a provisional first token and next_pos, layer 1 the real
 * ones; `first_layer` lets a test lie about where the segment starts. */
static inline uint64_t write_segment(uint8_t *buf, uint64_t cap, uint32_t layer, uint32_t first_layer)
{
    kt_bundle_header h = test_header(1, 32, KT_DTYPE_INT8_TOKEN, layer == 1 ? 9 : 0, 30, "full");
    h.segment = 1;
    h.first_layer = first_layer;
    kt_bundle_list lists[2] = {{.count = 10 + layer, .window = KT_BUNDLE_WINDOW_DENSE},
                               {.count = 5, .window = KT_BUNDLE_WINDOW_DENSE}};
    char err[KT_ERR_MAX];
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &h, lists, buf, cap, err) == 0, "%s", err);
    float k[11 * 32], v[11 * 32];
    int32_t pos[11];
    for (uint32_t hd = 0; hd < 2; hd++) {
        for (uint32_t e = 0; e < lists[hd].count; e++) {
            pos[e] = (int32_t)(2 * e);
            for (int d = 0; d < 32; d++) {
                k[e * 32 + d] = (float)(layer * 100 + hd * 10 + e) + (float)d * 0.5f;
                v[e * 32 + d] = -k[e * 32 + d];
            }
        }
        REQUIRE(kt_bundle_writer_put(
                    &w, 0, hd, &(kt_rows_in){lists[hd].count, pos, KT_DTYPE_F32, k, v}, err) == 0,
                "%s", err);
    }
    uint64_t size = 0;
    REQUIRE(kt_bundle_writer_finish(&w, &size, err) == 0, "%s", err);
    return size;
}

/* Layer `layer` of the 2-layer test model (head_dim 64, bf16) as a layer segment padded to
 * blocks of `block_rows` rows (format 2.3), lists of `count` and `count / 3 + 1` entries; the
 * segment of layer 1 is the last. Returns its size, its layout in *lay. */
static inline uint64_t write_padded(uint8_t *buf, uint64_t cap, uint32_t layer, uint32_t count,
                             uint32_t block_rows, kt_bundle_layout *lay)
{
    enum { D = 64 };
    const int32_t prompt = 3 * (int64_t)count + 3 > 4000 ? 3 * (int32_t)count + 3 : 4000;
    kt_bundle_header h = test_header(1, D, KT_DTYPE_BF16, layer == 1 ? 5 : 0, prompt, "full");
    h.segment = 1;
    h.first_layer = layer;
    h.block_rows = block_rows;
    kt_bundle_list lists[2] = {{.count = count, .window = KT_BUNDLE_WINDOW_DENSE},
                               {.count = count / 3 + 1, .window = KT_BUNDLE_WINDOW_DENSE}};
    char err[KT_ERR_MAX];
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &h, lists, buf, cap, err) == 0, "%s", err);
    float *k = malloc(sizeof(float) * count * D), *v = malloc(sizeof(float) * count * D);
    int32_t *pos = malloc(sizeof(int32_t) * count);
    REQUIRE(k && v && pos, "out of memory");
    for (uint32_t hd = 0; hd < 2; hd++) {
        for (uint32_t e = 0; e < lists[hd].count; e++) {
            pos[e] = (int32_t)(3 * e);
            for (int d = 0; d < D; d++) {
                k[e * D + d] = (float)(layer * 100 + hd * 10) + (float)(e % 97) + (float)d * 0.5f;
                v[e * D + d] = -k[e * D + d];
            }
        }
        REQUIRE(kt_bundle_writer_put(
                    &w, 0, hd, &(kt_rows_in){lists[hd].count, pos, KT_DTYPE_F32, k, v}, err) == 0,
                "%s", err);
    }
    free(k);
    free(v);
    free(pos);
    uint64_t size = 0;
    REQUIRE(kt_bundle_writer_finish(&w, &size, err) == 0, "%s", err);
    REQUIRE(kt_bundle_layout_read(buf, size, lay, err) == 0 && lay->split && lay->size == size &&
                lay->block_rows == block_rows,
            "layout of a padded segment: %s", err);
    return size;
}

/* What a placement hook was asked and gave: mode 0 places K and V in buffers of its own (as a
 * decode node places them in KV blocks), 1 declines, -1 refuses. */
typedef struct place_log {
    int mode;
    int placed, parts;
    uint8_t *k[2], *v[2];
    uint64_t len[2];
    const uint8_t *part_k[2];
} place_log;

static inline int place_cb(void *arg, const kt_bundle_set *s, const kt_bundle_view *head, void **k,
                    void **v, char *err)
{
    place_log *p = arg;
    if (p->mode < 0) {
        snprintf(err, KT_ERR_MAX, "no blocks for part %u", s->n_parts);
        return -1;
    }
    if (p->mode > 0 || p->placed == 2)
        return 1;
    const int i = p->placed++;
    p->len[i] = head->n_rows * head->row_bytes;
    p->k[i] = malloc(p->len[i]);
    p->v[i] = malloc(p->len[i]);
    REQUIRE(p->k[i] && p->v[i] && head->k == NULL, "a head without rows, and room for them");
    *k = p->k[i];
    *v = p->v[i];
    return 0;
}

static inline int placed_part_cb(void *arg, const kt_bundle_set *s, uint32_t i, char *err)
{
    place_log *p = arg;
    if (i < 2)
        p->part_k[i] = s->parts[i].k;
    p->parts++;
    (void)err;
    return 0;
}

/* An empty set over parts[0, cap) whose placement and part hooks log into *pl (its mode set). */
static inline void placed_set(kt_bundle_set *set, kt_bundle_view *parts, uint32_t cap, place_log *pl)
{
    kt_bundle_set_init(set, parts, cap);
    set->on_place = place_cb;
    set->on_part = placed_part_cb;
    set->on_part_arg = pl;
}

/* Frees the set's parts and the places the hook gave. */
static inline void placed_set_free(kt_bundle_set *set, place_log *pl)
{
    kt_bundle_set_free(set);
    for (int i = 0; i < pl->placed; i++) {
        free(pl->k[i]);
        free(pl->v[i]);
    }
}

#endif /* KT_TRANSPORT_TEST_H */
