/*
 * test_router_openai_oom.c - a non-streamed OpenAI request whose answer cannot be gathered (the
 * router runs out of memory keeping the text) ends as an internal error (INTERNAL: HTTP 500
 * "server_error", counted in kvrelay_requests_total as INTERNAL), not as a client that went away
 * (CANCELLED).
 * How: the router's request path (request.c, relay.c, openai.c and what they call) is compiled
 * into this test with openai.c's realloc routed through a wrapper that fails on demand; placement
 * and validation are stand-ins that give a one-token prompt and a first token, so no node runs.
 * Run: ctest -R test_router_openai_oom (under a second).
 */
#define _GNU_SOURCE /* openai.c's POLLRDHUP */
#include "kr_test.h"

#include <stdlib.h>

#include "../../router/adaptive.c"
#include "../../router/apikey.c"
#include "../../router/auto.c"
#include "../../router/breaker.c"
#include "../../router/client-limits.c"
#include "../../router/kv-index.c"
#include "../../router/nodes.c"
#include "../../router/placement.c"
#include "../../router/policy.c"
#include "../../router/relay.c"
#include "../../router/request.c"
#include "../../router/reserve.c"
#include "../../router/stop.c"
#include "../../router/watch.c"
/* its static refuse() is not client-limits.c's */
#define refuse oa_refuse
#include "../../router/openai-request.c"
#undef refuse
#include "../../router/openai-logprobs.c"

/* the allocations of the text openai.c gathers (openai-choices.c) fail while g_fail_realloc is set */
static int g_fail_realloc;
static void *test_realloc(void *p, size_t n)
{
    return g_fail_realloc ? NULL : realloc(p, n);
}
#define realloc test_realloc
#include "../../router/openai-choices.c"
#include "../../router/openai.c"
#undef realloc

static rt_node pnode = {.id = "prefill-0"}, dnode = {.id = "decode-0"};

/* validate.c's part: a one-token prompt, max_tokens 1 */
grpc_status_code rt_req_validate(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    (void)rt, (void)st;
    snprintf(r->id, sizeof r->id, "%s", q->request_id ? q->request_id : "req-oom");
    r->prompt = malloc(sizeof *r->prompt);
    if (!r->prompt) return GRPC_STATUS_RESOURCE_EXHAUSTED;
    r->prompt[0] = 1;
    r->n_prompt = 1;
    r->max_tokens = 1; /* the first token ends it: no decode stream */
    return GRPC_STATUS_OK;
}

/* admission.c's part: placed at once, the prefill's first token 5 */
grpc_status_code rt_place(rt_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st)
{
    (void)st;
    Kvrelay__V1__PrefillResponse *pr = malloc(sizeof *pr);
    if (!pr) return GRPC_STATUS_RESOURCE_EXHAUSTED;
    *pr = (Kvrelay__V1__PrefillResponse)KVRELAY__V1__PREFILL_RESPONSE__INIT;
    pr->first_token = 5;
    r->pnode = &pnode;
    r->dnode = &dnode;
    *out = pr;
    return GRPC_STATUS_OK;
}

void rt_request_id_new(rt_router *rt, char *out, size_t cap)
{
    (void)rt;
    snprintf(out, cap, "req-new");
}

int main(void)
{
    kc_log_init("router", KC_LOG_WARN);
    static rt_router rt;
    rt.cfg.vocab_size = 32;
    rt.cfg.eos_token_id = 2;
    rt.default_timeout_ms = 10000;
    pthread_mutex_init(&rt.mu, NULL);
    pthread_cond_init(&rt.cv, NULL);

    oa_call *c = calloc(1, sizeof *c);
    REQUIRE(c, "out of memory");
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->rt = &rt;
    c->fd = -1;
    c->req.kind = OA_COMPLETION;
    c->req.q = (Kvrelay__V1__GenerateRequest)KVRELAY__V1__GENERATE_REQUEST__INIT;
    c->req.q.request_id = "req-oom";
    c->req.n = c->req.best_of = c->req.n_prompts = 1;
    REQUIRE(oa_fanout_init(&c->fan, &c->req, "req-oom", c) == 0, "out of memory");
    oa_gen *g = &c->fan.gens[0];
    rt_sink s;
    g_fail_realloc = 1;
    c->code = rt_generate_run(&rt, &g->q, sink_for(g, &s), NULL, &c->st);
    g_fail_realloc = 0;
    CHECK(c->code == GRPC_STATUS_INTERNAL, "a failed allocation of the answer is %s (%s), not INTERNAL",
          kc_status_name(c->code), c->st.details);
    CHECK(!atomic_load(&c->gone), "the client did not go away");
    oa_status hs = status_of(c->code);
    CHECK(hs.http == 500 && !strcmp(hs.type, "server_error"), "HTTP %u %s", hs.http, hs.type);
    CHECK_ERR_HAS(c->st.details, "out of memory");

    /* the same request with memory: OK, the first token gathered */
    c->code = rt_generate_run(&rt, &g->q, sink_for(g, &s), NULL, &c->st);
    CHECK(c->code == GRPC_STATUS_OK, "%s: %s", kc_status_name(c->code), c->st.details);
    CHECK(g->finished, "the finish was kept");

    oa_fanout_free(&c->fan);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    return kt_failures ? 1 : 0;
}
