/*
 * chat.c - chat templates: kr.h's entry points (load, parse, render) for a renderer of the
 * subset of Jinja2 that Hugging Face chat templates use (tokenizer_config.json "chat_template"),
 * and three built-in templates (Llama 3, ChatML, Mistral) for models that ship none, rendered
 * by the same engine.
 *
 * It follows jinja2 3.1 as transformers runs chat templates: ImmutableSandboxedEnvironment with
 * trim_blocks and lstrip_blocks, the loopcontrols extension ({% break %}, {% continue %}), HF's
 * {% generation %} block, HF's tojson (json.dumps, ensure_ascii off, keys unsorted) and
 * raise_exception. The lexer mirrors jinja2's (same whitespace rules, same tokens), the parser
 * its precedence, the evaluator Python's semantics for the value types templates meet; each is
 * a file of its own (chat-int.h lists them).
 * What it is not: a general Jinja engine: no macros, includes, inheritance, autoescape, custom
 * filters, or Python objects beyond str/int/float/bool/None/list/tuple/dict (docs/chat-templates.md
 * has the subset and the known differences). Outside the subset is a parse or render error.
 *
 * A compiled template is immutable; each render has its own arena, output buffer and limits,
 * so renders of one template may run concurrently.
 * Check a template: kvrelay-tokenize --model DIR --chat conv.json --text-only
 */
#include "chat-int.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kr_chat_template {
    arena ar; /* the syntax tree, names, literals, the normalized source */
    node *body;
    char *text; /* the source as given (malloc'd) */
    char *bos, *eos; /* malloc'd */
    const char *origin; /* static */
};

/* ------------------------------------------------------------------ built-in templates */

/* Llama 3 header format: <|begin_of_text|>, then per message a role header, the trimmed
 * content and <|eot_id|>; the generation prompt is an open assistant header. */
static const char BUILTIN_LLAMA3[] =
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n";

/* ChatML (Qwen2): <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, a default system message
 * when the conversation does not start with one. */
static const char BUILTIN_CHATML[] =
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

/* Mistral: <s>[INST] user [/INST]assistant</s>[INST] ... ; a leading system message goes
 * before the first user message, followed by a blank line; user and assistant must alternate.
 * The [/INST] is the generation prompt, so add_generation_prompt changes nothing. */
static const char BUILTIN_MISTRAL[] =
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "    {%- set system_prefix = messages[0]['content'] + '\\n\\n' %}\n"
    "    {%- set conversation = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_prefix = '' %}\n"
    "    {%- set conversation = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in conversation %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported after an optional first system message') }}\n"
    "    {%- endif %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {{- '[INST] ' + (system_prefix if loop.first else '') + message['content'] + ' [/INST]' }}\n"
    "    {%- else %}\n"
    "        {{- message['content'] + eos_token }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n";

static const struct builtin {
    const char *name, *origin, *src, *bos, *eos; /* bos/eos: when tokenizer_config.json has none */
} BUILTINS[] = {
    {"llama3", "built-in llama3", BUILTIN_LLAMA3, "<|begin_of_text|>", "<|eot_id|>"},
    {"chatml", "built-in chatml", BUILTIN_CHATML, "", "<|im_end|>"},
    {"mistral", "built-in mistral", BUILTIN_MISTRAL, "<s>", "</s>"},
};

static const struct builtin *builtin_find(const char *name)
{
    for (size_t i = 0; i < sizeof BUILTINS / sizeof BUILTINS[0]; i++)
        if (!strcmp(BUILTINS[i].name, name)) return &BUILTINS[i];
    return NULL;
}

/* ------------------------------------------------------------------ public API */

void kr_chat_template_free(kr_chat_template *t)
{
    if (!t) return;
    chat_arena_free(&t->ar);
    free(t->text);
    free(t->bos);
    free(t->eos);
    free(t);
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* Parses src (len bytes, may hold NULs: they are template text) into a template. */
static int template_parse(const char *src, size_t len, const char *bos, const char *eos, const char *origin,
                          kr_chat_template **out, char *err)
{
    kr_chat_template *t = calloc(1, sizeof *t);
    token *toks = NULL;
    if (!t) return kr_errf(err, "out of memory");
    t->ar.limit = CHAT_MAX_ARENA;
    t->origin = origin;
    t->text = malloc(len + 1);
    t->bos = dup_str(bos ? bos : "");
    t->eos = dup_str(eos ? eos : "");
    if (!t->text || !t->bos || !t->eos) {
        kr_errf(err, "out of memory");
        goto err_free;
    }
    memcpy(t->text, src, len);
    t->text[len] = 0;
    if (chat_lex(&t->ar, src, len, &toks, err) || chat_parse(toks, &t->ar, &t->body, err)) goto err_free;
    free(toks);
    *out = t;
    return KR_OK;
err_free:
    free(toks);
    kr_chat_template_free(t);
    return -1;
}

int kr_chat_template_parse(const char *src, const char *bos, const char *eos, kr_chat_template **out, char *err)
{
    if (!src || !out) return kr_errf(err, "kr_chat_template_parse: NULL argument");
    return template_parse(src, strlen(src), bos, eos, "template", out, err);
}

int kr_chat_template_builtin(const char *name, const char *bos, const char *eos, kr_chat_template **out, char *err)
{
    const struct builtin *b = name ? builtin_find(name) : NULL;
    if (!b) return kr_errf(err, "no built-in chat template named '%s' (built-in: llama3, chatml, mistral)", name ? name : "(null)");
    if (template_parse(b->src, strlen(b->src), bos ? bos : b->bos, eos ? eos : b->eos, b->origin, out, err))
        return -1;
    return KR_OK;
}

const char *kr_chat_template_source(const kr_chat_template *t) { return t->origin; }
const char *kr_chat_template_text(const kr_chat_template *t) { return t->text; }
const char *kr_chat_template_bos(const kr_chat_template *t) { return t->bos; }
const char *kr_chat_template_eos(const kr_chat_template *t) { return t->eos; }

/* bos_token / eos_token of tokenizer_config.json: a string or {"content": ...}; NULL when
 * absent or null. */
static const char *special_token(const cJSON *root, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static int file_exists(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

/* tokenizer_config.json's "chat_template" in *src: a string, or from a list of
 * {"name", "template"} the one named "default", else the first; NULL when absent or null. */
static int config_template(const cJSON *root, const char *path, const char **src, char *err)
{
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    *src = NULL;
    if (!ct || cJSON_IsNull(ct)) return 0;
    if (cJSON_IsString(ct)) {
        *src = ct->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(ct))
        return kr_errf(err, "%s: chat_template must be a string or a list of {\"name\", \"template\"}", path);
    const cJSON *pick = NULL;
    for (const cJSON *e = ct->child; e; e = e->next) {
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
        const cJSON *tp = cJSON_GetObjectItemCaseSensitive(e, "template");
        if (!cJSON_IsObject(e) || !cJSON_IsString(tp))
            return kr_errf(err, "%s: chat_template list entries must be {\"name\": ..., \"template\": \"...\"}", path);
        if (!pick) pick = tp;
        if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default")) { pick = tp; break; }
    }
    if (!pick) return kr_errf(err, "%s: chat_template is an empty list", path);
    *src = pick->valuestring;
    return 0;
}

int kr_chat_template_load(const char *dir, kr_chat_template **out, char *err)
{
    char tpath[4096], cpath[4096];
    char *tjson = NULL, *cjson = NULL;
    size_t tlen = 0, clen = 0;
    cJSON *troot = NULL, *croot = NULL;
    int rc = -1;
    if (snprintf(tpath, sizeof tpath, "%s/tokenizer_config.json", dir) >= (int)sizeof tpath ||
        snprintf(cpath, sizeof cpath, "%s/config.json", dir) >= (int)sizeof cpath)
        return kr_errf(err, "%s: path too long", dir);
    const char *bos = NULL, *eos = NULL, *src = NULL;
    if (file_exists(tpath)) {
        if (kr_read_file(tpath, &tjson, &tlen, err)) return -1;
        troot = cJSON_ParseWithLength(tjson, tlen);
        if (!cJSON_IsObject(troot)) {
            kr_errf(err, "%s: not a valid JSON object", tpath);
            goto out;
        }
        bos = special_token(troot, "bos_token");
        eos = special_token(troot, "eos_token");
        if (config_template(troot, tpath, &src, err)) goto out;
    }
    if (src) {
        char perr_buf[KR_ERR_MAX];
        if (template_parse(src, strlen(src), bos, eos, "tokenizer_config.json", out, perr_buf)) {
            kr_errf(err, "%s: chat_template %s", tpath, perr_buf);
            goto out;
        }
        rc = KR_OK;
        goto out;
    }
    /* no template of its own: a built-in one by model type */
    if (kr_read_file(cpath, &cjson, &clen, err)) goto out;
    croot = cJSON_ParseWithLength(cjson, clen);
    const cJSON *mt = cJSON_IsObject(croot) ? cJSON_GetObjectItemCaseSensitive(croot, "model_type") : NULL;
    const char *type = cJSON_IsString(mt) ? mt->valuestring : NULL;
    const char *name = !type ? NULL : !strcmp(type, "llama") ? "llama3" : !strcmp(type, "qwen2") ? "chatml"
                     : !strcmp(type, "mistral") ? "mistral" : NULL;
    if (!name) {
        kr_errf(err, "%s: the model has no chat template (%s has no \"chat_template\", and model_type %s%s%s has no built-in one: llama, qwen2 and mistral do)",
                dir, file_exists(tpath) ? "tokenizer_config.json" : "there is no tokenizer_config.json that",
                type ? "\"" : "", type ? type : "(absent)", type ? "\"" : "");
        goto out;
    }
    rc = kr_chat_template_builtin(name, bos, eos, out, err);
out:
    cJSON_Delete(troot);
    cJSON_Delete(croot);
    free(tjson);
    free(cjson);
    return rc;
}

int kr_chat_template_render(const kr_chat_template *t, const kr_chat_message *msgs, int n, int add_generation_prompt,
                            char **out, size_t *out_len, char *err)
{
    if (!t || !out || n < 0 || (n > 0 && !msgs)) return kr_errf(err, "kr_chat_template_render: bad arguments");
    sbuf o = {.limit = CHAT_MAX_OUTPUT};
    rctx c = {.out = &o, .err = err};
    c.ar.limit = CHAT_MAX_ARENA;
    frame root;
    chat_frame_init(&root, NULL);
    int rc = -1;
    /* messages: a list of {"role", "content"} dicts; a NULL field is None */
    vlist *l = chat_mk_list(&c, NULL, (size_t)n, 0);
    if (!l) goto out;
    for (int i = 0; i < n; i++) {
        vdict *d = chat_ralloc(&c, NULL, sizeof *d);
        if (!d) goto out;
        memset(d, 0, sizeof *d);
        const char *role = msgs[i].role, *content = msgs[i].content;
        if (chat_dict_set(&c, NULL, d, v_str("role", 4), role ? v_str(role, strlen(role)) : v_none()) ||
            chat_dict_set(&c, NULL, d, v_str("content", 7), content ? v_str(content, strlen(content)) : v_none()))
            goto out;
        l->v[i].t = V_DICT;
        l->v[i].u.d = d;
    }
    /* what transformers' apply_chat_template binds (tools and documents: None without tools) */
    if (chat_frame_set(&c, NULL, &root, "messages", v_list(l)) ||
        chat_frame_set(&c, NULL, &root, "add_generation_prompt", v_bool(add_generation_prompt)) ||
        chat_frame_set(&c, NULL, &root, "bos_token", v_str(t->bos, strlen(t->bos))) ||
        chat_frame_set(&c, NULL, &root, "eos_token", v_str(t->eos, strlen(t->eos))) ||
        chat_frame_set(&c, NULL, &root, "tools", v_none()) || chat_frame_set(&c, NULL, &root, "documents", v_none()))
        goto out;
    if (chat_exec_body(&c, t->body, &root)) goto out;
    if (sb_put(&o, "", 0)) { chat_sb_fail(&c, NULL, &o, "rendered output"); goto out; }
    *out = o.p ? o.p : dup_str("");
    if (!*out) { kr_errf(err, "out of memory"); goto out; }
    if (out_len) *out_len = o.n;
    o.p = NULL;
    rc = KR_OK;
out:
    if (rc && c.raised) rc = KR_CHAT_RAISED;
    free(o.p);
    chat_arena_free(&c.ar);
    return rc;
}
