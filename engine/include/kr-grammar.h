/*
 * kr-grammar.h - structured output: a JSON Schema subset (or OpenAI's `response_format`)
 * compiled to a matcher over the bytes of the answer, and the token mask that keeps a decoder
 * on documents the schema accepts. Part of kr_engine, beside kr.h (same conventions: 0 / -1
 * with a message in `err`, outputs last, `*_free` accepts NULL).
 *
 * What it is not: a full JSON Schema validator. The subset (type, properties, required,
 * additionalProperties, enum, const, items, minItems/maxItems, minLength/maxLength, nesting)
 * and the limits are in docs/structured-output.md; anything else is refused at compile time
 * with a message naming the keyword and where it is.
 *
 * Threads: a kr_grammar and a kr_grammar_vocab are immutable once made and may be shared; a
 * kr_matcher belongs to one sequence and a kr_grammar_scratch to one thread at a time.
 *
 * Use, per sequence and decode step:
 *     kr_grammar_mask(vocab, matcher, scratch, allowed);     // bit per token id
 *     kr_grammar_mask_logits(allowed, vocab, logits, n_logits);
 *     id = sample(logits);
 *     kr_matcher_accept_token(matcher, vocab, id);          // advance by the token's bytes
 */
#ifndef KR_GRAMMAR_H
#define KR_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "kr.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bounds that make every document finite in its parts (docs/structured-output.md). Zero
 * fields take the defaults below; kr_grammar_compile's `limits` may be NULL. */
typedef struct kr_grammar_limits {
    int max_ws; /* whitespace bytes in a row anywhere in the document; default 32 */
    int max_string; /* characters of a string that has no maxLength; default 2048 */
    int max_int_digits; /* digits before a number's point; default 16 */
    int max_frac_digits; /* digits after it; default 16 */
    int max_exp_digits; /* exponent digits; default 2 */
    int max_depth; /* nested arrays and objects; default 32, at most KR_GRAMMAR_MAX_DEPTH */
} kr_grammar_limits;

#define KR_GRAMMAR_MAX_DEPTH 60

/* A compiled schema. */
typedef struct kr_grammar kr_grammar;

/* Compiles an OpenAI `response_format` object (its JSON text, `len` bytes):
 * {"type":"text"} gives *out = NULL (no constraint), {"type":"json_object"} any JSON object,
 * {"type":"json_schema","json_schema":{"name":..,"schema":{..},"strict":..,"description":..}}
 * the schema. Errors name the field or keyword and its place, e.g.
 * `response_format.json_schema.schema.properties.a: keyword "pattern" is not supported ...`. */
int kr_grammar_compile(const char *response_format, size_t len, const kr_grammar_limits *limits,
                       kr_grammar **out, char *err);
/* Compiles a bare JSON Schema (its JSON text); error places start with "schema". */
int kr_grammar_compile_schema(const char *schema, size_t len, const kr_grammar_limits *limits,
                              kr_grammar **out, char *err);
void kr_grammar_free(kr_grammar *g);

/* ------------------------------------------------------------------ matcher */

/* Where a sequence is in its document: a stack of states over the JSON grammar restricted by
 * the schema. Every state it reaches can still be completed to a document that parses and
 * validates; a byte that would leave that set is refused and makes the matcher dead. */
typedef struct kr_matcher kr_matcher;

/* A matcher at the start of a document. It keeps a pointer to `g`, which must outlive it. */
int kr_matcher_create(const kr_grammar *g, kr_matcher **out, char *err);
void kr_matcher_free(kr_matcher *m);
/* dst becomes a copy of src (both made from the same grammar). Cheap: a few dozen bytes per
 * level of nesting. */
void kr_matcher_copy(kr_matcher *dst, const kr_matcher *src);
/* Back to the start of a document. */
void kr_matcher_reset(kr_matcher *m);
/* Feeds one byte: 0 when accepted, -1 when refused (the matcher is then dead). */
int kr_matcher_feed(kr_matcher *m, uint8_t byte);
/* Feeds n bytes, stopping at the first refused one (-1, dead). */
int kr_matcher_feed_bytes(kr_matcher *m, const char *bytes, size_t n);
/* 1 when the bytes so far are a whole document (trailing whitespace included): an end of
 * sequence is allowed here. */
int kr_matcher_can_end(const kr_matcher *m);
/* The fewest bytes that complete the document from here (0 when it may end), for a decoder
 * that must finish within a budget; saturates at UINT32_MAX / 2. */
uint32_t kr_matcher_remaining(const kr_matcher *m);
/* 1 when the document's value is finished: nothing but whitespace and the end may follow
 * (a top-level number or literal that could still grow is not closed). A decoder may end the
 * sequence here. */
int kr_matcher_closed(const kr_matcher *m);
/* 1 after a refused byte or token. */
int kr_matcher_dead(const kr_matcher *m);
/* 1 after an end token was accepted (kr_matcher_accept_token). */
int kr_matcher_ended(const kr_matcher *m);

/* ------------------------------------------------------------------ token mask */

/* A tokenizer's vocabulary as the mask needs it: each token's bytes in a trie, and which ids
 * end a sequence. Made once per tokenizer; it copies what it needs (the tokenizer may be freed
 * after). Special tokens other than the end ids, and tokens that decode to no bytes, are never
 * allowed. `end_ids` (n_end of them) are the ids that stop the sequence (the tokenizer's EOS
 * and the model's other stop ids); NULL / 0 takes kr_tokenizer_eos. */
typedef struct kr_grammar_vocab kr_grammar_vocab;
int kr_grammar_vocab_create(const kr_tokenizer *t, const int32_t *end_ids, int n_end,
                            kr_grammar_vocab **out, char *err);
void kr_grammar_vocab_free(kr_grammar_vocab *v);
/* Ids the mask covers: the tokenizer's n_vocab. A mask is (n_vocab + 31) / 32 uint32 words,
 * bit (id % 32) of word (id / 32) set when the token is allowed. */
int kr_grammar_vocab_n(const kr_grammar_vocab *v);

/* Working memory of kr_grammar_mask, sized for one vocabulary; one per thread. */
typedef struct kr_grammar_scratch kr_grammar_scratch;
int kr_grammar_scratch_create(const kr_grammar_vocab *v, kr_grammar_scratch **out, char *err);
void kr_grammar_scratch_free(kr_grammar_scratch *s);

/* The tokens allowed after m's bytes: a token is allowed when the matcher accepts all of its
 * bytes, an end id when kr_matcher_can_end. Writes the whole mask; returns how many ids are
 * allowed: 0 for a dead or ended matcher, otherwise 0 only with a vocabulary that cannot spell
 * single bytes (byte-level BPE and byte-fallback vocabularies can). Allocates nothing. */
int kr_grammar_mask(const kr_grammar_vocab *v, const kr_matcher *m, kr_grammar_scratch *s,
                    uint32_t *allowed);
/* kr_grammar_mask for a sequence that may take at most `budget` more tokens, this one
 * included: a token is allowed only when the document can still be finished after it within
 * budget - 1 tokens of one byte each (kr_matcher_remaining), so a sequence whose budget covered
 * the remaining bytes when it started always finishes its document. Where the budget is short
 * already, only tokens that bring the end closer are allowed; where that leaves none (a
 * vocabulary that cannot spell single bytes), the plain mask. budget < 1: the plain mask. */
int kr_grammar_mask_budget(const kr_grammar_vocab *v, const kr_matcher *m, kr_grammar_scratch *s,
                           int64_t budget, uint32_t *allowed);
/* Sets logits[id] = -INFINITY for each id the mask does not allow, and for ids at and past
 * the vocabulary's n (a model's padding rows); n_logits is the row's length. */
void kr_grammar_mask_logits(const uint32_t *allowed, const kr_grammar_vocab *v, float *logits,
                            int n_logits);
/* Advances m by token `id`: its bytes, or for an end id the end of the document. 0 when
 * accepted; -1 when refused (an id the mask would not allow: m is then dead). */
int kr_matcher_accept_token(kr_matcher *m, const kr_grammar_vocab *v, int32_t id);

/* ------------------------------------------------------------------ serving */

/* The vocabulary of DIR/tokenizer.json with `end_id` as its only end id (the id the serving
 * nodes stop a sequence at; -1: the tokenizer's EOS). Fails where the model has no tokenizer. */
int kr_grammar_vocab_load(const char *model_dir, int32_t end_id, kr_grammar_vocab **out, char *err);

/* One sequence's structured output: its grammar, its matcher and a mask. */
typedef struct kr_grammar_seq kr_grammar_seq;
/* Compiles response_format (as kr_grammar_compile; {"type": "text"} gives *out = NULL) and
 * feeds the matcher the `before` tokens of the completion written already; a token the schema
 * refuses fails, naming its index. */
int kr_grammar_seq_create(const kr_grammar_vocab *v, const char *response_format, size_t len,
                          const int32_t *before, size_t n_before, kr_grammar_seq **out, char *err);
void kr_grammar_seq_free(kr_grammar_seq *s);
/* Sets the logits of the tokens the next draw may not take to -INFINITY
 * (kr_grammar_mask_budget with `budget` tokens left, this one included, then
 * kr_grammar_mask_logits). Returns how many ids are allowed. */
int kr_grammar_seq_mask_logits(kr_grammar_seq *s, const kr_grammar_vocab *v,
                               kr_grammar_scratch *scratch, int64_t budget, float *logits,
                               int n_logits);
/* Advances by the drawn token: 0, or -1 when the schema refuses it. */
int kr_grammar_seq_accept(kr_grammar_seq *s, const kr_grammar_vocab *v, int32_t id);
/* 1 when the document is finished (closed, or an end id accepted): the sequence ends. */
int kr_grammar_seq_done(const kr_grammar_seq *s);

#ifdef __cplusplus
}
#endif

#endif /* KR_GRAMMAR_H */
