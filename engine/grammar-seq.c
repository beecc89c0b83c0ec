/*
 * grammar-seq.c - structured output as a serving node applies it to one sequence (kr-grammar.h,
 * "serving"): the response_format compiled, a matcher brought up to the completion so far (a
 * migration re-prefills tokens an earlier node drew), each step's logits masked within the
 * tokens the sequence may still take, the drawn token accepted, and whether the document is
 * finished. The prefill node uses it for the first token, the decode node for every later one.
 * Not here: the automaton (grammar-match.c) and the mask (grammar-mask.c).
 */
#include <stdlib.h>
#include <string.h>

#include "kr-grammar.h"
#include "kr-util.h"

struct kr_grammar_seq {
    kr_grammar *g;
    kr_matcher *m;
    uint32_t *mask; /* [(n_vocab + 31) / 32] */
};

int kr_grammar_vocab_load(const char *model_dir, int32_t end_id, kr_grammar_vocab **out, char *err)
{
    kr_tokenizer *t;
    if (kr_tokenizer_load(model_dir, &t, err) != KR_OK) return -1;
    int rc = kr_grammar_vocab_create(t, end_id >= 0 ? &end_id : NULL, end_id >= 0, out, err);
    kr_tokenizer_free(t);
    return rc;
}

void kr_grammar_seq_free(kr_grammar_seq *s)
{
    if (!s) return;
    kr_matcher_free(s->m);
    kr_grammar_free(s->g);
    free(s->mask);
    free(s);
}

int kr_grammar_seq_create(const kr_grammar_vocab *v, const char *response_format, size_t len, const int32_t *before,
                          size_t n_before, kr_grammar_seq **out, char *err)
{
    *out = NULL;
    kr_grammar *g;
    if (kr_grammar_compile(response_format, len, NULL, &g, err) != 0) return -1;
    if (!g) return 0; /* {"type": "text"} */
    kr_grammar_seq *s = calloc(1, sizeof *s);
    if (!s) {
        kr_grammar_free(g);
        return kr_errf(err, "grammar: out of memory");
    }
    s->g = g;
    s->mask = malloc(((size_t)kr_grammar_vocab_n(v) + 31) / 32 * sizeof *s->mask);
    if (!s->mask) {
        kr_grammar_seq_free(s);
        return kr_errf(err, "grammar: out of memory");
    }
    if (kr_matcher_create(g, &s->m, err) != 0) {
        kr_grammar_seq_free(s);
        return -1;
    }
    for (size_t i = 0; i < n_before; i++)
        if (kr_matcher_accept_token(s->m, v, before[i]) != 0) {
            kr_grammar_seq_free(s);
            return kr_errf(err, "the completion's token %zu (id %d) is not valid for the schema", i, (int)before[i]);
        }
    *out = s;
    return 0;
}

int kr_grammar_seq_mask_logits(kr_grammar_seq *s, const kr_grammar_vocab *v, kr_grammar_scratch *scratch,
                               int64_t budget, float *logits, int n_logits)
{
    int allowed = kr_grammar_mask_budget(v, s->m, scratch, budget, s->mask);
    kr_grammar_mask_logits(s->mask, v, logits, n_logits);
    return allowed;
}

int kr_grammar_seq_accept(kr_grammar_seq *s, const kr_grammar_vocab *v, int32_t id)
{
    return kr_matcher_accept_token(s->m, v, id);
}

int kr_grammar_seq_done(const kr_grammar_seq *s)
{
    return kr_matcher_ended(s->m) || kr_matcher_closed(s->m);
}
