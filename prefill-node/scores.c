/*
 * scores.c - a prompt's log-probabilities on the prefill node (PrefillRequest.prompt_logprobs,
 * docs/rpc.md): the engine hands over the logits of every prompt row of the chunked prefill
 * (kr_prompt_span's score_fn), and row i becomes prompt token i+1's log-probability and the
 * row's top alternatives, with kr_logprob_top, the function that scores generated tokens.
 * Not here: the prefill itself (run.c) nor the answer (service.c).
 */
#include "prefill.h"

#include <stdlib.h>

int pf_scores_init(pf_scores *s, const int32_t *tokens, int n, int vocab, int k)
{
    *s = (pf_scores){.on = 1, .k = k, .n = n - 1, .vocab = vocab, .tokens = tokens};
    size_t rows = n > 1 ? (size_t)(n - 1) : 1, alts = rows * (size_t)(k > 0 ? k : 1);
    s->lps = malloc(rows * sizeof *s->lps);
    s->top_ids = malloc(alts * sizeof *s->top_ids);
    s->top_lps = malloc(alts * sizeof *s->top_lps);
    s->buf = malloc((size_t)KR_SCORE_ROWS * (size_t)vocab * sizeof *s->buf);
    return s->lps && s->top_ids && s->top_lps && s->buf ? 0 : -1;
}

int pf_scores_rows(void *arg, int first, int rows, const float *logits, char *err)
{
    (void)err;
    pf_scores *s = arg;
    for (int r = 0; r < rows; r++) {
        int at = first + r; /* row `at` predicts prompt token at + 1; the last row predicts none */
        if (at >= s->n) break;
        const size_t o = (size_t)at * (size_t)s->k;
        s->lps[at] = kr_logprob_top(logits + (size_t)r * (size_t)s->vocab, s->vocab, s->tokens[at + 1], NULL, s->k,
                                    s->top_ids + o, s->top_lps + o);
    }
    return KR_OK;
}

void pf_scores_free(pf_scores *s)
{
    free(s->lps);
    free(s->top_ids);
    free(s->top_lps);
    free(s->buf);
    *s = (pf_scores){0};
}

int pf_scores_message(const pf_scores *s, Kvrelay__V1__TopLogprobs **tops, Kvrelay__V1__TopLogprobs ***ptrs)
{
    *tops = NULL;
    *ptrs = NULL;
    if (!s->on || s->k == 0 || s->n == 0) return 0;
    *tops = malloc((size_t)s->n * sizeof **tops);
    *ptrs = malloc((size_t)s->n * sizeof **ptrs);
    if (!*tops || !*ptrs) {
        free(*tops);
        free(*ptrs);
        *tops = NULL;
        *ptrs = NULL;
        return -1;
    }
    for (int i = 0; i < s->n; i++) {
        Kvrelay__V1__TopLogprobs *t = &(*tops)[i];
        *t = (Kvrelay__V1__TopLogprobs)KVRELAY__V1__TOP_LOGPROBS__INIT;
        t->n_ids = t->n_logprobs = (size_t)s->k;
        t->ids = (uint32_t *)s->top_ids + (size_t)i * (size_t)s->k; /* ids of the vocabulary: the same bits */
        t->logprobs = s->top_lps + (size_t)i * (size_t)s->k;
        (*ptrs)[i] = t;
    }
    return 0;
}
