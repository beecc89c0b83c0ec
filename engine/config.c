/*
 * config.c - Hugging Face config.json -> kr_config, for LlamaForCausalLM, MistralForCausalLM and
 * Qwen2ForCausalLM.
 *
 * What it is: a strict reader of the fields that change the shape or the math of the model
 * (sizes, GQA, head_dim, RoPE base and llama3 scaling, biases, tied embeddings, norm epsilon,
 * bos/eos, dtype). Defaults are the transformers config classes' defaults. Every error names the
 * file and the field, and says what would be accepted.
 * What it is not: a general config loader. Fields that only matter for training (dropout,
 * initializer_range) are ignored; features the engine does not implement (other rope_scaling
 * types, MLP biases, activations other than SiLU) are refused here, at
 * load, rather than silently computed wrong later.
 * Tests: tests/unit/test_model_load.c; fuzzed by tests/fuzz/fuzz_config.c.
 */
#include "kr-model.h"
#include "kr-util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Sizes above this are refused: no real model comes close, and it keeps every product of two
 * sizes far from int64 overflow. */
#define KR_CONFIG_MAX_DIM (1 << 24)

static const char *const kr_supported_archs =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";

/* An item that is present and not JSON null. */
static const cJSON *cfg_get(const cJSON *root, const char *key)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, key);
    return it && !cJSON_IsNull(it) ? it : NULL;
}

/* A JSON number that is an integer in [lo, hi]. `required`: absence is an error; otherwise
 * *out keeps its default. */
static int cfg_int(const cJSON *root, const char *key, int required, long lo, long hi,
                   const char *path, int *out, char *err)
{
    const cJSON *it = cfg_get(root, key);
    if (!it) {
        if (required) return kr_errf(err, "%s: missing required field \"%s\"", path, key);
        return KR_OK;
    }
    if (!cJSON_IsNumber(it))
        return kr_errf(err, "%s: field \"%s\" must be an integer", path, key);
    double v = it->valuedouble;
    if (!(v == floor(v)) || v < (double)lo || v > (double)hi)
        return kr_errf(err, "%s: field \"%s\" = %g is not an integer in [%ld, %ld]", path, key, v,
                       lo, hi);
    *out = (int)v;
    return KR_OK;
}

/* A positive finite JSON number; absent keeps the default. */
static int cfg_pos_float(const cJSON *root, const char *key, int required, const char *path,
                         float *out, char *err)
{
    const cJSON *it = cfg_get(root, key);
    if (!it) {
        if (required) return kr_errf(err, "%s: missing required field \"%s\"", path, key);
        return KR_OK;
    }
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || it->valuedouble <= 0 ||
        it->valuedouble > 3.0e38)
        return kr_errf(err, "%s: field \"%s\" must be a positive number", path, key);
    *out = (float)it->valuedouble;
    return KR_OK;
}

static int cfg_bool(const cJSON *root, const char *key, const char *path, int *out, char *err)
{
    const cJSON *it = cfg_get(root, key);
    if (!it) return KR_OK;
    if (!cJSON_IsBool(it)) return kr_errf(err, "%s: field \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(it) ? 1 : 0;
    return KR_OK;
}

/* bos/eos: an integer, a list of integers (the first one is kept), or null/absent (-1). */
static int cfg_token_id(const cJSON *root, const char *key, const char *path, int *out, char *err)
{
    const cJSON *it = cfg_get(root, key);
    *out = -1;
    if (!it) return KR_OK;
    if (cJSON_IsArray(it)) {
        it = cJSON_GetArrayItem(it, 0);
        if (!it) return KR_OK; /* an empty list: no such token */
    }
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
        it->valuedouble > 2147483647.0)
        return kr_errf(err, "%s: field \"%s\" must be a non-negative integer or a list of them",
                       path, key);
    *out = (int)it->valuedouble;
    return KR_OK;
}

static int cfg_arch(const cJSON *root, const char *path, kr_config *c, char *err)
{
    const cJSON *archs = cfg_get(root, "architectures");
    const char *name = NULL;
    if (archs) {
        const cJSON *first = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
        if (!cJSON_IsString(first))
            return kr_errf(err, "%s: field \"architectures\" must be a list of class names, e.g. "
                           "[\"LlamaForCausalLM\"]", path);
        name = first->valuestring;
    } else {
        /* Some hand-written configs only give model_type; map the three families we know. */
        const cJSON *mt = cfg_get(root, "model_type");
        if (!cJSON_IsString(mt))
            return kr_errf(err, "%s: missing field \"architectures\" (supported: %s)", path,
                           kr_supported_archs);
        if (strcmp(mt->valuestring, "llama") == 0) name = "LlamaForCausalLM";
        else if (strcmp(mt->valuestring, "mistral") == 0) name = "MistralForCausalLM";
        else if (strcmp(mt->valuestring, "qwen2") == 0) name = "Qwen2ForCausalLM";
        else
            return kr_errf(err, "%s: unsupported model_type \"%.64s\" and no \"architectures\" "
                           "(supported: %s)", path, mt->valuestring, kr_supported_archs);
    }
    if (strcmp(name, "LlamaForCausalLM") == 0) c->arch = KR_ARCH_LLAMA;
    else if (strcmp(name, "MistralForCausalLM") == 0) c->arch = KR_ARCH_MISTRAL;
    else if (strcmp(name, "Qwen2ForCausalLM") == 0) c->arch = KR_ARCH_QWEN2;
    else
        return kr_errf(err, "%s: unsupported architecture \"%.64s\" (supported: %s)", path, name,
                       kr_supported_archs);
    snprintf(c->arch_name, sizeof c->arch_name, "%s", name);
    return KR_OK;
}

static int cfg_rope_scaling(const cJSON *root, const char *path, kr_config *c, char *err)
{
    const cJSON *rs = cfg_get(root, "rope_scaling");
    if (!rs) return KR_OK;
    if (!cJSON_IsObject(rs))
        return kr_errf(err, "%s: field \"rope_scaling\" must be an object or null", path);
    const cJSON *type = cfg_get(rs, "rope_type");
    if (!type) type = cfg_get(rs, "type"); /* the older spelling */
    if (!cJSON_IsString(type))
        return kr_errf(err, "%s: rope_scaling has no \"rope_type\" (supported: \"llama3\")", path);
    if (strcmp(type->valuestring, "default") == 0) return KR_OK; /* plain RoPE */
    if (strcmp(type->valuestring, "llama3") != 0)
        return kr_errf(err, "%s: unsupported rope_scaling type \"%.64s\" (supported: \"llama3\", "
                       "or null for plain RoPE)", path, type->valuestring);
    c->rope_llama3 = 1;
    if (cfg_pos_float(rs, "factor", 1, path, &c->rope_factor, err) ||
        cfg_pos_float(rs, "low_freq_factor", 1, path, &c->rope_low_freq_factor, err) ||
        cfg_pos_float(rs, "high_freq_factor", 1, path, &c->rope_high_freq_factor, err) ||
        cfg_int(rs, "original_max_position_embeddings", 1, 1, KR_CONFIG_MAX_DIM, path,
                &c->rope_original_max_pos, err))
        return -1;
    /* The smooth band divides by (high - low): equal factors would divide by zero. */
    if (!(c->rope_high_freq_factor > c->rope_low_freq_factor))
        return kr_errf(err, "%s: rope_scaling: high_freq_factor (%g) must exceed low_freq_factor "
                       "(%g)", path, c->rope_high_freq_factor, c->rope_low_freq_factor);
    return KR_OK;
}

/* Mistral and Qwen2 may declare a sliding window (transformers' semantics: a query at position p
 * sees keys at positions > p - window; Qwen2 only in layers >= max_window_layers). */
static int cfg_sliding_window(const cJSON *root, const char *path, kr_config *c, char *err)
{
    if (c->arch == KR_ARCH_LLAMA) return KR_OK;
    const cJSON *sw = cfg_get(root, "sliding_window");
    if (!sw) return KR_OK;
    if (c->arch == KR_ARCH_QWEN2) {
        int use = 0, max_window_layers = c->n_layers;
        if (cfg_bool(root, "use_sliding_window", path, &use, err)) return -1;
        if (!use) return KR_OK;
        if (cfg_int(root, "max_window_layers", 0, 0, KR_CONFIG_MAX_DIM, path, &max_window_layers,
                    err))
            return -1;
        /* transformers' Qwen2 applies the window only to layers >= max_window_layers. */
        if (max_window_layers >= c->n_layers) return KR_OK;
        c->sliding_window_first_layer = max_window_layers;
    }
    if (!cJSON_IsNumber(sw))
        return kr_errf(err, "%s: field \"sliding_window\" must be an integer or null", path);
    if (sw->valuedouble < 1 || sw->valuedouble > KR_CONFIG_MAX_DIM ||
        sw->valuedouble != (double)(int)sw->valuedouble)
        return kr_errf(err, "%s: field \"sliding_window\" must be a positive integer or null (got %g)",
                       path, sw->valuedouble);
    c->sliding_window = (int)sw->valuedouble;
    return KR_OK;
}

static int cfg_dtype(const cJSON *root, const char *path, kr_config *c, char *err)
{
    const char *key = "torch_dtype";
    const cJSON *it = cfg_get(root, key);
    if (!it) {
        key = "dtype"; /* transformers >= 4.56 */
        it = cfg_get(root, key);
    }
    c->torch_dtype = KR_DTYPE_F32; /* what transformers assumes when the config says nothing */
    if (!it) return KR_OK;
    const char *s = cJSON_IsString(it) ? it->valuestring : "";
    if (strcmp(s, "bfloat16") == 0) c->torch_dtype = KR_DTYPE_BF16;
    else if (strcmp(s, "float16") == 0) c->torch_dtype = KR_DTYPE_F16;
    else if (strcmp(s, "float32") == 0) c->torch_dtype = KR_DTYPE_F32;
    else
        return kr_errf(err, "%s: field \"%s\" = \"%.32s\" is not supported (bfloat16, float16 or "
                       "float32)", path, key, s);
    return KR_OK;
}

int kr_config_check(const kr_config *c, const char *path, char *err)
{
    const struct { const char *name; int v; } sizes[] = {
        {"vocab_size", c->vocab_size},
        {"hidden_size", c->hidden_size},
        {"intermediate_size", c->intermediate_size},
        {"num_hidden_layers", c->n_layers},
        {"num_attention_heads", c->n_heads},
        {"num_key_value_heads", c->n_kv_heads},
        {"head_dim", c->head_dim},
        {"max_position_embeddings", c->max_position_embeddings},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (sizes[i].v <= 0 || sizes[i].v > KR_CONFIG_MAX_DIM)
            return kr_errf(err, "%s: \"%s\" = %d must be in [1, %d]", path, sizes[i].name,
                           sizes[i].v, KR_CONFIG_MAX_DIM);
    if (c->n_heads % c->n_kv_heads != 0)
        return kr_errf(err, "%s: num_attention_heads (%d) is not divisible by "
                       "num_key_value_heads (%d)", path, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return kr_errf(err, "%s: head_dim (%d) must be even for rotary embeddings", path,
                       c->head_dim);
    if ((int64_t)c->n_heads * c->head_dim > KR_CONFIG_MAX_DIM)
        return kr_errf(err, "%s: num_attention_heads * head_dim (%d * %d) is too large", path,
                       c->n_heads, c->head_dim);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
        return kr_errf(err, "%s: rope_theta must be positive", path);
    if (!(c->rms_norm_eps > 0) || !isfinite(c->rms_norm_eps))
        return kr_errf(err, "%s: rms_norm_eps must be positive", path);
    if (c->rope_llama3 && (!(c->rope_factor > 0) || !(c->rope_high_freq_factor >
                           c->rope_low_freq_factor) || !(c->rope_low_freq_factor > 0) ||
                           c->rope_original_max_pos <= 0))
        return kr_errf(err, "%s: rope_scaling llama3 parameters are invalid", path);
    if (c->torch_dtype != KR_DTYPE_F32 && c->torch_dtype != KR_DTYPE_F16 &&
        c->torch_dtype != KR_DTYPE_BF16)
        return kr_errf(err, "%s: torch_dtype is not one of bf16, f16, f32", path);
    return KR_OK;
}

static int cfg_from_json(const cJSON *root, const char *path, kr_config *c, char *err)
{
    if (!cJSON_IsObject(root)) return kr_errf(err, "%s: config must be a JSON object", path);
    if (cfg_arch(root, path, c, err)) return -1;

    const long max = KR_CONFIG_MAX_DIM;
    if (cfg_int(root, "vocab_size", 1, 1, max, path, &c->vocab_size, err) ||
        cfg_int(root, "hidden_size", 1, 1, max, path, &c->hidden_size, err) ||
        cfg_int(root, "intermediate_size", 1, 1, max, path, &c->intermediate_size, err) ||
        cfg_int(root, "num_hidden_layers", 1, 1, max, path, &c->n_layers, err) ||
        cfg_int(root, "num_attention_heads", 1, 1, max, path, &c->n_heads, err))
        return -1;
    c->n_kv_heads = c->n_heads;
    if (cfg_int(root, "num_key_value_heads", 0, 1, max, path, &c->n_kv_heads, err)) return -1;
    c->head_dim = 0;
    if (cfg_int(root, "head_dim", 0, 1, max, path, &c->head_dim, err)) return -1;
    if (c->head_dim == 0) {
        if (c->hidden_size % c->n_heads != 0)
            return kr_errf(err, "%s: no \"head_dim\" and hidden_size (%d) is not divisible by "
                           "num_attention_heads (%d)", path, c->hidden_size, c->n_heads);
        c->head_dim = c->hidden_size / c->n_heads;
    }
    /* transformers' class defaults */
    c->max_position_embeddings = c->arch == KR_ARCH_LLAMA ? 2048 : c->arch == KR_ARCH_MISTRAL
                                 ? 4096 * 32 : 32768;
    if (cfg_int(root, "max_position_embeddings", 0, 1, max, path, &c->max_position_embeddings,
                err))
        return -1;
    c->rope_theta = 10000.0f;
    c->rms_norm_eps = 1e-6f;
    if (cfg_pos_float(root, "rope_theta", 0, path, &c->rope_theta, err) ||
        cfg_pos_float(root, "rms_norm_eps", 0, path, &c->rms_norm_eps, err))
        return -1;
    if (cfg_rope_scaling(root, path, c, err)) return -1;

    /* Qwen2 always has q/k/v biases; Llama only with attention_bias; Mistral never. */
    c->attn_bias = c->arch == KR_ARCH_QWEN2;
    if (c->arch == KR_ARCH_LLAMA && cfg_bool(root, "attention_bias", path, &c->attn_bias, err))
        return -1;
    int mlp_bias = 0;
    if (cfg_bool(root, "mlp_bias", path, &mlp_bias, err)) return -1;
    if (mlp_bias) return kr_errf(err, "%s: \"mlp_bias\": true is not supported", path);
    const cJSON *act = cfg_get(root, "hidden_act");
    if (act && !(cJSON_IsString(act) && strcmp(act->valuestring, "silu") == 0))
        return kr_errf(err, "%s: \"hidden_act\" = \"%.32s\" is not supported (only \"silu\")",
                       path, cJSON_IsString(act) ? act->valuestring : "?");
    c->tie_word_embeddings = 0;
    if (cfg_bool(root, "tie_word_embeddings", path, &c->tie_word_embeddings, err)) return -1;
    if (cfg_token_id(root, "bos_token_id", path, &c->bos_token_id, err) ||
        cfg_token_id(root, "eos_token_id", path, &c->eos_token_id, err))
        return -1;
    if (cfg_dtype(root, path, c, err)) return -1;
    if (cfg_sliding_window(root, path, c, err)) return -1;
    return kr_config_check(c, path, err);
}

int kr_config_parse(const char *json, size_t len, const char *path, kr_config *out, char *err)
{
    if (!path) path = "config.json";
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t at = end && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return kr_errf(err, "%s: invalid JSON near byte %zu", path, at);
    }
    kr_config c;
    memset(&c, 0, sizeof c);
    int rc = cfg_from_json(root, path, &c, err);
    cJSON_Delete(root);
    if (rc) return -1;
    *out = c;
    return KR_OK;
}

int kr_config_load(const char *dir, kr_config *out, char *err)
{
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/config.json", dir) >= sizeof path)
        return kr_errf(err, "%s: path too long", dir);
    char *text;
    size_t len;
    if (kr_read_file(path, &text, &len, err)) return -1;
    int rc = kr_config_parse(text, len, path, out, err);
    free(text);
    return rc;
}
