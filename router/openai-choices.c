/*
 * openai-choices.c - several choices and prompts in one OpenAI API request (openai-choices.h):
 * the request's generations built (seeds, ids, request ids), run on threads of their own with a
 * staggered start, best_of's candidates ranked, and the figures summed. A generation is a whole
 * rt_generate_run, as a gRPC client's request: it is placed, prefilled and decoded on its own
 * (docs/openai.md, "Several choices and prompts", says what that costs and what the prefix cache
 * saves). Not here: JSON (openai.c).
 */
#include "openai-choices.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int oa_fanout_init(oa_fanout *f, const oa_request *r, const char *request_id, void *ctx)
{
    memset(f, 0, sizeof *f);
    f->n = r->n;
    f->per_prompt = r->best_of;
    f->n_gens = r->n_prompts * r->best_of;
    f->gens = calloc((size_t)f->n_gens, sizeof *f->gens);
    if (!f->gens) return -1;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->code = GRPC_STATUS_OK;
    int rid_room = RT_REQUEST_ID_MAX - 3; /* ".K", K < OA_MAX_GENERATIONS */
    for (int k = 0; k < f->n_gens; k++) {
        oa_gen *g = &f->gens[k];
        g->fan = f;
        g->ctx = ctx;
        g->prompt = k / f->per_prompt;
        g->sample = k % f->per_prompt;
        g->index = g->prompt * f->n + g->sample;
        if (f->n_gens == 1) snprintf(g->request_id, sizeof g->request_id, "%s", request_id);
        else /* k < OA_MAX_GENERATIONS: the modulo only tells the compiler so */
            snprintf(g->request_id, sizeof g->request_id, "%.*s.%u", rid_room, request_id,
                     (unsigned)k % OA_MAX_GENERATIONS);
        g->prompt_ids = (Kvrelay__V1__TokenIds)KVRELAY__V1__TOKEN_IDS__INIT;
        g->prompt_ids.ids = r->ids ? r->ids + r->prompt_at[g->prompt] : NULL;
        g->prompt_ids.n_ids = r->prompt_at[g->prompt + 1] - r->prompt_at[g->prompt];
        g->sampling = r->sampling;
        if (g->sampling.seed_choice_case == KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED)
            g->sampling.seed += (uint64_t)g->sample; /* unsigned: wraps as documented */
        g->q = r->q;
        g->q.token_ids = &g->prompt_ids;
        g->q.sampling = &g->sampling;
        g->q.request_id = g->request_id;
        if (r->best_of > r->n) g->q.logprobs = 1; /* the candidates' scores */
        g->code = GRPC_STATUS_OK;
    }
    return 0;
}

void oa_fanout_free(oa_fanout *f)
{
    if (!f->gens) return;
    for (int k = 0; k < f->n_gens; k++) {
        free(f->gens[k].text);
        oa_lp_free(&f->gens[k].lp);
        cJSON_Delete(f->gens[k].lp_obj);
    }
    free(f->gens);
    f->gens = NULL;
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
}

int oa_fanout_cancelled(const oa_fanout *f)
{
    return atomic_load(&f->failed);
}

void oa_gen_begun(oa_gen *g)
{
    if (g->begun) return; /* read on g's own thread, the only writer */
    pthread_mutex_lock(&g->fan->mu);
    g->begun = 1;
    pthread_cond_broadcast(&g->fan->cv);
    pthread_mutex_unlock(&g->fan->mu);
}

/* What a generation's thread does: run it, then say it ended (and whether it failed first). */
typedef struct gen_job {
    oa_gen *g;
    void (*run)(oa_gen *g);
} gen_job;

static void gen_ended(oa_gen *g)
{
    oa_fanout *f = g->fan;
    pthread_mutex_lock(&f->mu);
    g->ended = 1;
    if (g->code != GRPC_STATUS_OK && f->code == GRPC_STATUS_OK) {
        f->code = g->code;
        f->st = g->st;
        atomic_store(&f->failed, 1);
    }
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void run_one(oa_gen *g, void (*run)(oa_gen *g))
{
    run(g);
    gen_ended(g);
}

static void *gen_main(void *arg)
{
    gen_job *j = arg;
    run_one(j->g, j->run);
    return NULL;
}

/* Starts generations [from, to) on threads of their own; one that cannot start fails. */
static void start_range(oa_fanout *f, gen_job *jobs, int from, int to, int step)
{
    for (int k = from; k < to; k += step) {
        oa_gen *g = &f->gens[k];
        g->threaded = !oa_fanout_cancelled(f) && pthread_create(&g->thread, NULL, gen_main, &jobs[k]) == 0;
        if (!g->threaded) {
            if (!oa_fanout_cancelled(f))
                kc_status_set(&g->st, GRPC_STATUS_UNAVAILABLE, "the router cannot start a thread for a choice");
            else kc_status_set(&g->st, GRPC_STATUS_CANCELLED, "another choice of the request failed");
            g->code = g->st.code;
            gen_ended(g);
        }
    }
}

void oa_fanout_run(oa_fanout *f, void (*run)(oa_gen *g))
{
    if (f->n_gens == 1) {
        run_one(&f->gens[0], run);
        return;
    }
    gen_job *jobs = calloc((size_t)f->n_gens, sizeof *jobs);
    if (!jobs) {
        kc_status_set(&f->st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        f->code = f->st.code;
        return;
    }
    for (int k = 0; k < f->n_gens; k++) jobs[k] = (gen_job){&f->gens[k], run};
    /* every prompt's first sample, then the rest once each has its first token */
    start_range(f, jobs, 0, f->n_gens, f->per_prompt);
    pthread_mutex_lock(&f->mu);
    for (int k = 0; k < f->n_gens; k += f->per_prompt)
        while (!f->gens[k].begun && !f->gens[k].ended && !oa_fanout_cancelled(f)) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    for (int p = 0; p < f->n_gens; p += f->per_prompt) start_range(f, jobs, p + 1, p + f->per_prompt, 1);
    for (int k = 0; k < f->n_gens; k++)
        if (f->gens[k].threaded) pthread_join(f->gens[k].thread, NULL);
    free(jobs);
}

int oa_gen_add_text(oa_gen *g, const char *text)
{
    size_t n = strlen(text);
    if (g->text_len + n + 1 > g->text_cap) {
        size_t cap = (g->text_len + n + 1) * 2;
        char *grown = realloc(g->text, cap);
        if (!grown) return -1;
        g->text = grown;
        g->text_cap = cap;
    }
    memcpy(g->text + g->text_len, text, n + 1);
    g->text_len += n;
    return 0;
}

void oa_gen_add_logprobs(oa_gen *g, const Kvrelay__V1__TokenDelta *d)
{
    for (size_t i = 0; i < d->n_logprobs; i++) g->logprob_sum += d->logprobs[i];
    g->n_logprobs += d->n_logprobs;
}

void oa_gen_finish(oa_gen *g, const Kvrelay__V1__Finish *fin)
{
    g->finished = 1;
    g->reason = fin->reason;
    const Kvrelay__V1__Usage *u = fin->usage;
    if (!u) return;
    g->fig.usage = *u;
    g->fig.usage.served_by = NULL;
    g->fig.usage.kv_wire_dtype = NULL;
    g->fig.usage.base.unknown_fields = NULL;
    g->fig.usage.base.n_unknown_fields = 0;
    snprintf(g->fig.wire_dtype, sizeof g->fig.wire_dtype, "%s", u->kv_wire_dtype ? u->kv_wire_dtype : "");
    snprintf(g->fig.auto_policy, sizeof g->fig.auto_policy, "%s", u->auto_policy ? u->auto_policy : "");
    snprintf(g->fig.auto_pressure, sizeof g->fig.auto_pressure, "%s", u->auto_pressure ? u->auto_pressure : "");
    snprintf(g->fig.auto_reason, sizeof g->fig.auto_reason, "%s", u->auto_reason ? u->auto_reason : "");
    g->fig.usage.auto_policy = g->fig.usage.auto_pressure = g->fig.usage.auto_reason = NULL;
    if (u->served_by) {
        snprintf(g->fig.prefill_node, sizeof g->fig.prefill_node, "%s", u->served_by->prefill_node);
        snprintf(g->fig.decode_node, sizeof g->fig.decode_node, "%s", u->served_by->decode_node);
    }
}

/* A candidate's score: the mean log-probability of its tokens (NaN-free: none scores -inf). */
static double score(const oa_gen *g)
{
    return g->n_logprobs ? g->logprob_sum / (double)g->n_logprobs : -INFINITY;
}

void oa_fanout_rank(oa_fanout *f)
{
    if (f->per_prompt == f->n) return; /* every sample is a choice, in sample order */
    for (int p = 0; p < f->n_gens; p += f->per_prompt) {
        oa_gen *c = &f->gens[p];
        for (int s = 0; s < f->per_prompt; s++) { /* rank = how many candidates beat this one */
            int rank = 0;
            for (int o = 0; o < f->per_prompt; o++)
                if (score(&c[o]) > score(&c[s]) || (score(&c[o]) == score(&c[s]) && o < s)) rank++;
            c[s].index = rank < f->n ? c[s].prompt * f->n + rank : -1;
        }
    }
}

const oa_gen *oa_fanout_choice(const oa_fanout *f, int i)
{
    for (int k = 0; k < f->n_gens; k++)
        if (f->gens[k].index == i) return &f->gens[k];
    return NULL;
}

void oa_fanout_total(const oa_fanout *f, oa_figures *out)
{
    const oa_gen *first = oa_fanout_choice(f, 0);
    *out = first ? first->fig : f->gens[0].fig; /* the nodes and dtype of choice 0 */
    Kvrelay__V1__Usage *t = &out->usage;
    t->prompt_tokens = t->completion_tokens = t->cached_tokens = 0;
    t->kv_bytes_shipped = t->kv_entries_shipped = t->peak_kv_entries = 0;
    t->kv_footprint = t->tpot_s = t->ttft_s = t->queue_s = 0.0;
    for (int k = 0; k < f->n_gens; k++) {
        const Kvrelay__V1__Usage *u = &f->gens[k].fig.usage;
        if (f->gens[k].sample == 0) {
            t->prompt_tokens += u->prompt_tokens;
            t->cached_tokens += u->cached_tokens;
        }
        t->completion_tokens += u->completion_tokens;
        t->kv_bytes_shipped += u->kv_bytes_shipped;
        t->kv_entries_shipped += u->kv_entries_shipped;
        if (u->peak_kv_entries > t->peak_kv_entries) t->peak_kv_entries = u->peak_kv_entries;
        if (u->ttft_s > t->ttft_s) t->ttft_s = u->ttft_s;
        if (u->queue_s > t->queue_s) t->queue_s = u->queue_s;
        t->kv_footprint += u->kv_footprint / f->n_gens;
        t->tpot_s += u->tpot_s / f->n_gens;
    }
}
