/*
 * test_dn_job_bundle.c - a Decode call's job keeps nothing that points into its reservation's
 * bundle parts, which are freed when the job joins the batch (loop.c): after the Decode
 * handler's checks (service.c) hand the job over and the parts are freed, no word of the job
 * holds the address of the freed buffer.
 * How: the decode node's sources are compiled into this test; a READY reservation is built by
 * hand with a bundle header and an RMA region (the buffer a prefill node puts parts into), and
 * a model config with no layers, so that the checks read only the header. No model, transport
 * or gRPC.
 * Run: ctest -R test_dn_job_bundle (under a second).
 */
#include "kr_test.h"

#include "../../decode-node/import.c"
#include "../../decode-node/loop.c"
#include "../../decode-node/resv.c"
#include "../../decode-node/service.c"

enum { CAP = 4, REGION = 1 << 16 };

int main(void)
{
    char err[KR_ERR_MAX];
    kc_log_init("decode", KC_LOG_WARN);
    static kr_config mcfg = {.vocab_size = 32, .n_layers = 0, .n_kv_heads = 1, .head_dim = 8,
                             .max_position_embeddings = 64};
    static dn_node node;
    dn_node *n = &node;
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->cond, NULL);
    n->cfg.id = "decode-test";
    n->mcfg = &mcfg;
    REQUIRE(kr_kv_pool_create(mcfg.head_dim, 4, 16, KR_DTYPE_F32, &n->pool, err) == KR_OK,
            "kr_kv_pool_create: %s", err);
    n->total_blocks = 16;

    dn_resv *r = calloc(1, sizeof *r);
    REQUIRE(r && (r->parts = calloc(CAP, sizeof *r->parts)), "out of memory");
    kt_bundle_set_init(&r->set, r->parts, CAP);
    char *region = kt_partbuf_alloc(REGION);
    REQUIRE(region, "kt_partbuf_alloc");
    r->set.region = region;
    r->set.hdr.prompt_len = 4;
    r->set.hdr.first_token = 7;
    r->set.hdr.next_pos = 4;
    r->set.complete = 1;
    r->id = 21;
    r->node = n;
    r->state = DN_RESV_DECODING; /* claimed */
    r->prompt_tokens = 4;
    r->max_tokens = 8;
    r->max_list_entries = 4;
    r->blocks = r->blocks_bound = 4;

    dn_job *job = calloc(1, sizeof *job);
    REQUIRE(job, "out of memory");
    job->resv = r;
    REQUIRE(check_bundle(NULL, n, r, job, "req-21") == GRPC_STATUS_OK, "the bundle passes");
    kt_bundle_set_free(&r->set); /* as the loop does when the job joins the batch */

    const uintptr_t lo = (uintptr_t)region, hi = lo + REGION;
    const unsigned char *bytes = (const unsigned char *)job;
    int dangling = 0;
    for (size_t off = 0; off + sizeof(uintptr_t) <= sizeof *job; off += sizeof(void *)) {
        uintptr_t w;
        memcpy(&w, bytes + off, sizeof w);
        if (w >= lo && w < hi) {
            fprintf(stderr, "the job's byte %zu holds %p, inside the freed parts' buffer\n", off,
                    (void *)w);
            dangling++;
        }
    }
    CHECK(dangling == 0, "%d words of the job point into freed bundle parts", dangling);

    dn_job_free(job);
    free(r->parts);
    free(r);
    kr_kv_pool_free(n->pool);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    return kt_failures ? 1 : 0;
}
