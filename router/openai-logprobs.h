/*
 * openai-logprobs.h - log-probabilities and echo in the OpenAI API's shapes
 * (router/openai-logprobs.c): the completions' {tokens, token_logprobs, top_logprobs,
 * text_offset} and the chat's {content: [{token, logprob, bytes, top_logprobs}]}, built from the
 * TokenDelta fields of the generation path (logprobs, top_logprobs, prompt_logprobs,
 * prompt_top_logprobs), one oa_lp per choice so that several choices each keep their own offsets.
 * Pure: no network, no router state. Test: tests/integration/openai_logprobs.sh.
 */
#ifndef RT_OPENAI_LOGPROBS_H
#define RT_OPENAI_LOGPROBS_H

#include "openai.h"

#include <cjson/cJSON.h>

/* One choice's rendering state. */
typedef struct oa_lp {
    oa_kind kind;
    const kr_tokenizer *tok;
    int keep_special;
    char *echo;          /* the prompt's text when echoed (malloc'd), else NULL */
    size_t echo_len;
    size_t *prompt_off;  /* [n_prompt] with echo: each prompt token's byte offset in echo */
    size_t n_prompt;
    int prompt_done;     /* the prompt's tokens are in the logprobs (the first delta's scores) */
    kr_detok *detok;     /* the completion's ids as the relay detokenizes them, for text_offset */
    size_t offset;       /* bytes of the choice's text (echo included) before the next token */
} oa_lp;

/* Sets s up for a choice of request r whose prompt is `prompt` (echoed when r->echo; tok may be
 * NULL only when neither echo nor logprobs is asked). Returns 0, or -1 with err (out of memory,
 * a prompt the tokenizer cannot decode). s is freed with oa_lp_free whatever this returns. */
int oa_lp_init(oa_lp *s, const oa_request *r, const Kvrelay__V1__TokenIds *prompt, const kr_tokenizer *tok,
               char *err);
void oa_lp_free(oa_lp *s);
/* A new, empty logprobs object of s's kind. */
cJSON *oa_lp_object(const oa_lp *s);
/* Appends to obj (oa_lp_object's) the prompt's tokens when d carries the prompt's scores (the
 * first token's log-probability and alternatives null), then d's own ids with theirs. Returns 0,
 * or -1 out of memory. */
int oa_lp_add(oa_lp *s, cJSON *obj, const uint32_t *prompt, const Kvrelay__V1__TokenDelta *d);

#endif /* RT_OPENAI_LOGPROBS_H */
