/*
 * kr-tokenizer.h - the tokenizer's entry point below kr_tokenizer_load (tokenizer.c), for the
 * fuzzer and the unit tests, which parse tokenizer text they hold in memory. Not installed.
 */
#ifndef KR_TOKENIZER_H
#define KR_TOKENIZER_H

#include "kr.h"

/* kr_tokenizer_load without the file reads. `json` is tokenizer.json's text; `config_json` (may
 * be NULL) tokenizer_config.json's. The paths are only used in messages. */
int kr_tokenizer_parse(const char *json, size_t len, const char *path, const char *config_json,
                       size_t config_len, const char *config_path, kr_tokenizer **out, char *err);

#endif /* KR_TOKENIZER_H */
