/*
 * kr-model.h - a loaded model's weights as the engine holds them (the definition behind kr.h's
 * opaque kr_model) and the config check. Filled by model.c (safetensors or random weights),
 * validated by config.c, read by the backends through backend.h. Not installed.
 */
#ifndef KR_MODEL_H
#define KR_MODEL_H

#include "kr.h"

#ifdef __cplusplus /* the CUDA sources include this through backend.h */
extern "C" {
#endif

/* A weight as held in memory: row-major [rows][cols] (1-D tensors: rows == 1). `data` points
 * into a mapping or into an allocation owned by the model. */
typedef struct kr_tensor {
    const void *data;
    kr_dtype dtype;
    int64_t rows;
    int64_t cols;
} kr_tensor;

/* One transformer layer. Linear weights are [out_features][in_features] as HF stores them.
 * Norm weights and biases are always f32 (converted at load). */
typedef struct kr_layer_weights {
    kr_tensor attn_norm; /* [1][d] f32 */
    kr_tensor wq; /* [n_heads*head_dim][d] */
    kr_tensor wk; /* [n_kv_heads*head_dim][d] */
    kr_tensor wv; /* [n_kv_heads*head_dim][d] */
    kr_tensor wo; /* [d][n_heads*head_dim] */
    kr_tensor bq, bk, bv; /* [1][out] f32 when cfg.attn_bias, else data == NULL */
    kr_tensor ffn_norm; /* [1][d] f32 */
    kr_tensor w_gate; /* [f][d] */
    kr_tensor w_up; /* [f][d] */
    kr_tensor w_down; /* [d][f] */
} kr_layer_weights;

struct kr_model {
    kr_config cfg;
    kr_tensor embed; /* [vocab][d] */
    kr_tensor final_norm; /* [1][d] f32 */
    kr_tensor lm_head; /* [vocab][d]; == embed when tied */
    kr_layer_weights *layers; /* [n_layers] */
    kr_dtype weight_dtype; /* dtype of the big matrices in memory */
    size_t weight_bytes;
    char fingerprint[17];
    /* ownership: mappings and allocations released by kr_model_free */
    struct kr_mapping *maps;
    int n_maps;
    void **owned;
    int n_owned;
    int cap_owned;
};

/* Validates a config's sizes and ratios (config.c); `path` names the source in messages. Used by
 * kr_config_parse and by kr_model_random for configs built in code. */
int kr_config_check(const kr_config *cfg, const char *path, char *err);

#ifdef __cplusplus
}
#endif

#endif /* KR_MODEL_H */
