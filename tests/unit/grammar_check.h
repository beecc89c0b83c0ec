/*
 * grammar_check.h - an independent validator of JSON values against the JSON Schema subset of
 * kr-grammar.h, written from the JSON Schema text (draft 2020-12 semantics of those keywords)
 * and not from the grammar's compiled form, for test_grammar.c and fuzz_schema.c to check what
 * the matcher lets through. Also rejects a named key (in properties or required) written twice
 * in one object, which the matcher promises never to do (additional keys may repeat).
 */
#ifndef GRAMMAR_CHECK_H
#define GRAMMAR_CHECK_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Code points of a UTF-8 string. */
static inline size_t gc_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static inline int gc_type_is(const char *t, const cJSON *v)
{
    if (!strcmp(t, "null")) return cJSON_IsNull(v);
    if (!strcmp(t, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(t, "number")) return cJSON_IsNumber(v);
    if (!strcmp(t, "integer")) return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(t, "string")) return cJSON_IsString(v);
    if (!strcmp(t, "array")) return cJSON_IsArray(v);
    if (!strcmp(t, "object")) return cJSON_IsObject(v);
    return 0;
}

/* 1 when v is valid against schema s; otherwise 0 with the reason in why (256 bytes). */
static inline int gc_valid(const cJSON *s, const cJSON *v, char *why)
{
    if (cJSON_IsTrue(s)) return 1;
    if (!cJSON_IsObject(s)) { snprintf(why, 256, "schema is not an object"); return 0; }
    const cJSON *k;
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "type"))) {
        int ok = 0;
        if (cJSON_IsString(k)) ok = gc_type_is(k->valuestring, v);
        const cJSON *e;
        if (cJSON_IsArray(k)) cJSON_ArrayForEach(e, k) ok |= gc_type_is(e->valuestring, v);
        if (!ok) { snprintf(why, 256, "type"); return 0; }
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "const")) && !cJSON_Compare(k, v, 1)) {
        snprintf(why, 256, "const");
        return 0;
    }
    if ((k = cJSON_GetObjectItemCaseSensitive(s, "enum"))) {
        int ok = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, k) ok |= cJSON_Compare(e, v, 1);
        if (!ok) { snprintf(why, 256, "enum"); return 0; }
    }
    if (cJSON_IsString(v)) {
        size_t n = gc_chars(v->valuestring);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minLength")) && n < (size_t)k->valuedouble) {
            snprintf(why, 256, "minLength %g > %zu", k->valuedouble, n);
            return 0;
        }
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxLength")) && n > (size_t)k->valuedouble) {
            snprintf(why, 256, "maxLength %g < %zu", k->valuedouble, n);
            return 0;
        }
    }
    if (cJSON_IsArray(v)) {
        int n = cJSON_GetArraySize(v);
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "minItems")) && n < k->valuedouble) {
            snprintf(why, 256, "minItems");
            return 0;
        }
        if ((k = cJSON_GetObjectItemCaseSensitive(s, "maxItems")) && n > k->valuedouble) {
            snprintf(why, 256, "maxItems");
            return 0;
        }
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items"), *e;
        if (items) cJSON_ArrayForEach(e, v) if (!gc_valid(items, e, why)) return 0;
    }
    if (cJSON_IsObject(v)) {
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
        const cJSON *add = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
        const cJSON *e, *r;
        const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
        cJSON_ArrayForEach(e, v) {
            const cJSON *p = props ? cJSON_GetObjectItemCaseSensitive(props, e->string) : NULL;
            int named = p != NULL;
            cJSON_ArrayForEach(r, req) named |= !strcmp(r->valuestring, e->string);
            for (const cJSON *o = v->child; named && o != e; o = o->next)
                if (!strcmp(o->string, e->string)) { snprintf(why, 256, "key \"%.40s\" twice", e->string); return 0; }
            if (p) {
                if (!gc_valid(p, e, why)) return 0;
            } else if (cJSON_IsFalse(add)) {
                snprintf(why, 256, "additional key \"%.40s\"", e->string);
                return 0;
            } else if (add && !cJSON_IsTrue(add) && !gc_valid(add, e, why)) {
                return 0;
            }
        }
        cJSON_ArrayForEach(r, req) {
            if (!cJSON_GetObjectItemCaseSensitive(v, r->valuestring)) {
                snprintf(why, 256, "required \"%.40s\" missing", r->valuestring);
                return 0;
            }
        }
    }
    return 1;
}

#endif /* GRAMMAR_CHECK_H */
