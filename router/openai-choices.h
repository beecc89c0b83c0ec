/*
 * openai-choices.h - the generations behind one OpenAI API request (router/openai-choices.c):
 * every prompt of a completions request times max(n, best_of) samples, each a GenerateRequest of
 * its own (the prompt's ids, seed + sample, its own request id) run through rt_generate_run on a
 * thread of its own; each keeps its choice's text, finish and figures. best_of keeps the n
 * candidates of each prompt with the highest mean log-probability per token. Not here: the HTTP
 * side and the JSON answers (openai.c), the request's parsing (openai-request.c).
 * docs/openai.md, "Several choices and prompts". Test: tests/integration/openai_choices.sh.
 */
#ifndef RT_OPENAI_CHOICES_H
#define RT_OPENAI_CHOICES_H

#include "router.h"
#include "adaptive.h"
#include "openai.h"
#include "openai-logprobs.h"

#include <pthread.h>
#include <stdatomic.h>

/* What a generation's Finish said (or a sum of them: oa_figures_total). */
typedef struct oa_figures {
    Kvrelay__V1__Usage usage; /* numbers only: its strings are the fields below */
    char prefill_node[64], decode_node[64];
    char wire_dtype[24];
    char auto_policy[RT_AUTO_SPEC_MAX], auto_pressure[16], auto_reason[200]; /* usage.auto_* (kv_policy auto) */
} oa_figures;

typedef struct oa_fanout oa_fanout;

/* One generation: one prompt, one sample of it. */
typedef struct oa_gen {
    oa_fanout *fan;
    void *ctx;   /* the HTTP call it belongs to (openai.c's) */
    int prompt;  /* which prompt of the request */
    int sample;  /* which sample of the prompt: seed + sample when the request has a seed */
    int index;   /* the choice's index in the answer (prompt-major: prompt * n + rank); -1: a
                    best_of candidate left out */
    char request_id[RT_REQUEST_ID_MAX + 1];
    Kvrelay__V1__GenerateRequest q; /* the request's, with the fields below */
    Kvrelay__V1__Sampling sampling;
    Kvrelay__V1__TokenIds prompt_ids; /* borrowed from the request */

    /* what came back; written by its own thread only */
    char *text; /* malloc'd; text_len bytes */
    size_t text_len, text_cap;
    int finished;
    Kvrelay__V1__FinishReason reason;
    oa_figures fig;
    double logprob_sum; /* of the completion's tokens (best_of's candidates) */
    uint64_t n_logprobs;
    int role_sent; /* a streamed chat's first chunk went out */
    oa_lp lp;      /* log-probabilities and echo (openai-logprobs.h) */
    cJSON *lp_obj; /* non-streamed with logprobs: the choice's logprobs object, filled per delta */
    int echo_sent; /* streamed: the echoed prompt went out with the first chunk */
    grpc_status_code code;
    kc_status st;
    int begun, ended; /* under fan->mu: a first event came / rt_generate_run returned */
    pthread_t thread;
    int threaded; /* thread runs it */
} oa_gen;

/* All generations of a request. */
struct oa_fanout {
    oa_gen *gens; /* n_gens, prompt-major: prompt p's sample s is gens[p * per_prompt + s] */
    int n_gens, per_prompt, n; /* per_prompt = max(n, best_of) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int failed;     /* one failed: the others are cancelled */
    grpc_status_code code; /* the first failure's (OK: none) */
    kc_status st;
};

/* Builds f's generations from the parsed request r (borrowed; it outlives f) for the call ctx,
 * with request ids derived from request_id (itself when there is one generation, "ID.K" for
 * the K-th otherwise, ID cut so that it fits). Returns 0, or -1 out of memory (f freed). */
int oa_fanout_init(oa_fanout *f, const oa_request *r, const char *request_id, void *ctx);
void oa_fanout_free(oa_fanout *f);
/* Runs every generation through run (which sets g->code and g->st) and waits for all. One
 * generation runs on the calling thread; several get a thread each: the first sample of every
 * prompt is started first, the others once its first event came (oa_gen_begun), so that the
 * prefill node's prefix cache holds the prompt's state when they are prefilled. The first
 * failure cancels the rest (oa_fanout_cancelled) and is f->code and f->st. */
void oa_fanout_run(oa_fanout *f, void (*run)(oa_gen *g));
/* 1 once a generation failed: the sinks of the others report themselves cancelled. */
int oa_fanout_cancelled(const oa_fanout *f);
/* The sinks' bookkeeping: a first event of g came (for oa_fanout_run's staggered start). */
void oa_gen_begun(oa_gen *g);
/* Appends a delta's text to g->text. 0, or -1 out of memory. */
int oa_gen_add_text(oa_gen *g, const char *text);
/* Keeps a delta's log-probabilities (summed, for best_of). */
void oa_gen_add_logprobs(oa_gen *g, const Kvrelay__V1__TokenDelta *d);
/* Keeps the finish: reason, usage, nodes. */
void oa_gen_finish(oa_gen *g, const Kvrelay__V1__Finish *fin);
/* After a successful run: numbers the choices. best_of > n keeps each prompt's n candidates
 * with the highest mean log-probability per token (ties: the lower sample), best first; the
 * others get index -1. */
void oa_fanout_rank(oa_fanout *f);
/* The generation whose choice has index i, or NULL. */
const oa_gen *oa_fanout_choice(const oa_fanout *f, int i);
/* The request's figures: OpenAI's usage summed (prompt tokens and cached tokens once per
 * prompt, completion tokens over every generation, best_of's candidates included), kvrelay's
 * shipped bytes and entries summed, peak entries, ttft and queue time the largest, footprint and
 * tpot averaged over the generations, the nodes of choice 0. */
void oa_fanout_total(const oa_fanout *f, oa_figures *out);

#endif /* RT_OPENAI_CHOICES_H */
