/*
 * openai-logprobs.c - log-probabilities and echo in the OpenAI API's shapes (openai-logprobs.h).
 * Values are TokenDelta's float32 log-probabilities as they came from the nodes, written as
 * JSON numbers (cJSON prints a double with up to 17 significant digits, so the value read back
 * as float32 is the node's bit for bit). A token's text is what it spells
 * (kr_tokenizer_token_bytes); bytes that are not valid UTF-8 are written "bytes:\xNN...", as
 * OpenAI's API writes them; chat entries carry the bytes too. text_offset counts bytes of the
 * choice's text: the echoed prompt (its ids detokenized as the completion's are), then the
 * completion as the relay detokenizes it.
 * Not here: what is asked (openai-request.c) nor the documents around it (openai.c).
 */
#include "openai-logprobs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 1 when b[0, n) is valid UTF-8 (no overlongs, surrogates or code points past U+10FFFF). */
static int spells_utf8(const unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = b[i];
        size_t k = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : 9;
        if (k == 9 || i + k >= n) return 0; /* a bad lead byte, or a character cut short */
        unsigned cp = k == 0 ? c : c & (0x3F >> k);
        for (size_t j = 1; j <= k; j++) {
            if ((b[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (b[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

/* Token id's text (malloc'd, NUL-terminated) and its bytes (*bytes, *n: into the tokenizer). */
static char *token_text(const oa_lp *s, uint32_t id, const unsigned char **bytes, size_t *n)
{
    const char *b = NULL;
    size_t len = 0;
    if (kr_tokenizer_token_bytes(s->tok, (int32_t)id, &b, &len) != 0) {
        b = "";
        len = 0;
    }
    *bytes = (const unsigned char *)b;
    *n = len;
    int ok = spells_utf8(*bytes, len) && !memchr(b, 0, len);
    char *out = malloc(ok ? len + 1 : 6 + 4 * len + 1);
    if (!out) return NULL;
    if (ok) {
        memcpy(out, b, len);
        out[len] = 0;
        return out;
    }
    size_t at = (size_t)sprintf(out, "bytes:");
    for (size_t i = 0; i < len; i++) at += (size_t)sprintf(out + at, "\\x%02x", (*bytes)[i]);
    return out;
}

static cJSON *bytes_array(const unsigned char *b, size_t n)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(b[i]));
    return a;
}

/* The chat's {token, logprob, bytes} of id (top_logprobs added by the caller), NULL out of memory. */
static cJSON *chat_entry(const oa_lp *s, uint32_t id, double lp)
{
    const unsigned char *b;
    size_t n;
    char *text = token_text(s, id, &b, &n);
    cJSON *e = text ? cJSON_CreateObject() : NULL;
    if (e) {
        cJSON_AddStringToObject(e, "token", text);
        if (lp != lp) cJSON_AddNullToObject(e, "logprob"); /* never from a finite row */
        else cJSON_AddNumberToObject(e, "logprob", lp);
        cJSON_AddItemToObject(e, "bytes", bytes_array(b, n));
    }
    free(text);
    return e;
}

/* One token into obj: its text, log-probability (has_lp 0: null, the prompt's first token) and
 * alternatives (NULL: none asked; null when !has_lp), at byte offset `off` of the choice's text. */
static int add_token(const oa_lp *s, cJSON *obj, uint32_t id, int has_lp, float lp, const Kvrelay__V1__TopLogprobs *alts,
                     size_t off)
{
    if (s->kind == OA_CHAT) {
        cJSON *e = chat_entry(s, id, (double)lp);
        cJSON *tops = e ? cJSON_AddArrayToObject(e, "top_logprobs") : NULL;
        size_t k = alts ? (alts->n_ids < alts->n_logprobs ? alts->n_ids : alts->n_logprobs) : 0;
        for (size_t i = 0; tops && i < k; i++) cJSON_AddItemToArray(tops, chat_entry(s, alts->ids[i], (double)alts->logprobs[i]));
        cJSON *content = cJSON_GetObjectItemCaseSensitive(obj, "content");
        if (!e || !content) {
            cJSON_Delete(e);
            return -1;
        }
        cJSON_AddItemToArray(content, e);
        return 0;
    }
    const unsigned char *b;
    size_t n;
    char *text = token_text(s, id, &b, &n);
    if (!text) return -1;
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(obj, "tokens"), cJSON_CreateString(text));
    free(text);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(obj, "token_logprobs"),
                         has_lp ? cJSON_CreateNumber((double)lp) : cJSON_CreateNull());
    cJSON *top = has_lp ? cJSON_CreateObject() : cJSON_CreateNull();
    size_t k = alts && has_lp ? (alts->n_ids < alts->n_logprobs ? alts->n_ids : alts->n_logprobs) : 0;
    for (size_t i = 0; top && i < k; i++) {
        const unsigned char *ab;
        size_t an;
        char *at = token_text(s, alts->ids[i], &ab, &an);
        if (at) cJSON_AddNumberToObject(top, at, (double)alts->logprobs[i]);
        free(at);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(obj, "top_logprobs"), top);
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(obj, "text_offset"), cJSON_CreateNumber((double)off));
    return 0;
}

int oa_lp_init(oa_lp *s, const oa_request *r, const Kvrelay__V1__TokenIds *prompt, const kr_tokenizer *tok,
               char *err)
{
    *s = (oa_lp){.kind = r->kind, .tok = tok, .keep_special = r->keep_special};
    if (!r->echo && r->logprobs < 0) return 0;
    if (!tok) return snprintf(err, KR_ERR_MAX, "the model has no tokenizer.json: echo and logprobs need token texts"), -1;
    if (kr_detok_create(tok, !r->keep_special, &s->detok, err) != KR_OK) return -1;
    if (!r->echo) return 0;
    /* the prompt detokenized as the completion is: each token's offset is the text before it */
    kr_detok *d;
    if (kr_detok_create(tok, !r->keep_special, &d, err) != KR_OK) return -1;
    size_t n = prompt->n_ids, cap = 64;
    s->prompt_off = malloc((n ? n : 1) * sizeof *s->prompt_off);
    s->echo = malloc(cap);
    s->n_prompt = n;
    int rc = s->prompt_off && s->echo ? 0 : -1;
    for (size_t i = 0; rc == 0 && i <= n; i++) {
        const char *delta;
        size_t dlen;
        if (i < n) {
            s->prompt_off[i] = s->echo_len;
            if (kr_detok_push(d, (int32_t)prompt->ids[i], &delta, &dlen, err) != KR_OK) rc = -1;
        } else {
            kr_detok_flush(d, &delta, &dlen);
        }
        if (rc == 0 && s->echo_len + dlen + 1 > cap) {
            while (s->echo_len + dlen + 1 > cap) cap *= 2;
            char *grown = realloc(s->echo, cap);
            if (grown) s->echo = grown;
            else rc = -1;
        }
        if (rc == 0) {
            memcpy(s->echo + s->echo_len, delta, dlen);
            s->echo_len += dlen;
        }
    }
    kr_detok_free(d);
    if (rc != 0) {
        if (!err[0]) snprintf(err, KR_ERR_MAX, "out of memory");
        return -1;
    }
    s->echo[s->echo_len] = 0;
    s->offset = s->echo_len;
    return 0;
}

void oa_lp_free(oa_lp *s)
{
    kr_detok_free(s->detok);
    free(s->echo);
    free(s->prompt_off);
    *s = (oa_lp){0};
}

cJSON *oa_lp_object(const oa_lp *s)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    if (s->kind == OA_CHAT) {
        if (!cJSON_AddArrayToObject(o, "content")) goto fail;
        return o;
    }
    if (!cJSON_AddArrayToObject(o, "tokens") || !cJSON_AddArrayToObject(o, "token_logprobs") ||
        !cJSON_AddArrayToObject(o, "top_logprobs") || !cJSON_AddArrayToObject(o, "text_offset"))
        goto fail;
    return o;
fail:
    cJSON_Delete(o);
    return NULL;
}

int oa_lp_add(oa_lp *s, cJSON *obj, const uint32_t *prompt, const Kvrelay__V1__TokenDelta *d)
{
    if (!obj) return -1;
    if (s->echo && !s->prompt_done && d->n_prompt_logprobs + 1 == s->n_prompt) { /* the prompt's own scores */
        s->prompt_done = 1;
        for (size_t i = 0; i < s->n_prompt; i++) {
            const Kvrelay__V1__TopLogprobs *alts = i && i - 1 < d->n_prompt_top_logprobs ? d->prompt_top_logprobs[i - 1] : NULL;
            if (add_token(s, obj, prompt[i], i > 0, i ? d->prompt_logprobs[i - 1] : 0.0f, alts, s->prompt_off[i]) != 0)
                return -1;
        }
    }
    size_t n = d->n_ids < d->n_logprobs ? d->n_ids : d->n_logprobs;
    for (size_t i = 0; i < n; i++) {
        const char *delta;
        size_t dlen = 0;
        char err[KR_ERR_MAX];
        size_t off = s->offset;
        if (s->detok && kr_detok_push(s->detok, (int32_t)d->ids[i], &delta, &dlen, err) == KR_OK) s->offset += dlen;
        const Kvrelay__V1__TopLogprobs *alts = i < d->n_top_logprobs ? d->top_logprobs[i] : NULL;
        if (add_token(s, obj, d->ids[i], 1, d->logprobs[i], alts, off) != 0) return -1;
    }
    return 0;
}
