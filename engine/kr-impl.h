/*
 * kr-impl.h - every engine internal header at once, for the sources outside engine/ that still
 * include it (tools/kvrelay-make-model.c, tests/fuzz/fuzz_config.c, tests/fuzz/fuzz_tokenizer.c).
 * Engine sources include the header of the concern they use instead:
 *   kr-util.h        error messages, file reads, bf16 / f16 conversions
 *   kr-model.h       a loaded model's weights, the config check
 *   kr-threadpool.h  the CPU thread pool
 *   kr-kv.h          the paged KV cache's blocks and lists
 *   kr-tokenizer.h   the tokenizer's in-memory parse
 * Once those three sources include what they use, this header goes. Not installed.
 */
#ifndef KR_IMPL_H
#define KR_IMPL_H

#include "kr-kv.h"
#include "kr-model.h"
#include "kr-threadpool.h"
#include "kr-tokenizer.h"
#include "kr-util.h"

#include <stdarg.h>
#include <stdio.h>

#endif /* KR_IMPL_H */
