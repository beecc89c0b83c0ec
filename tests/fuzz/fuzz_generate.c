/*
 * fuzz_generate.c - fuzz target for the router's Generate RPC as a request reaches it: arbitrary
 * bytes through protobuf-c's GenerateRequest decoder (what gRPC hands the handler), then the
 * router's checks and tokenizing (router/validate.c, with router/policy.c and router/stop.c)
 * against the default model's config and tokenizer (models/kjv-2l128-2k). Every decoded request
 * must be either refused with a status and a message, or accepted within the model's limits:
 * a prompt of 1.. tokens inside the vocabulary and prompt + max_tokens within the context.
 * Run: ctest -R fuzz_generate, or build with -DKR_FUZZ=ON (clang) for libFuzzer.
 */
#include "../../router/adaptive.c"
#include "../../router/auto.c"
#include "../../router/validate.c"
#include "../../router/policy.c"
#include "../../router/stop.c"

#include <stdint.h>

static rt_router router;

static void load_model(void)
{
    const char *dir = KR_SOURCE_DIR "/models/kjv-2l128-2k";
    char err[KR_ERR_MAX];
    snprintf(router.id, sizeof router.id, "fuzz");
    snprintf(router.model_dir, sizeof router.model_dir, "%s", dir);
    if (kr_config_load(dir, &router.cfg, err) != KR_OK || kr_tokenizer_load(dir, &router.tok, err) != KR_OK) {
        fprintf(stderr, "fuzz_generate: %s: %s\n", dir, err);
        abort();
    }
    router.max_tokens_limit = 4096;
    router.max_prompt = (uint32_t)router.cfg.max_position_embeddings;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!router.tok) load_model();
    Kvrelay__V1__GenerateRequest *q = kvrelay__v1__generate_request__unpack(NULL, size, data);
    if (!q) return 0; /* gRPC's handler refuses what does not decode */
    rt_req *r = calloc(1, sizeof *r);
    if (!r) abort();
    r->rt = &router;
    kc_status st = {GRPC_STATUS_OK, ""};
    grpc_status_code code = rt_req_validate(&router, q, r, &st);
    if (code == GRPC_STATUS_OK) {
        if (r->n_prompt < 1 || r->max_tokens < 1 ||
            (int64_t)r->n_prompt + r->max_tokens > router.cfg.max_position_embeddings)
            abort();
        for (int i = 0; i < r->n_prompt; i++)
            if (r->prompt[i] < 0 || r->prompt[i] >= router.cfg.vocab_size) abort();
    } else if (code != st.code || !st.details[0]) {
        abort();
    }
    rt_stop_free(&r->stop);
    kr_detok_free(r->detok);
    free(r->prompt);
    free(r);
    kvrelay__v1__generate_request__free_unpacked(q, NULL);
    return 0;
}
