/*
 * kvrelay-tokenize - the engine's tokenizer on the command line (DESIGN.md section 6).
 *
 * Encode: reads UTF-8 text on stdin (every byte, a trailing newline included) and prints the
 * token ids space-separated on one line. Decode (--decode): reads ids on stdin and prints the
 * text exactly, with nothing added. It is not a model runner: only tokenizer.json (and
 * tokenizer_config.json when present) are read from --model.
 * Run: printf '%s' 'Hello world' | kvrelay-tokenize --model DIR
 */
#include "cli.h"
#include "kr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void)
{
    printf("usage: kvrelay-tokenize --model DIR [--add-special] [--text TEXT]\n"
           "       kvrelay-tokenize --model DIR --decode [--skip-special] [--ids \"1 2 3\"]\n"
           "\n"
           "Encodes UTF-8 text read on stdin (all of it: a trailing newline is a token too) into\n"
           "token ids printed space-separated on one line, or with --decode reads ids (spaces,\n"
           "commas or newlines between them) and prints their text exactly, adding no newline.\n"
           "DIR is a Hugging Face model directory; tokenizer.json (+ tokenizer_config.json) is\n"
           "enough.\n"
           "\n"
           "  --model DIR       the directory holding tokenizer.json (required)\n"
           "  --add-special     prepend BOS (and other template tokens) as the model's config says;\n"
           "                    off by default. Special-token strings in the text always map to\n"
           "                    their ids.\n"
           "  --text TEXT       encode TEXT instead of reading stdin\n"
           "  --decode          ids -> text\n"
           "  --ids \"1 2 3\"     with --decode: the ids, instead of reading stdin\n"
           "  --skip-special    with --decode: leave special tokens (BOS, EOS, ...) out\n"
           "  -h, --help        this text\n"
           "\n"
           "examples:\n"
           "  printf '%%s' 'Hello world' | kvrelay-tokenize --model models/llama3\n"
           "  kvrelay-tokenize --model models/llama3 --decode --ids \"9906 1917\"\n"
           "\n"
           "exit status: 0 success, 1 tokenizer or input error, 2 bad usage\n");
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *dir = NULL, *text = NULL, *ids_arg = NULL;
    int add_special = 0, decode = 0, skip_special = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!strcmp(a, "--model")) dir = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--add-special")) add_special = 1;
        else if (!strcmp(a, "--text")) text = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--decode")) decode = 1;
        else if (!strcmp(a, "--ids")) ids_arg = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--skip-special")) skip_special = 1;
        else cli_die(2, "unknown argument '%s' (see --help)", a);
    }
    if (!dir) cli_die(2, "--model DIR is required (see --help)");
    if (decode && (add_special || text)) cli_die(2, "--add-special and --text are for encoding, not --decode");
    if (!decode && (skip_special || ids_arg)) cli_die(2, "--skip-special and --ids need --decode");

    char err[KR_ERR_MAX];
    kr_tokenizer *t;
    if (kr_tokenizer_load(dir, &t, err)) cli_die(1, "%s", err);
    int rc = 0;
    if (!decode) {
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
