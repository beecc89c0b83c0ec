/*
 * model_shell.h - a model with a config and no weights, for the tests that call the CPU
 * backend's ops directly: creating a backend reads only the config (its scratch sizes).
 * Header-only, for tests/unit.
 */
#ifndef KR_MODEL_SHELL_H
#define KR_MODEL_SHELL_H

#include "kr-model.h"

#include <string.h>

/* hidden size d, MLP width f, heads and KV heads of head_dim; everything else zero */
static inline kr_model kr_test_model_shell(int d, int f, int heads, int kv_heads, int head_dim)
{
    kr_model m;
    memset(&m, 0, sizeof m);
    m.cfg.hidden_size = d;
    m.cfg.intermediate_size = f;
    m.cfg.n_heads = heads;
    m.cfg.n_kv_heads = kv_heads;
    m.cfg.head_dim = head_dim;
    return m;
}

#endif
