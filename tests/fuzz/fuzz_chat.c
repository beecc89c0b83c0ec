/*
 * fuzz_chat.c - kr_chat_template_parse + kr_chat_template_render on arbitrary template bytes
 * with a fixed conversation: every input must parse or be refused with a "line N column M"
 * message, and every parsed template must render or fail with a message (never crash, hang or
 * leak; the renderer's limits bound time and memory). Bytes after a NUL are cut off (templates
 * are C strings).
 * Run: ctest -R fuzz_chat (replay of tests/fuzz/corpus/chat/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_chat tests/fuzz/corpus/chat.
 */
#include "kr.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const kr_chat_message conv[] = {
        {"system", "You are terse."},
        {"user", "Hi 'there' \"you\"\n  "},
        {"assistant", "h\xc3\xa9llo \xf0\x9f\x99\x82"},
        {"user", NULL},
        {"tool", ""},
    };
    char *src = malloc(size + 1);
    if (!src) return 0;
    memcpy(src, data, size);
    src[size] = 0;
    char err[KR_ERR_MAX];
    kr_chat_template *t;
    err[0] = 0;
    if (kr_chat_template_parse(src, "<s>", "</s>", &t, err) != KR_OK) {
        if (strncmp(err, "line ", 5)) __builtin_trap();
        free(src);
        return 0;
    }
    for (int gen = 0; gen < 2; gen++) {
        char *out = NULL;
        size_t len = 0;
        err[0] = 0;
        int rc = kr_chat_template_render(t, conv, gen ? 5 : 3, gen, &out, &len, err);
        if (rc == KR_OK) {
            if (!out || strlen(out) > len) __builtin_trap(); /* the output may hold NULs from data */
            free(out);
        } else if (out || (rc != -1 && rc != KR_CHAT_RAISED) || (rc == -1 && strncmp(err, "line ", 5))) {
            __builtin_trap();
        }
    }
    kr_chat_template_free(t);
    free(src);
    return 0;
}
