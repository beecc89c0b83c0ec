/*
 * kvrelay-tokenize - the engine's tokenizer on the command line (DESIGN.md section 6).
 *
 * Encode: reads UTF-8 text on stdin (every byte, a trailing newline included) and prints the
 * token ids space-separated on one line. Decode (--decode): reads ids on stdin and prints the
 * text exactly, with nothing added. Chat (--chat FILE): renders a conversation with the model's
 * chat template (or --template) and prints the ids of the result, or the text (--text-only),
 * or one JSON line per conversation of a JSON Lines file (--jsonl: how tests compare the
 * renderer with jinja2). It is not a model runner: only tokenizer.json, tokenizer_config.json
 * and config.json (for the built-in chat template) are read from --model.
 * Run: printf '%s' 'Hello world' | kvrelay-tokenize --model DIR
 */
#include "cli.h"
#include "kr.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The special token `id` as text ("" when id < 0). */
static char *token_text(const kr_tokenizer *t, int id)
{
    char err[KR_ERR_MAX], *s = NULL;
    int32_t one = id;
    if (id < 0 || kr_tokenizer_decode(t, &one, 1, 0, &s, err)) {
        s = malloc(1);
        if (!s) cli_die(1, "out of memory");
        s[0] = 0;
    }
    return s;
}

/* The template: --template FILE or builtin:NAME (bos/eos from the tokenizer), else the model's. */
static kr_chat_template *chat_template(const char *dir, const char *spec, const kr_tokenizer *t)
{
    char err[KR_ERR_MAX];
    kr_chat_template *ct = NULL;
    if (!spec) {
        if (kr_chat_template_load(dir, &ct, err)) cli_die(1, "%s", err);
        return ct;
    }
    char *bos = token_text(t, kr_tokenizer_bos(t)), *eos = token_text(t, kr_tokenizer_eos(t));
    if (!strncmp(spec, "builtin:", 8)) {
        if (kr_chat_template_builtin(spec + 8, bos, eos, &ct, err)) cli_die(2, "--template: %s", err);
    } else {
        FILE *f = fopen(spec, "rb");
        if (!f) cli_die(1, "--template %s: cannot open", spec);
        size_t len;
        char *src = cli_read_file(f, &len);
        fclose(f);
        if (strlen(src) != len) cli_die(1, "--template %s: the file holds a NUL byte", spec);
        if (kr_chat_template_parse(src, bos, eos, &ct, err)) cli_die(1, "--template %s: %s", spec, err);
        free(src);
    }
    free(bos);
    free(eos);
    return ct;
}

/* A conversation: {"messages": [...], "add_generation_prompt": bool} or the bare list. On a
 * bad document returns -1 with the reason in err. *msgs points into doc. */
static int chat_messages(const cJSON *doc, kr_chat_message **msgs, int *n, int *add_gen, char *err)
{
    const cJSON *list = doc;
    if (cJSON_IsObject(doc)) {
        list = cJSON_GetObjectItemCaseSensitive(doc, "messages");
        const cJSON *g = cJSON_GetObjectItemCaseSensitive(doc, "add_generation_prompt");
        if (cJSON_IsBool(g)) *add_gen = cJSON_IsTrue(g);
    }
    if (!cJSON_IsArray(list)) {
        snprintf(err, KR_ERR_MAX, "expected {\"messages\": [...]} or a list of messages");
        return -1;
    }
    int k = cJSON_GetArraySize(list), i = 0;
    kr_chat_message *m = calloc((size_t)k + 1, sizeof *m);
    if (!m) cli_die(1, "out of memory");
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsObject(e) || !(cJSON_IsString(role) || cJSON_IsNull(role)) ||
            !(cJSON_IsString(content) || cJSON_IsNull(content))) {
            snprintf(err, KR_ERR_MAX, "messages[%d] must be {\"role\": string, \"content\": string or null}", i);
            free(m);
            return -1;
        }
        m[i].role = cJSON_IsString(role) ? role->valuestring : NULL;
        m[i].content = cJSON_IsString(content) ? content->valuestring : NULL;
    }
    *msgs = m;
    *n = k;
    return 0;
}

static int run_chat(const kr_tokenizer *t, const kr_chat_template *ct, const char *file, int add_gen, int text_only,
                    int jsonl, int add_special)
{
    FILE *f = strcmp(file, "-") ? fopen(file, "rb") : stdin;
    if (!f) cli_die(1, "--chat %s: cannot open", file);
    size_t len;
    char *in = cli_read_file(f, &len);
    if (f != stdin) fclose(f);
    int rc = 0;
    char *line = in, *end = in + len;
    while (line < end || !jsonl) {
        char *nl = jsonl ? memchr(line, '\n', (size_t)(end - line)) : NULL;
        size_t n = jsonl ? (nl ? (size_t)(nl - line) : (size_t)(end - line)) : len;
        char *next = nl ? nl + 1 : end;
        if (jsonl && strspn(line, " \t\r") >= n) { line = next; continue; } /* blank line */
        char err[KR_ERR_MAX];
        cJSON *doc = cJSON_ParseWithLength(line, n);
        kr_chat_message *m = NULL;
        int nm = 0, gen = add_gen, st;
        char *text = NULL;
        size_t tlen = 0;
        if (!doc) {
            snprintf(err, sizeof err, "not valid JSON");
            st = -1;
        } else {
            st = chat_messages(doc, &m, &nm, &gen, err);
            if (!st) st = kr_chat_template_render(ct, m, nm, gen, &text, &tlen, err);
        }
        if (jsonl) {
            cJSON *o = cJSON_CreateObject();
            if (!st) cJSON_AddStringToObject(o, "text", text);
            else {
                cJSON_AddStringToObject(o, "error", err);
                cJSON_AddBoolToObject(o, "raised", st == KR_CHAT_RAISED);
            }
            char *s = cJSON_PrintUnformatted(o);
            if (!s) cli_die(1, "out of memory");
            puts(s);
            free(s);
            cJSON_Delete(o);
        } else if (st) {
            fprintf(stderr, "kvrelay-tokenize: --chat %s: %s\n", file, err);
            rc = 1;
        } else if (text_only) {
            fwrite(text, 1, tlen, stdout);
        } else {
            int32_t *ids;
            int nid;
            if (kr_tokenizer_encode(t, text, tlen, add_special, &ids, &nid, err)) {
                fprintf(stderr, "kvrelay-tokenize: %s\n", err);
                rc = 1;
            } else {
                for (int i = 0; i < nid; i++) printf(i ? " %d" : "%d", (int)ids[i]);
                putchar('\n');
                free(ids);
            }
        }
        free(text);
        free(m);
        cJSON_Delete(doc);
        if (!jsonl) break;
        line = next;
    }
    free(in);
    return rc;
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *dir = NULL, *text = NULL, *ids_arg = NULL;
    const char *chat = NULL, *template = NULL;
    int add_special = 0, decode = 0, skip_special = 0, no_gen = 0, text_only = 0, jsonl = 0, show = 0;
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &dir,
         .help = "the directory holding tokenizer.json (required)"},
        {.kind = KC_FLAG_BOOL, .name = "--add-special", .dest = &add_special,
         .help = "prepend BOS (and other template tokens) as the model's config says; off by default. "
                 "Special-token strings in the text always map to their ids."},
        {.kind = KC_FLAG_STRING, .name = "--text", .arg = "TEXT", .dest = &text, .help = "encode TEXT instead of reading stdin"},
        {.kind = KC_FLAG_BOOL, .name = "--decode", .dest = &decode, .help = "ids -> text"},
        {.kind = KC_FLAG_STRING, .name = "--ids", .arg = "\"1 2 3\"", .dest = &ids_arg,
         .help = "with --decode: the ids, instead of reading stdin"},
        {.kind = KC_FLAG_BOOL, .name = "--skip-special", .dest = &skip_special,
         .help = "with --decode: leave special tokens (BOS, EOS, ...) out"},
        {.kind = KC_FLAG_STRING, .name = "--chat", .arg = "FILE", .dest = &chat,
         .help = "render a conversation with the chat template and encode it (no BOS added: the template "
                 "writes its special tokens). FILE ('-': stdin) is {\"messages\": [{\"role\": ..., \"content\": "
                 "...}, ...]} (optionally with \"add_generation_prompt\": false) or the bare list"},
        {.kind = KC_FLAG_STRING, .name = "--template", .arg = "T", .dest = &template, .def = "the model's",
         .help = "the chat template: a Jinja file, or builtin:llama3, builtin:chatml, builtin:mistral "
                 "(docs/chat-templates.md)"},
        {.kind = KC_FLAG_BOOL, .name = "--no-generation-prompt", .dest = &no_gen,
         .help = "render with add_generation_prompt false"},
        {.kind = KC_FLAG_BOOL, .name = "--text-only", .dest = &text_only,
         .help = "with --chat: print the rendered text exactly instead of its ids"},
        {.kind = KC_FLAG_BOOL, .name = "--jsonl", .dest = &jsonl,
         .help = "with --chat: FILE has one conversation per line; print one JSON line each, {\"text\": ...} "
                 "or {\"error\": ..., \"raised\": bool} (raised: the template's raise_exception); render "
                 "errors do not stop it"},
        {.kind = KC_FLAG_BOOL, .name = "--show-template", .dest = &show,
         .help = "print the chat template's source (and where it came from, on stderr)"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = {
        .prog = "kvrelay-tokenize",
        .usage = "--model DIR [--add-special] [--text TEXT]\n"
                 "       kvrelay-tokenize --model DIR --decode [--skip-special] [--ids \"1 2 3\"]\n"
                 "       kvrelay-tokenize --model DIR --chat FILE [--template FILE|builtin:NAME]\n"
                 "                        [--no-generation-prompt] [--text-only | --jsonl] [--add-special]\n"
                 "       kvrelay-tokenize --model DIR --show-template [--template FILE|builtin:NAME]",
        .about = "Encodes UTF-8 text read on stdin (all of it: a trailing newline is a token too) into\n"
                 "token ids printed space-separated on one line, or with --decode reads ids (spaces,\n"
                 "commas or newlines between them) and prints their text exactly, adding no newline.\n"
                 "DIR is a Hugging Face model directory; tokenizer.json (+ tokenizer_config.json) is\n"
                 "enough.",
        .table = table,
        .footer = "examples:\n"
                  "  printf '%s' 'Hello world' | kvrelay-tokenize --model models/llama3\n"
                  "  kvrelay-tokenize --model models/llama3 --decode --ids \"9906 1917\"\n"
                  "  echo '[{\"role\":\"user\",\"content\":\"Hi\"}]' | kvrelay-tokenize --model models/llama3 --chat - "
                  "--text-only\n"
                  "\n"
                  "exit status: 0 success, 1 tokenizer, template or input error, 2 bad usage",
    };
    kc_flags_main(&flags, argc, argv, 0);
    int add_gen = !no_gen;
    if (!dir) cli_die(2, "--model DIR is required (see --help)");
    if (decode && (add_special || text)) cli_die(2, "--add-special and --text are for encoding, not --decode");
    if (!decode && (skip_special || ids_arg)) cli_die(2, "--skip-special and --ids need --decode");
    if ((chat || show) && (decode || text)) cli_die(2, "--chat and --show-template do not go with --decode or --text");
    if (chat && show) cli_die(2, "--chat and --show-template are separate modes");
    if (!chat && (text_only || jsonl || !add_gen)) cli_die(2, "--text-only, --jsonl and --no-generation-prompt need --chat");
    if (!chat && !show && template) cli_die(2, "--template needs --chat or --show-template");
    if (text_only && jsonl) cli_die(2, "--text-only and --jsonl exclude each other");

    char err[KR_ERR_MAX];
    kr_tokenizer *t;
    if (kr_tokenizer_load(dir, &t, err)) cli_die(1, "%s", err);
    int rc = 0;
    if (chat || show) {
        kr_chat_template *ct = chat_template(dir, template, t);
        if (show) {
            fputs(kr_chat_template_text(ct), stdout);
            fprintf(stderr, "kvrelay-tokenize: template from %s; bos_token \"%s\", eos_token \"%s\"\n",
                    kr_chat_template_source(ct), kr_chat_template_bos(ct), kr_chat_template_eos(ct));
        } else {
            rc = run_chat(t, ct, chat, add_gen, text_only, jsonl, add_special);
        }
        kr_chat_template_free(ct);
    } else if (!decode) {
        size_t len;
        char *in = text ? NULL : cli_read_stdin(&len);
        if (text) len = strlen(text);
        int32_t *ids;
        int n;
        if (kr_tokenizer_encode(t, text ? text : in, len, add_special, &ids, &n, err)) {
            fprintf(stderr, "kvrelay-tokenize: %s\n", err);
            rc = 1;
        } else {
            for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", (int)ids[i]);
            putchar('\n');
            free(ids);
        }
        free(in);
    } else {
        size_t len;
        char *in = ids_arg ? NULL : cli_read_stdin(&len);
        int n;
        int32_t *ids = cli_ids(ids_arg ? "--ids" : "stdin", ids_arg ? ids_arg : in, &n);
        char *out;
        if (kr_tokenizer_decode(t, ids, n, skip_special, &out, err)) {
            fprintf(stderr, "kvrelay-tokenize: %s\n", err);
            rc = 1;
        } else {
            fputs(out, stdout);
            free(out);
        }
        free(ids);
        free(in);
    }
    kr_tokenizer_free(t);
    if (fflush(stdout) != 0) {
        fprintf(stderr, "kvrelay-tokenize: writing stdout failed\n");
        rc = 1;
    }
    return rc;
}
