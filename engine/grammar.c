/*
 * grammar.c - compiles OpenAI's `response_format` or a JSON Schema (the subset of
 * kr-grammar.h) to the node table the matcher (grammar-match.c) walks. One node per schema
 * object, children by index; an enum / const node holds its values as compact JSON texts,
 * sorted, which the matcher reads byte by byte. What is not in the subset is refused with the
 * keyword and its place; contradictions that leave no valid document (minLength > maxLength,
 * an enum no value of which fits the other keywords, a required key that may not appear) are
 * refused too, so that every compiled grammar accepts some document.
 * Not here: the automaton (grammar-match.c) and the token mask (grammar-mask.c).
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "kr-util.h"

static const kr_grammar_limits default_limits = {
    .max_ws = 32, .max_string = 2048, .max_int_digits = 16, .max_frac_digits = 16, .max_exp_digits = 2,
    .max_depth = 32,
};

#define SUPPORTED "type, properties, required, additionalProperties, enum, const, items, minItems, " \
                  "maxItems, minLength, maxLength; ignored: title, description, $schema, $id, $comment, " \
                  "default, examples"

static const char *const keywords[] = {
    "type", "properties", "required", "additionalProperties", "enum", "const", "items", "minItems", "maxItems",
    "minLength", "maxLength", "title", "description", "$schema", "$id", "$comment", "default", "examples",
};

typedef struct cctx {
    kr_grammar *g;
    char *err;
    char path[224]; /* where the schema being compiled is, for messages */
    int any; /* the node of an unconstrained value */
} cctx;

/* ------------------------------------------------------------------ storage */

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap) return 0;
    int n = *cap ? *cap * 2 : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

static int add_text(kr_grammar *g, const char *s, size_t n, gr_str *out)
{
    if (g->n_text + n > UINT32_MAX) return -1;
    if (g->n_text + n > g->cap_text) {
        size_t cap = g->cap_text ? g->cap_text * 2 : 256;
        while (cap < g->n_text + n) cap *= 2;
        char *p = realloc(g->text, cap);
        if (!p) return -1;
        g->text = p;
        g->cap_text = cap;
    }
    memcpy(g->text + g->n_text, s, n);
    *out = (gr_str){(uint32_t)g->n_text, (uint32_t)n};
    g->n_text += n;
    return 0;
}

static int oom(cctx *c) { return kr_errf(c->err, "%s: out of memory", c->path); }

/* A node accepting any value, with the default bounds; its index, or -1. */
static int new_node(cctx *c)
{
    kr_grammar *g = c->g;
    if (g->n_nodes >= GR_MAX_NODES - 1) {
        kr_errf(c->err, "%s: the schema has more than %d subschemas", c->path, GR_MAX_NODES - 1);
        return -1;
    }
    if (grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof *g->nodes)) return oom(c);
    gr_node *n = &g->nodes[g->n_nodes];
    memset(n, 0, sizeof *n);
    n->types = GR_ALL;
    n->max_len = (uint32_t)g->lim.max_string;
    n->max_items = UINT32_MAX;
    n->items = c->any;
    n->additional = c->any;
    n->key_max = (uint32_t)g->lim.max_string;
    return g->n_nodes++;
}

/* A string's compact JSON form without the quotes (malloc'd), what a document spells. */
static char *encode_name(const char *s, size_t *len)
{
    cJSON *j = cJSON_CreateString(s);
    char *p = j ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    if (!p) return NULL;
    size_t n = strlen(p);
    memmove(p, p + 1, n - 2);
    p[n - 2] = 0;
    *len = n - 2;
    return p;
}

static int cmp_bytes(const char *a, size_t na, const char *b, size_t nb)
{
    int r = memcmp(a, b, na < nb ? na : nb);
    return r ? r : na < nb ? -1 : na > nb;
}

/* ------------------------------------------------------------------ validation of literals */

static size_t utf8_chars(const char *s)
{
    size_t n = 0;
    for (; *s; s++) n += ((uint8_t)*s & 0xC0) != 0x80;
    return n;
}

/* Does node accept value v? For enum values, which must also meet the node's other keywords. */
static int accepts(const kr_grammar *g, int node, const cJSON *v)
{
    const gr_node *n = &g->nodes[node];
    if (n->n_lits) {
        char *t = cJSON_PrintUnformatted(v);
        int ok = 0;
        for (uint32_t i = 0; t && i < n->n_lits && !ok; i++) {
            const gr_str *l = &g->lits[n->lits_off + i];
            ok = !cmp_bytes(g->text + l->off, l->len, t, strlen(t));
        }
        free(t);
        return ok;
    }
    if (cJSON_IsNull(v)) return (n->types & GR_NULL) != 0;
    if (cJSON_IsBool(v)) return (n->types & GR_BOOLEAN) != 0;
    if (cJSON_IsNumber(v)) {
        double d = v->valuedouble;
        int integral = d > -9.2e18 && d < 9.2e18 && d == (double)(long long)d;
        return (n->types & GR_NUMBER) || ((n->types & GR_INTEGER) && integral);
    }
    if (cJSON_IsString(v)) {
        size_t len = utf8_chars(v->valuestring);
        return (n->types & GR_STRING) && len >= n->min_len && len <= n->max_len;
    }
    if (cJSON_IsArray(v)) {
        if (!(n->types & GR_ARRAY)) return 0;
        uint32_t k = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!accepts(g, n->items, e)) return 0;
            k++;
        }
        return k >= n->min_items && k <= n->max_items;
    }
    if (!cJSON_IsObject(v) || !(n->types & GR_OBJECT)) return 0;
    uint64_t seen = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        size_t len;
        char *name = encode_name(e->string, &len);
        if (!name) return 0;
        int child = n->additional;
        for (uint32_t i = 0; i < n->n_props; i++) {
            const gr_prop *p = &g->props[n->props_off + i];
            if (!cmp_bytes(g->text + p->name.off, p->name.len, name, len)) {
                child = p->node;
                seen |= 1ull << i;
            }
        }
        free(name);
        if (child < 0 || !accepts(g, child, e)) return 0;
    }
    return (n->required & ~seen) == 0;
}

/* ------------------------------------------------------------------ keywords */

static int path_push(cctx *c, const char *fmt, const char *arg)
{
    size_t n = strlen(c->path);
    snprintf(c->path + n, sizeof c->path - n, fmt, arg);
    return (int)n;
}

/* A count keyword (minLength, ...): an integer in [0, 2^31); *v untouched when absent. */
static int get_count(cctx *c, const cJSON *s, const char *key, uint32_t *v)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!j) return 0;
    if (!cJSON_IsNumber(j) || j->valuedouble < 0 || j->valuedouble > 2147483647.0 ||
        j->valuedouble != (double)(long long)j->valuedouble)
        return kr_errf(c->err, "%s.%s: expected a non-negative integer", c->path, key);
    *v = (uint32_t)j->valuedouble;
    return 0;
}

static int parse_type(cctx *c, const cJSON *t, uint8_t *types)
{
    static const char *const names[] = {"null", "boolean", "integer", "number", "string", "array", "object"};
    const cJSON *list = t, *e;
    if (cJSON_IsString(t)) list = NULL;
    else if (!cJSON_IsArray(t) || !cJSON_GetArraySize(t))
        return kr_errf(c->err, "%s.type: expected a type name or a non-empty list of them", c->path);
    *types = 0;
    for (e = list ? list->child : t; e; e = list ? e->next : NULL) {
        int k = -1;
        for (int i = 0; i < 7 && cJSON_IsString(e); i++)
            if (!strcmp(e->valuestring, names[i])) k = i;
        if (k < 0)
            return kr_errf(c->err, "%s.type: expected one of null, boolean, integer, number, string, array, "
                           "object", c->path);
        *types |= (uint8_t)(1 << k);
    }
    return 0;
}

static int compile_node(cctx *c, const cJSON *s, int depth);

typedef struct tmp_prop {
    char *name; /* encoded */
    size_t len;
    int node;
    int required;
} tmp_prop;

static int cmp_tmp_prop(const void *a, const void *b)
{
    const tmp_prop *x = a, *y = b;
    return cmp_bytes(x->name, x->len, y->name, y->len);
}

/* properties, required, additionalProperties of object node `idx`. */
static int compile_object(cctx *c, const cJSON *s, int idx, int depth)
{
    kr_grammar *g = c->g;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props)) return kr_errf(c->err, "%s.properties: expected an object", c->path);
    if (req && !cJSON_IsArray(req)) return kr_errf(c->err, "%s.required: expected a list of names", c->path);
    int additional = c->any;
    if (cJSON_IsFalse(add)) additional = -1;
    else if (add && !cJSON_IsTrue(add)) {
        int at = path_push(c, ".%s", "additionalProperties");
        additional = compile_node(c, add, depth + 1);
        c->path[at] = 0;
        if (additional < 0) return -1;
    }
    int n = cJSON_GetArraySize(props) + cJSON_GetArraySize(req), k = 0, rc = -1;
    tmp_prop *tp = calloc((size_t)n + 1, sizeof *tp);
    if (!tp) return oom(c);
    const cJSON *e;
    cJSON_ArrayForEach(e, props) {
        int at = path_push(c, ".properties.%.40s", e->string);
        tp[k].node = compile_node(c, e, depth + 1);
        c->path[at] = 0;
        if (tp[k].node < 0) goto out;
        if (!(tp[k].name = encode_name(e->string, &tp[k].len))) { oom(c); goto out; }
        k++;
    }
    cJSON_ArrayForEach(e, req) {
        if (!cJSON_IsString(e)) { kr_errf(c->err, "%s.required: expected a list of names", c->path); goto out; }
        size_t len;
        char *name = encode_name(e->valuestring, &len);
        if (!name) { oom(c); goto out; }
        int i = 0;
        while (i < k && cmp_bytes(tp[i].name, tp[i].len, name, len)) i++;
        if (i == k) { /* a required key that has no schema of its own: an additional one */
            if (additional < 0) {
                kr_errf(c->err, "%s.required: \"%.40s\" is not in properties and additionalProperties is false",
                        c->path, e->valuestring);
                free(name);
                goto out;
            }
            tp[k++] = (tmp_prop){name, len, additional, 0};
        } else {
            free(name);
        }
        if (tp[i].required) { kr_errf(c->err, "%s.required: \"%.40s\" is listed twice", c->path, e->valuestring); goto out; }
        tp[i].required = 1;
    }
    if (k > GR_MAX_PROPS) {
        kr_errf(c->err, "%s.properties: %d properties, at most %d are supported", c->path, k, GR_MAX_PROPS);
        goto out;
    }
    qsort(tp, (size_t)k, sizeof *tp, cmp_tmp_prop);
    if (grow((void **)&g->props, &g->cap_props, g->n_props + k, sizeof *g->props)) { oom(c); goto out; }
    gr_node *node = &g->nodes[idx];
    node->props_off = (uint32_t)g->n_props;
    node->n_props = (uint32_t)k;
    node->additional = additional;
    uint32_t longest = 0;
    for (int i = 0; i < k; i++) {
        if (i && !cmp_tmp_prop(&tp[i - 1], &tp[i])) {
            kr_errf(c->err, "%s.properties: \"%.40s\" appears twice", c->path, tp[i].name);
            goto out;
        }
        gr_prop *p = &g->props[g->n_props++];
        if (add_text(g, tp[i].name, tp[i].len, &p->name)) { oom(c); goto out; }
        p->node = tp[i].node;
        if (tp[i].required) node->required |= 1ull << i;
        if (tp[i].len > longest) longest = (uint32_t)tp[i].len;
    }
    if (node->key_max <= longest) node->key_max = longest + 1;
    rc = 0;
out:
    for (int i = 0; i < n; i++) free(tp[i].name);
    free(tp);
    return rc;
}

static int cmp_lit(const void *a, const void *b)
{
    const char *x = *(char *const *)a, *y = *(char *const *)b;
    return cmp_bytes(x, strlen(x), y, strlen(y));
}

/* Arrays and objects nested in v, v included. */
static int value_depth(const cJSON *v)
{
    int d = 0;
    const cJSON *e;
    if (!cJSON_IsArray(v) && !cJSON_IsObject(v)) return 0;
    cJSON_ArrayForEach(e, v) {
        int k = value_depth(e);
        if (k > d) d = k;
    }
    return d + 1;
}

/* A number in v (or v itself) past the range of a double: cJSON holds it as infinity and would
 * print it as null. */
static int has_infinity(const cJSON *v)
{
    if (cJSON_IsNumber(v)) return !(v->valuedouble - v->valuedouble == 0);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) if (has_infinity(e)) return 1;
    return 0;
}

/* enum / const of node idx, `depth` containers deep: the values its other keywords accept, as
 * sorted compact texts. */
static int compile_literals(cctx *c, const cJSON *en, const cJSON *cn, int idx, int depth)
{
    kr_grammar *g = c->g;
    if (en && (!cJSON_IsArray(en) || !cJSON_GetArraySize(en)))
        return kr_errf(c->err, "%s.enum: expected a non-empty list", c->path);
    if (cJSON_GetArraySize(en) > GR_MAX_LITS)
        return kr_errf(c->err, "%s.enum: %d values, at most %d are supported", c->path, cJSON_GetArraySize(en), GR_MAX_LITS);
    int n = en ? cJSON_GetArraySize(en) : 1, k = 0, rc = -1;
    char **t = calloc((size_t)n, sizeof *t);
    if (!t) return oom(c);
    const cJSON *e = en ? en->child : cn;
    for (; e; e = en ? e->next : NULL) {
        if (depth + value_depth(e) > c->g->lim.max_depth) {
            kr_errf(c->err, "%s.%s: a value whose arrays and objects nest deeper than %d levels in the document is "
                    "not supported", c->path, en ? "enum" : "const", c->g->lim.max_depth);
            goto out;
        }
        if (has_infinity(e)) {
            kr_errf(c->err, "%s.%s: a number beyond the range of a double is not supported", c->path,
                    en ? "enum" : "const");
            goto out;
        }
        if (en && cn && !cJSON_Compare(e, cn, 1)) continue; /* both: the const, if the enum has it */
        if (!accepts(g, idx, e)) continue;
        if (!(t[k] = cJSON_PrintUnformatted(e))) { oom(c); goto out; }
        k++;
    }
    if (!k) {
        kr_errf(c->err, "%s.%s: no value satisfies the schema's other keywords", c->path, en ? "enum" : "const");
        goto out;
    }
    qsort(t, (size_t)k, sizeof *t, cmp_lit);
    if (grow((void **)&g->lits, &g->cap_lits, g->n_lits + k, sizeof *g->lits)) { oom(c); goto out; }
    gr_node *node = &g->nodes[idx];
    node->lits_off = (uint32_t)g->n_lits;
    for (int i = 0; i < k; i++) {
        if (i && !strcmp(t[i - 1], t[i])) continue;
        if (add_text(g, t[i], strlen(t[i]), &g->lits[g->n_lits])) { oom(c); goto out; }
        g->n_lits++;
    }
    node->n_lits = (uint32_t)g->n_lits - node->lits_off;
    rc = 0;
out:
    for (int i = 0; i < k; i++) free(t[i]);
    free(t);
    return rc;
}

/* One schema at `depth` containers below the document's root: its node index, or -1. */
static int compile_node(cctx *c, const cJSON *s, int depth)
{
    kr_grammar *g = c->g;
    if (cJSON_IsTrue(s)) return c->any;
    if (cJSON_IsFalse(s)) return kr_errf(c->err, "%s: the schema false (nothing valid) is not supported", c->path);
    if (!cJSON_IsObject(s)) return kr_errf(c->err, "%s: expected a schema (an object or true)", c->path);
    if (depth > g->lim.max_depth)
        return kr_errf(c->err, "%s: schemas nested deeper than %d levels are not supported", c->path, g->lim.max_depth);
    const cJSON *e;
    cJSON_ArrayForEach(e, s) {
        size_t i = 0;
        while (i < sizeof keywords / sizeof *keywords && strcmp(keywords[i], e->string)) i++;
        if (i == sizeof keywords / sizeof *keywords)
            return kr_errf(c->err, "%s: keyword \"%.40s\" is not supported (supported: " SUPPORTED ")", c->path, e->string);
    }
    uint8_t types = GR_ALL;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (t && parse_type(c, t, &types)) return -1;
    uint32_t min_len = 0, max_len = UINT32_MAX, min_items = 0, max_items = UINT32_MAX;
    if (get_count(c, s, "minLength", &min_len) || get_count(c, s, "maxLength", &max_len) ||
        get_count(c, s, "minItems", &min_items) || get_count(c, s, "maxItems", &max_items))
        return -1;
    if (min_len > max_len) return kr_errf(c->err, "%s: minLength > maxLength", c->path);
    if (min_items > max_items) return kr_errf(c->err, "%s: minItems > maxItems", c->path);
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    if (cJSON_IsArray(items)) return kr_errf(c->err, "%s.items: a list of schemas (tuple form) is not supported", c->path);
    int item_node = c->any;
    if (items) {
        int at = path_push(c, ".%s", "items");
        item_node = compile_node(c, items, depth + 1);
        c->path[at] = 0;
        if (item_node < 0) return -1;
    }
    int idx = new_node(c);
    if (idx < 0) return -1;
    gr_node *n = &g->nodes[idx];
    n->types = types;
    n->min_len = min_len;
    n->max_len = max_len != UINT32_MAX ? max_len : min_len > n->max_len ? min_len : n->max_len;
    n->min_items = min_items;
    n->max_items = max_items;
    n->items = item_node;
    if (compile_object(c, s, idx, depth)) return -1;
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum"), *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    if ((en || cn) && compile_literals(c, en, cn, idx, depth)) return -1;
    n = &g->nodes[idx];
    n->min_doc = gr_node_min_doc(g, n);
    if (!n->n_lits && depth >= g->lim.max_depth && !(n->types & ~(GR_ARRAY | GR_OBJECT)))
        return kr_errf(c->err, "%s: an array or object nested deeper than %d levels is not supported", c->path,
                       g->lim.max_depth);
    return idx;
}

/* ------------------------------------------------------------------ entry points */

static int check_limits(const kr_grammar_limits *in, kr_grammar_limits *out, char *err)
{
    *out = default_limits;
    if (!in) return 0;
    struct { int v, *dst, lo, hi; const char *name; } f[] = {
        {in->max_ws, &out->max_ws, 1, 255, "max_ws"},
        {in->max_string, &out->max_string, 1, 1 << 24, "max_string"},
        {in->max_int_digits, &out->max_int_digits, 1, 300, "max_int_digits"},
        {in->max_frac_digits, &out->max_frac_digits, 1, 300, "max_frac_digits"},
        {in->max_exp_digits, &out->max_exp_digits, 1, 3, "max_exp_digits"},
        {in->max_depth, &out->max_depth, 1, KR_GRAMMAR_MAX_DEPTH, "max_depth"},
    };
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) {
        if (!f[i].v) continue;
        if (f[i].v < f[i].lo || f[i].v > f[i].hi)
            return kr_errf(err, "grammar limits: %s = %d is outside [%d, %d]", f[i].name, f[i].v, f[i].lo, f[i].hi);
        *f[i].dst = f[i].v;
    }
    return 0;
}

/* The grammar with its fixed parts (limits, true/false/null, the any-value node). */
static kr_grammar *grammar_new(cctx *c, const kr_grammar_limits *limits)
{
    kr_grammar *g = calloc(1, sizeof *g);
    if (!g) { kr_errf(c->err, "grammar: out of memory"); return NULL; }
    c->g = g;
    if (check_limits(limits, &g->lim, c->err)) goto err;
    c->any = -1;
    if ((c->any = new_node(c)) < 0) goto err;
    g->nodes[c->any].items = g->nodes[c->any].additional = c->any;
    g->nodes[c->any].min_doc = 1; /* a digit */
    static const char *const kw[] = {"false", "null", "true"};
    /* props is never NULL, so that props + offset is defined for objects without any */
    if (grow((void **)&g->lits, &g->cap_lits, 3, sizeof *g->lits) ||
        grow((void **)&g->props, &g->cap_props, 1, sizeof *g->props))
        goto err_oom;
    g->kw_lits = 0;
    for (int i = 0; i < 3; i++)
        if (add_text(g, kw[i], strlen(kw[i]), &g->lits[g->n_lits++])) goto err_oom;
    return g;
err_oom:
    kr_errf(c->err, "grammar: out of memory");
err:
    kr_grammar_free(g);
    return NULL;
}

void kr_grammar_free(kr_grammar *g)
{
    if (!g) return;
    free(g->nodes);
    free(g->props);
    free(g->lits);
    free(g->text);
    free(g);
}

/* Parses JSON text that must be valid UTF-8 (strings of the schema end up in documents). */
static cJSON *parse_json(const char *text, size_t len, const char *what, char *err)
{
    for (size_t i = 0; i < len;) {
        uint8_t b = (uint8_t)text[i];
        size_t n = b < 0x80 ? 1 : b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
        int ok = n && i + n <= len;
        for (size_t k = 1; ok && k < n; k++) ok = ((uint8_t)text[i + k] & 0xC0) == 0x80;
        if (ok && n == 3) {
            uint8_t b1 = (uint8_t)text[i + 1];
            ok = !(b == 0xE0 && b1 < 0xA0) && !(b == 0xED && b1 > 0x9F);
        } else if (ok && n == 4) {
            uint8_t b1 = (uint8_t)text[i + 1];
            ok = !(b == 0xF0 && b1 < 0x90) && !(b == 0xF4 && b1 > 0x8F);
        }
        if (!ok) { kr_errf(err, "%s: invalid UTF-8 at byte %zu", what, i); return NULL; }
        i += n;
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (j) { /* nothing but whitespace may follow the value */
        while (end < text + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
        if (end != text + len) {
            kr_errf(err, "%s: unexpected bytes after the JSON value (at byte %zu)", what, (size_t)(end - text));
            cJSON_Delete(j);
            return NULL;
        }
    } else {
        const char *at = cJSON_GetErrorPtr();
        size_t off = at && at >= text && at <= text + len ? (size_t)(at - text) : 0;
        kr_errf(err, "%s: not valid JSON (at byte %zu; or nested deeper than %d levels)", what, off, CJSON_NESTING_LIMIT);
    }
    return j;
}

/* The root node from schema s at c->path; the grammar on success. */
static int finish(cctx *c, const cJSON *s, kr_grammar **out)
{
    int root = compile_node(c, s, 0);
    if (root < 0) {
        kr_grammar_free(c->g);
        return -1;
    }
    c->g->root = root;
    *out = c->g;
    return 0;
}

int kr_grammar_compile_schema(const char *schema, size_t len, const kr_grammar_limits *limits, kr_grammar **out,
                              char *err)
{
    cctx c = {.err = err, .path = "schema"};
    cJSON *j = parse_json(schema, len, "schema", err);
    if (!j) return -1;
    int rc = -1;
    if (grammar_new(&c, limits)) rc = finish(&c, j, out);
    cJSON_Delete(j);
    return rc;
}

/* Refuses members of object o other than the `n` names in `known`. */
static int only_fields(const cJSON *o, const char *where, const char *const *known, int n, char *err)
{
    const cJSON *e;
    cJSON_ArrayForEach(e, o) {
        int i = 0;
        while (i < n && strcmp(known[i], e->string)) i++;
        if (i == n) return kr_errf(err, "%s: field \"%.40s\" is not supported", where, e->string);
    }
    return 0;
}

static int json_schema_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (!n || n > 64) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return 0;
    return 1;
}

static int compile_format(cctx *c, const cJSON *rf, const kr_grammar_limits *limits, kr_grammar **out)
{
    static const char *const rf_fields[] = {"type", "json_schema"};
    static const char *const js_fields[] = {"name", "description", "schema", "strict"};
    char *err = c->err;
    if (!cJSON_IsObject(rf)) return kr_errf(err, "response_format: expected an object");
    if (only_fields(rf, "response_format", rf_fields, 2, err)) return -1;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(rf, "type");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
    if (!cJSON_IsString(type))
        return kr_errf(err, "response_format.type: expected \"text\", \"json_object\" or \"json_schema\"");
    if (strcmp(type->valuestring, "json_schema") && js)
        return kr_errf(err, "response_format.json_schema: only with type \"json_schema\"");
    if (!strcmp(type->valuestring, "text")) {
        *out = NULL;
        return 0;
    }
    if (!strcmp(type->valuestring, "json_object")) {
        cJSON *obj = cJSON_Parse("{\"type\":\"object\"}");
        if (!obj) return kr_errf(err, "grammar: out of memory");
        int rc = -1;
        snprintf(c->path, sizeof c->path, "response_format");
        if (grammar_new(c, limits)) rc = finish(c, obj, out);
        cJSON_Delete(obj);
        return rc;
    }
    if (strcmp(type->valuestring, "json_schema"))
        return kr_errf(err, "response_format.type: \"%.40s\" is not one of \"text\", \"json_object\", \"json_schema\"",
                       type->valuestring);
    if (!cJSON_IsObject(js)) return kr_errf(err, "response_format.json_schema: expected an object");
    if (only_fields(js, "response_format.json_schema", js_fields, 4, err)) return -1;
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(js, "name");
    const cJSON *desc = cJSON_GetObjectItemCaseSensitive(js, "description");
    const cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict");
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
    if (!cJSON_IsString(name) || !json_schema_name_ok(name->valuestring))
        return kr_errf(err, "response_format.json_schema.name: expected 1-64 characters of a-z, A-Z, 0-9, _ and -");
    if (desc && !cJSON_IsString(desc))
        return kr_errf(err, "response_format.json_schema.description: expected a string");
    if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict))
        return kr_errf(err, "response_format.json_schema.strict: expected true or false");
    if (!schema) return kr_errf(err, "response_format.json_schema.schema: required");
    snprintf(c->path, sizeof c->path, "response_format.json_schema.schema");
    return grammar_new(c, limits) ? finish(c, schema, out) : -1;
}

int kr_grammar_compile(const char *response_format, size_t len, const kr_grammar_limits *limits, kr_grammar **out,
                       char *err)
{
    cctx c = {.err = err};
    cJSON *j = parse_json(response_format, len, "response_format", err);
    if (!j) return -1;
    int rc = compile_format(&c, j, limits, out);
    cJSON_Delete(j);
    return rc;
}
