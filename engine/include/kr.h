/*
 * kr.h - the kvrelay engine: the one public header of engine/, alone in engine/include/ so that
 * a program linking kr_engine sees nothing else (the headers in engine/ are its internals).
 *
 * What it is: Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2) loaded from
 * safetensors, their tokenizer.json, a paged KV cache (a pool of blocks; per sequence a block
 * list per (layer, KV head)), chunked prefill and decode on a backend, and a sampler.
 * What it is not: anything about networks, processes or requests (see DESIGN.md section 3).
 *
 * Conventions: functions return 0 (KR_OK) on success and -1 on failure; on failure they write a
 * message into `err` (KR_ERR_MAX bytes, may be NULL) that names the file, tensor or field at
 * fault, and leave their outputs untouched. Output arguments come last. An object made by
 * `*_create`/`*_load` is released by the matching `*_free`, which accepts NULL.
 */
#ifndef KR_H
#define KR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KR_OK 0
#define KR_ERR_MAX 512

/* ------------------------------------------------------------------ dtypes and config */

typedef enum kr_dtype {
    KR_DTYPE_F32 = 0,
    KR_DTYPE_F16 = 1,
    KR_DTYPE_BF16 = 2,
} kr_dtype;

const char *kr_dtype_name(kr_dtype t);
size_t kr_dtype_size(kr_dtype t);
/* n elements of dtype t at src -> float32 at dst: exact. */
void kr_dtype_to_f32(kr_dtype t, const void *src, size_t n, float *dst);
/* n float32 elements at src -> dtype t at dst, rounded to nearest even (bf16, IEEE f16 with
 * subnormals); NaN stays NaN, overflow becomes infinity. For rows of a KV pool's dtype
 * (kr_list_rows_fn, kr_list_fill_fn). */
void kr_dtype_from_f32(kr_dtype t, const float *src, size_t n, void *dst);

typedef enum kr_arch {
    KR_ARCH_LLAMA = 0, /* LlamaForCausalLM */
    KR_ARCH_MISTRAL = 1, /* MistralForCausalLM */
    KR_ARCH_QWEN2 = 2, /* Qwen2ForCausalLM */
} kr_arch;

/* Immutable model shape, from config.json. */
typedef struct kr_config {
    kr_arch arch;
    char arch_name[64]; /* as written in config.json "architectures"[0] */
    int vocab_size;
    int hidden_size; /* d */
    int intermediate_size; /* f */
    int n_layers;
    int n_heads; /* query heads */
    int n_kv_heads; /* KV heads; n_heads % n_kv_heads == 0 */
    int head_dim; /* config "head_dim", else hidden_size / n_heads */
    int max_position_embeddings;
    float rope_theta;
    float rms_norm_eps;
    /* llama3 rope_scaling ("rope_type": "llama3"); rope_llama3 == 0 means no scaling */
    int rope_llama3;
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int rope_original_max_pos;
    /* Sliding-window attention (Mistral "sliding_window"; Qwen2 with use_sliding_window for
     * layers >= max_window_layers): a query at position p sees keys at positions > p - window.
     * 0: full causal attention in every layer. */
    int sliding_window;
    int sliding_window_first_layer; /* layers >= this one use the window */
    int attn_bias; /* q/k/v projections carry biases (Qwen2, or "attention_bias": true) */
    int tie_word_embeddings; /* lm_head is embed_tokens */
    int bos_token_id; /* -1 when absent */
    int eos_token_id; /* -1 when absent; the first one when config gives a list */
    kr_dtype torch_dtype; /* what config.json says the weights are */
} kr_config;

/* Parses a config.json text (`path` is only used in messages). */
int kr_config_parse(const char *json, size_t len, const char *path, kr_config *out, char *err);
/* Reads and parses DIR/config.json. */
int kr_config_load(const char *dir, kr_config *out, char *err);

/* ------------------------------------------------------------------ model */

typedef struct kr_model kr_model;

typedef struct kr_model_opts {
    /* Convert bf16/f16 matrices to f32 at load (more memory, no per-use conversion). 0: keep
     * the checkpoint's dtype, memory-mapped. */
    int weights_f32;
    /* Print progress lines to stderr while loading. */
    int verbose;
} kr_model_opts;

/* Loads DIR/config.json and DIR/model.safetensors or DIR/model.safetensors.index.json with its
 * shards. Weights stay memory-mapped until kr_model_free. `opts` may be NULL. */
int kr_model_load(const char *dir, const kr_model_opts *opts, kr_model **out, char *err);
/* A model of shape `cfg` with random weights of dtype `dtype` (seeded, deterministic): for
 * benchmarks of shapes that have no checkpoint. */
int kr_model_random(const kr_config *cfg, kr_dtype dtype, uint64_t seed, kr_model **out, char *err);
void kr_model_free(kr_model *m);
const kr_config *kr_model_config(const kr_model *m);
/* The dtype the large matrices are held in memory. */
kr_dtype kr_model_weight_dtype(const kr_model *m);
/* Bytes of all weights as held in memory. */
size_t kr_model_weight_bytes(const kr_model *m);
/* A hex digest identifying config + weights (same checkpoint => same string). 16 hex chars. */
const char *kr_model_fingerprint(const kr_model *m);

/* ------------------------------------------------------------------ tokenizer */

typedef struct kr_tokenizer kr_tokenizer;

/* Loads DIR/tokenizer.json (and DIR/tokenizer_config.json when present, for bos/eos and
 * add_bos_token). Supports byte-level BPE (Llama 3, Qwen2 with NFC) and sentencepiece-style
 * BPE with byte fallback (Llama 2, Mistral). */
int kr_tokenizer_load(const char *dir, kr_tokenizer **out, char *err);
void kr_tokenizer_free(kr_tokenizer *t);
/* Encodes UTF-8 `text` (`len` bytes). Added/special tokens in the text are matched as such.
 * With add_special, the BOS is prepended when the tokenizer's config says so.
 * On success *ids_out is malloc'd (caller frees) and *n_out set. Invalid UTF-8 is an error. */
int kr_tokenizer_encode(const kr_tokenizer *t, const char *text, size_t len, int add_special,
                        int32_t **ids_out, int *n_out, char *err);
/* Decodes ids to UTF-8 text (malloc'd, NUL-terminated, caller frees). Special tokens are
 * skipped when skip_special. Ids out of range are an error. */
int kr_tokenizer_decode(const kr_tokenizer *t, const int32_t *ids, int n, int skip_special,
                        char **text_out, char *err);
int kr_tokenizer_n_vocab(const kr_tokenizer *t); /* highest id + 1 */
int kr_tokenizer_bos(const kr_tokenizer *t); /* -1 when none */
int kr_tokenizer_eos(const kr_tokenizer *t); /* -1 when none */
int kr_tokenizer_is_special(const kr_tokenizer *t, int32_t id);
/* The bytes token `id` adds to decoded text (after the per-token decoders; a byte-fallback
 * <0xXX> token: its one byte), for code that must know what each token spells (grammars). They
 * point into the tokenizer, valid until kr_tokenizer_free. Not applied: the stream steps that
 * only drop leading spaces of the whole text (Strip, Metaspace's first space), and the joining
 * of byte-fallback runs that are not valid UTF-8 into U+FFFD. Special tokens give their string.
 * -1 for an id out of range or without a token. */
int kr_tokenizer_token_bytes(const kr_tokenizer *t, int32_t id, const char **bytes, size_t *len);

/* Incremental detokenizer: feed ids one at a time, get back only text that is final and valid
 * UTF-8 (a multi-byte character split over tokens is held back until complete). The
 * concatenation of all deltas plus kr_detok_flush equals kr_tokenizer_decode of all ids. */
typedef struct kr_detok kr_detok;
int kr_detok_create(const kr_tokenizer *t, int skip_special, kr_detok **out, char *err);
void kr_detok_free(kr_detok *d);
/* On success *delta points into the detokenizer's own buffer (valid until the next call) and
 * *delta_len is its length (possibly 0). */
int kr_detok_push(kr_detok *d, int32_t id, const char **delta, size_t *delta_len, char *err);
/* Whatever is held back (an incomplete character becomes U+FFFD, as HF decode does). */
int kr_detok_flush(kr_detok *d, const char **delta, size_t *delta_len);

/* ------------------------------------------------------------------ KV cache */

/* A fixed pool of blocks. A block holds `block_size` entries of one (layer, KV head): keys
 * (post-RoPE), values and each entry's position. The pool is what admission reasons about.
 * Keys and values are stored in `dtype` (f32, bf16 or f16): a forward computes them in float32
 * and rounds them to nearest even when it stores them; attention widens them exactly.
 * Threads may share a pool: taking and returning blocks is serialized inside it, so one thread
 * may fill a new sequence (kr_seq_create, kr_seq_list_fill) while another decodes others; each
 * sequence is used by one thread at a time. */
typedef struct kr_kv_pool kr_kv_pool;
int kr_kv_pool_create(int head_dim, int block_size, int n_blocks, kr_dtype dtype, kr_kv_pool **out,
                      char *err);
void kr_kv_pool_free(kr_kv_pool *p);
kr_dtype kr_kv_pool_dtype(const kr_kv_pool *p);
int kr_kv_pool_block_size(const kr_kv_pool *p);
int kr_kv_pool_n_blocks(const kr_kv_pool *p);
int kr_kv_pool_n_free(const kr_kv_pool *p);
/* Blocks a sequence of `n_tokens` entries in every (layer, KV head) needs. */
int kr_kv_blocks_for(const kr_kv_pool *p, int n_layers, int n_kv_heads, int n_tokens);

/* Per-sequence KV state: a block list per (layer, KV head), lengths may differ per head. */
typedef struct kr_seq kr_seq;
int kr_seq_create(kr_kv_pool *pool, int n_layers, int n_kv_heads, kr_seq **out, char *err);
/* Returns every block to the pool. */
void kr_seq_free(kr_seq *s);
/* Position the next token fed to this sequence gets (tokens fed so far). */
int kr_seq_next_pos(const kr_seq *s);
/* Entries held by (layer, KV head). */
int kr_seq_len(const kr_seq *s, int layer, int kv_head);
/* Entries summed over every (layer, KV head). */
int64_t kr_seq_entries(const kr_seq *s);
/* Blocks held. */
int kr_seq_blocks(const kr_seq *s);

/* The KV footprint of Cache Me If You Can: entries each query token attended to, summed over
 * every query step of prefill and decode and over (layer, KV head), against what full causal
 * attention would have attended; footprint = attended / full. Plus the peak KV held. */
typedef struct kr_footprint {
    double attended;
    double full;
    int64_t steps; /* query steps: tokens fed */
    int64_t peak_entries; /* most entries held at once, summed over (layer, KV head) */
    int64_t peak_head_entries; /* most entries one (layer, KV head) held at any moment */
} kr_footprint;
void kr_seq_footprint(const kr_seq *s, kr_footprint *out);

/* ------------------------------------------------------------------ KV policies */

/* An eviction policy (docs/policies.md): "full", or "name:key=value,..." e.g.
 * "streaming:sink=4,window=1024". Parsed and validated against the model's shape; immutable
 * and shareable between sequences. */
typedef struct kr_policy kr_policy;
int kr_policy_parse(const char *spec, const kr_config *cfg, kr_policy **out, char *err);
void kr_policy_free(kr_policy *p);
/* The spec with every default filled in: what actually runs. */
const char *kr_policy_spec(const kr_policy *p);
/* The policy families ("full", "streaming", ...): how many, the name of family i (0 <= i <
 * kr_policy_n_families()), and the family of a parsed policy (for per-family metrics). */
int kr_policy_n_families(void);
const char *kr_policy_family_name(int i);
int kr_policy_family(const kr_policy *p);
/* Most entries one (layer, KV head) holds after prefilling n_prompt tokens and at any moment of
 * generating n_generate more, the entry a decode step adds before its trim included (for
 * reserving blocks). */
int kr_policy_max_entries(const kr_policy *p, int n_prompt, int n_generate);
/* Observer rows the policy appends to each prefill chunk but the last (patched chunked
 * eviction, TAKE's probe): a list briefly holds that many entries more than the chunk adds. */
int kr_policy_appended(const kr_policy *p, int n_prompt);
/* Attaches a policy to a sequence before its first token and before kr_seq_set_next_pos (NULL:
 * full attention) and gives every list the decode rule the policy starts it with (a prefill
 * may refine it). The policy must outlive the sequence. */
int kr_seq_set_policy(kr_seq *s, const kr_policy *p, char *err);

/* ------------------------------------------------------------------ forward */

typedef enum kr_backend_kind {
    KR_BACKEND_CPU = 0,
    KR_BACKEND_CUDA = 1,
} kr_backend_kind;

/* The instruction set of the CPU kernels this process runs: "avx512bf16" (AVX-512 with its bf16
 * dot products), "avx512", "avx2" or "base" (plain C), the best this CPU has, picked when the program loads, or what KR_CPU_ISA asked for. */
const char *kr_cpu_isa(void);
/* One line for a program's --help: the CPU kernels this process runs and how to choose others. */
const char *kr_cpu_isa_help(void);

/* Execution context: a model on a backend with scratch buffers sized once for `max_chunk`
 * tokens and a thread pool. Not thread-safe: one caller at a time. */
typedef struct kr_ctx kr_ctx;
/* The dtype of the KV pools kr_ctx_kv_pool_create makes. */
typedef enum kr_kv_dtype {
    KR_KV_DTYPE_AUTO = 0, /* the weights' dtype (kr_model_weight_dtype) where the backend can store
                           * it, else f32: a bf16 checkpoint gets a bf16 cache on the CPU */
    KR_KV_DTYPE_F32 = 1,
    KR_KV_DTYPE_F16 = 2,
    KR_KV_DTYPE_BF16 = 3,
} kr_kv_dtype;
typedef struct kr_ctx_params {
    kr_backend_kind backend;
    int n_threads; /* <= 0: all online CPUs */
    int max_chunk; /* most tokens one kr_forward call takes; <= 0: 512 */
    kr_kv_dtype kv_dtype; /* a backend that cannot store the dtype asked for fails kr_ctx_create
                           * (the CUDA backend stores f32 only) */
} kr_ctx_params;

int kr_ctx_create(const kr_model *m, const kr_ctx_params *p, kr_ctx **out, char *err);
void kr_ctx_free(kr_ctx *c);
int kr_ctx_n_threads(const kr_ctx *c);
/* The KV cache dtype of the context's pools: kr_ctx_params.kv_dtype with auto resolved. */
kr_dtype kr_ctx_kv_dtype(const kr_ctx *c);
/* kr_kv_pool_create for the context's model (its head_dim) in the context's KV dtype, in memory
 * the context's backend computes on: host memory on the CPU, CUDA managed memory on the CUDA
 * backend. Pools that a context's kr_forward/kr_prefill use must come from here (a host pool of
 * any dtype on the CPU only; kr_forward refuses a pool whose dtype the backend cannot read). The
 * pool may outlive the context; free it with kr_kv_pool_free. */
int kr_ctx_kv_pool_create(const kr_ctx *c, int block_size, int n_blocks, kr_kv_pool **out, char *err);

typedef enum kr_logits_mode {
    KR_LOGITS_NONE = 0, /* no logits (an intermediate prefill chunk) */
    KR_LOGITS_LAST = 1, /* one row: the last token's */
    KR_LOGITS_ALL = 2, /* one row per token fed */
} kr_logits_mode;

/* Feeds `n` tokens (1 <= n <= max_chunk) at positions next_pos .. next_pos+n-1: appends their
 * keys and values to every (layer, KV head) of `s` and attends causally over everything cached;
 * the decode rule (kr_list_rule below) trims each list after each layer. Logits (float32, rows of
 * vocab_size) go to `logits` as `mode` says. Fails cleanly, leaving the sequence as it was,
 * when the pool has too few free blocks (checked before any work). */
int kr_forward(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, kr_logits_mode mode,
               float *logits, char *err);
/* Chunked prefill: consecutive chunks of at most `chunk` tokens (<= 0: the context's
 * max_chunk); with a policy attached, its observers are appended to chunks and its chunk rule
 * runs after each layer (the full prompt then never needs to fit the pool; a chunk that does
 * not fit fails the call, leaving the sequence with the chunks before it). Without a policy
 * the whole prompt's room is taken first. `logits` gets the last token's row, or every row with
 * KR_LOGITS_ALL. */
int kr_prefill(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, int chunk, kr_logits_mode mode,
               float *logits, char *err);
/* What kr_prefill_layers tells its caller during the prompt's last chunk: layers [0, n_final)
 * are final. n_final = 0 comes only for a sequence without a policy or with one that keeps
 * every entry of the prompt (full), after each chunk before the last: every entry every list
 * holds then is final (positions, K and V rows; later chunks only append, and the decode rule
 * is final with the layer). From this call until kr_prefill_layers returns, no entry, position, pinned count
 * or decode rule of their lists changes: kr_seq_list_shape, kr_seq_list_rule,
 * kr_seq_list_read and kr_seq_list_visit read them as they will be after the prefill, and the
 * cache is readable on the host (a layer-wise pipeline ships them while the later layers
 * compute). Not final yet: kr_seq_next_pos (a pos=rel policy sets it at the last layer) and
 * the footprint tally. The callback must not feed, trim or free the sequence. Return KR_OK to
 * go on, or -1 with a message in err to stop the prefill. */
typedef int (*kr_layers_final_fn)(void *arg, const kr_seq *s, int n_final, char *err);
/* kr_prefill that calls fn (when not NULL) with strictly increasing n_final as leading layers
 * become final in the last chunk (after 0 at each earlier chunk's end for full or no policy), the last call with n_final = the model's n_layers and before
 * the last chunk's logits are computed. A layer is final once its own policy hook ran, except
 * under TAKE's delayed eviction: layers below max(warmup_layers - 1, 0) are pruned by that
 * layer's hook, so the first call comes only after it. When fn fails, kr_prefill_layers
 * returns -1 with fn's message (a default one when fn wrote none); the sequence then holds a
 * partly fed last chunk, an unspecified state fit only for kr_seq_free. */
int kr_prefill_layers(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, int chunk,
                      kr_logits_mode mode, float *logits, kr_layers_final_fn fn, void *arg,
                      char *err);
/* Logits of `rows` consecutive prompt rows from row `first`, rows[rows][vocab] (borrowed for the
 * call). Returns KR_OK to go on, or -1 with a message in err to stop the prefill. */
typedef int (*kr_rows_fn)(void *arg, int first, int rows, const float *logits, char *err);
enum { KR_SCORE_ROWS = 64 }; /* rows per kr_rows_fn call at most */
/* Part of a chunked prefill: prompt tokens [from, to) of tokens[0, n). */
typedef struct kr_prompt_span {
    const int32_t *tokens; /* [n]: the whole prompt */
    int n;
    int from; /* a multiple of chunk: the sequence holds tokens [0, from), fed by earlier spans of
               * this prompt (or, for a prefix-deterministic policy, of any prompt beginning
               * with the same tokens: kr_policy_prefix_deterministic) with the same chunk and
               * pos0, or their kr_seq_copy */
    int to; /* n, or a multiple of chunk above from */
    int chunk; /* <= 0: the context's max_chunk */
    int pos0; /* position of the prompt's first token (the sequence's next position before it) */
    /* Prompt scoring, opt-in (score_fn NULL: nothing is computed and nothing changes). After
     * each chunk's layers the final norm and lm_head are applied to every real row of the chunk,
     * KR_SCORE_ROWS rows at a time into the caller's host buffer score_buf[KR_SCORE_ROWS][vocab],
     * and score_fn(score_arg, first, rows, score_buf) gets the logits of prompt rows
     * [first, first + rows). Each row is bit for bit what kr_forward(..., KR_LOGITS_ALL, ...) of
     * the same chunk gives (kvrelay-logits with the same --chunk), and the logits `mode` asks
     * for are computed as without scoring. A policy's appended observer rows are not scored. */
    kr_rows_fn score_fn;
    void *score_arg;
    float *score_buf;
} kr_prompt_span;
/* kr_prefill_layers over the chunks of one span: the chunks, their positions, observers and
 * policy hooks are exactly those the one-call prefill of the whole prompt runs for these
 * tokens, so spans [0, b) then [b, n) leave the sequence, the logits and the callbacks as
 * kr_prefill_layers of the whole prompt does, bit for bit. Logits (mode) come only from a span
 * that ends the prompt; with KR_LOGITS_ALL row i is prompt token i's. Fails on a span whose
 * ends are not chunk boundaries. */
int kr_prefill_span(kr_ctx *c, kr_seq *s, const kr_prompt_span *sp, kr_logits_mode mode,
                    float *logits, kr_layers_final_fn fn, void *arg, char *err);

/* ------------------------------------------------------------------ batched decode */

/* One decode step for `n` sequences at once (continuous batching): tokens[i] is fed to
 * seqs[i] at its next position. Every weight matrix is applied to the n rows in one backend
 * call; each sequence attends its own cache; each sequence's lists are trimmed by their
 * decode rules as in kr_forward, and its footprint and peak tallies advance as kr_forward's would. logits gets n
 * rows of vocab_size, row i for seqs[i]. The rows are bit-identical to n separate
 * kr_forward(c, seqs[i], &tokens[i], 1, KR_LOGITS_LAST, ...) calls, in any batch order and
 * size (the CPU backend keeps every row on its one-token dot-product path for that: a batch
 * never takes the sgemm path a prefill chunk takes). 1 <= n <= the context's max_chunk; the
 * sequences must be distinct (they may come from different pools), token ids in the
 * vocabulary. Fails cleanly, feeding nothing to any sequence, on bad input or when a pool lacks
 * a block for any of them (every sequence's room is taken first and given back on failure). */
int kr_forward_batch(kr_ctx *c, kr_seq *const *seqs, const int32_t *tokens, int n, float *logits,
                     char *err);

/* ------------------------------------------------------------------ the decode rule
 * One rule trims every (layer, KV head) list after each decode step, whatever the policy
 * (DESIGN.md section 1): the policy chose the list's pinned set and its rule at prefill; decode
 * only applies the rule. The list keeps its pinned entries, with the first `sink` entries added
 * to them (a list shorter than that pins all it holds); the entries after them are the recent
 * window, pruned by the Lazy Pruning paper's Algorithm 1 with S = the pinned count:
 * C = S + window, H = C + slack; when lazy > 0, len > C and len - C >= lazy, the list is cut to
 * C (max_drop 0) or to min(max(len - max_drop, C), H), keeping its S pinned entries and the
 * newest others. lazy 1 with slack and max_drop 0 is the plain rule "pinned + the newest
 * `window`". window -1: never trimmed. rel: after each step the list's entries get positions
 * 0..len-1 (keys re-rotated) and the sequence's next position follows its last layer's first
 * list (the Lazy Pruning paper's eq. 4, streaming's pos=rel). */
typedef struct kr_list_rule {
    int sink; /* >= 0; INT_MAX pins every entry (a dense head whose pinned set is the list) */
    int window; /* >= 0 entries besides the pinned ones, or -1: never trimmed */
    int lazy; /* R >= 0; 0 never prunes */
    int slack; /* >= 0 */
    int max_drop; /* >= 0; 0 cuts straight to C */
    int rel; /* 0 or 1 */
} kr_list_rule;

/* The rule of list (layer, kv_head): what kr_seq_set_policy and kr_prefill left there (a
 * sequence without a policy: never trimmed). Out of range: the never-trimmed rule. */
void kr_seq_list_rule(const kr_seq *s, int layer, int kv_head, kr_list_rule *out);
/* Its window alone (-1: never trimmed). */
int kr_seq_list_window(const kr_seq *s, int layer, int kv_head);
/* The window a list of policy p (NULL: full) starts with, before a prefill refines it: the
 * policy's own value, what reservations size for. hsft's is the layer's learned window (a
 * prefill rescales it for the prompt), sage's R + 1 (a sequence's is B + 1 minus the list's
 * pinned count). */
int kr_policy_list_window(const kr_policy *p, int layer, int kv_head);

/* ------------------------------------------------------------------ moving a sequence
 * What the KV bundle carries between processes (kvtransfer/ knows nothing of the engine; the
 * nodes copy through these). A list is [pinned entries | window entries], positions strictly
 * increasing; keys post-RoPE; with each list its decode rule. kr_seq_list_read and
 * kr_seq_list_append copy float32 rows (converted from and to the pool's dtype: a float32 row
 * appended to a bf16 or f16 pool is rounded); kr_seq_list_visit and kr_seq_list_fill hand out
 * the rows in place, in the pool's dtype.
 *
 * The receiver, in this order: kr_seq_create; one kr_seq_list_append per list, in any order (a
 * list's entries may also come in several calls; or kr_seq_list_fill, or kr_seq_list_adopt of a
 * run of blocks the rows were received into) and its kr_seq_list_set_rule;
 * kr_seq_set_next_pos with the sender's kr_seq_next_pos; then decode. No policy is needed:
 * decode applies the lists' rules. Decoding then gives logits bit-identical to continuing in
 * the sender (the sender having ended with kr_prefill, as a prefill node does). */

/* Entries held and pinned by list (layer, kv_head); 0 and 0 for a list that does not exist.
 * Either pointer may be NULL. */
void kr_seq_list_shape(const kr_seq *s, int layer, int kv_head, int *len, int *pinned);
/* Copies entries [first, first + n) of list (layer, kv_head): positions, keys and values rows
 * of head_dim floats, widened from the pool's dtype (any of the three may be NULL). Fails when
 * the range is outside the list. */
int kr_seq_list_read(const kr_seq *s, int layer, int kv_head, int first, int n, int32_t *pos,
                     float *k, float *v, char *err);
/* Appends n >= 0 entries (float32 rows, rounded to the pool's dtype) to list (layer, kv_head)
 * of a sequence that has not been fed a token nor closed by kr_seq_set_next_pos, taking blocks
 * for this list from the sequence's pool (all or nothing: when the pool runs out the list is
 * left as it was); positions must be >= 0, strictly increasing and above the list's last; then
 * pins the first `pinned` entries of the list (0 <= pinned <= the list's new length; what
 * kr_seq_list_shape reported at the sender). */
int kr_seq_list_append(kr_seq *s, int layer, int kv_head, int n, const int32_t *pos,
                       const float *k, const float *v, int pinned, char *err);
/* Rows of one run of consecutive entries of a list, in place in the pool's blocks: entries
 * [first, first + n), positions [n], keys and values [n][head_dim] elements of `dtype` (the
 * pool's), contiguous. Return 0 to go on; any other value stops the walk and is returned (write
 * `err` then). */
typedef int (*kr_list_rows_fn)(void *arg, int first, int n, const int32_t *pos, kr_dtype dtype,
                               const void *k, const void *v, char *err);
/* Calls fn over entries [first, first + n) of list (layer, kv_head) in order, one call per
 * block they span: what a sender copies from, with no copy of its own. Fails like
 * kr_seq_list_read. */
int kr_seq_list_visit(const kr_seq *s, int layer, int kv_head, int first, int n,
                      kr_list_rows_fn fn, void *arg, char *err);
/* The slots of one run of appended entries (first counts from the first appended one): fn
 * writes n positions and n key and value rows of head_dim elements of `dtype` (the pool's)
 * there (kr_dtype_from_f32 rounds float32 rows). */
typedef int (*kr_list_fill_fn)(void *arg, int first, int n, int32_t *pos, kr_dtype dtype, void *k,
                               void *v, char *err);
/* kr_seq_list_append where the caller writes the rows into the blocks itself: takes blocks for
 * n more entries, calls fn once per block they span, then checks the positions as
 * kr_seq_list_append does; when fn or a check fails the list is left as it was. */
int kr_seq_list_fill(kr_seq *s, int layer, int kv_head, int n, int pinned, kr_list_fill_fn fn,
                     void *arg, char *err);
/* Receiving a list without copying it: the rows go straight into a run of consecutive blocks,
 * which the list then owns. Slot j of block first + b is row b * block_size + j of the run, so
 * the key rows of a run are one array [n * block_size][head_dim] of the pool's dtype, and so are
 * the values and the positions [n * block_size].
 * Takes n >= 1 consecutive free blocks, ids *first .. *first + n - 1, the lowest such run, all or
 * nothing: returns -1 (taking nothing) when the pool has no free run of n blocks. Thread-safe as
 * taking single blocks is. The blocks are the caller's until kr_kv_pool_give_run or
 * kr_seq_list_adopt. */
int kr_kv_pool_take_run(kr_kv_pool *p, int n, int32_t *first);
/* Returns blocks first .. first + n - 1 (taken, owned by no list) to the pool (n 0: nothing).
 * Refuses (-1, the pool unchanged) a run that is not inside the pool or holds a free block: a
 * run given back twice is a bug of the caller's, which the sanitizer build stops at with an
 * assertion instead. */
int kr_kv_pool_give_run(kr_kv_pool *p, int32_t first, int n);
/* Where the rows of the run that starts at block `first` lie: keys and values [n *
 * block_size][head_dim] of the pool's dtype, positions [n * block_size]; the caller writes them
 * before kr_seq_list_adopt. */
void kr_kv_pool_run_rows(const kr_kv_pool *p, int32_t first, void **k, void **v, int32_t **pos);
/* Appends to list (layer, kv_head) of s, which must be open as for kr_seq_list_append and whose
 * entries (if any) fill its blocks exactly, the n blocks first .. first + n - 1 (taken by
 * kr_kv_pool_take_run, owned by nobody else), whose slots 0 .. len - 1 already hold the new
 * entries' positions, keys and values in order: the list owns the blocks from then on (its
 * entries grow by len; `pinned` is its pinned count after, as for kr_seq_list_fill), grows, trims
 * and returns them to the pool like blocks it took itself. n must be ceil(len / block_size) (n 0
 * with len 0: only `pinned` is set). Fails (-1, message in err) without taking ownership when
 * the list does not exist, is closed or ends inside a block, n does not match len, pinned is
 * below the list's pinned count or above its new length, a block is outside the pool or free, or
 * the positions are not >= 0 and strictly increasing after the list's last one; the caller then
 * still owns the blocks (kr_kv_pool_give_run). */
int kr_seq_list_adopt(kr_seq *s, int layer, int kv_head, int32_t first, int n, int len, int pinned,
                      char *err);
/* Sets the decode rule of list (layer, kv_head) (what kr_seq_list_rule reported at the
 * sender), under the same conditions as kr_seq_list_append; fails naming the field out of
 * range. A later kr_seq_set_policy replaces it. */
int kr_seq_list_set_rule(kr_seq *s, int layer, int kv_head, const kr_list_rule *rule, char *err);
/* After the lists are filled: the position the next token is fed at (above every position
 * held; only before the sequence's first token). It closes the lists to kr_seq_list_append and
 * kr_seq_list_set_rule and the sequence to kr_seq_set_policy. The receiver's footprint tally
 * starts at zero (the sender reports its own part). */
int kr_seq_set_next_pos(kr_seq *s, int next_pos, char *err);
/* An upper bound on the blocks a sequence holds at any moment (inside decode steps included)
 * when it arrives through kr_seq_list_append with at most kr_policy_max_entries(p, n_prompt, 0)
 * entries in each list, under policy p (NULL: full), and then decodes n_generate tokens (tokens
 * fed: kr_forward / kr_forward_batch calls): what a decode node reserves. -1 on bad arguments
 * (negative counts, p parsed for another shape). */
int64_t kr_seq_blocks_bound(const kr_kv_pool *pool, const kr_policy *p, int n_layers,
                            int n_kv_heads, int n_prompt, int n_generate);
/* The blocks one list can hold at any moment (inside decode steps included) when it arrives
 * with `count` entries, the first `pinned` pinned, and decodes n_generate tokens under `rule`,
 * whatever the policy: its peak entry count is max(count + 1, max(pinned, sink) + window +
 * lazy) when the rule trims within those steps (spanning block_size - 1 more slots, as
 * kr_seq_blocks_bound counts for windowed lists), count + n_generate when it never does. What
 * a decode node checks a bundle's rules against. -1 on bad arguments (a rule field out of
 * kr_seq_list_set_rule's range, pinned outside 0..count, negative counts). */
int64_t kr_list_rule_blocks_bound(const kr_kv_pool *pool, const kr_list_rule *rule, int count, int pinned,
                                  int n_generate);

/* ------------------------------------------------------------------ copying a sequence
 * What a prefix cache keeps (engine/seq-copy.c): a sequence's state between prefill spans, to
 * continue it later, once or many times, as if it had never stopped. */

/* A copy of src in `pool` (its head_dim and KV dtype must be src's pool's; any block size):
 * every list's entries (positions, key and value rows exactly as stored), pinned count and
 * decode rule, the next position, the footprint tally and whether it is closed. The copy gets
 * policy p (NULL: none), which must be parsed for the sequence's shape and, to continue a
 * prefill, have src's policy's canonical spec; src's own policy is not referenced, so a copy
 * may outlive it. All or nothing: fails, taking no block, when `pool` lacks blocks (each list
 * takes ceil(len / block_size)), or when src's policy or p keeps per-sequence state (TAKE's
 * accumulated probe, HS-SFT's rescaled windows), which a copy cannot carry. */
int kr_seq_copy(const kr_seq *src, kr_kv_pool *pool, const kr_policy *p, kr_seq **out, char *err);
/* 1 when policy p (NULL: full attention) is prefix-deterministic at chunk boundaries: the state
 * a prefill leaves after a chunk that is not the prompt's last depends only on the prompt's
 * tokens up to that chunk's end and the chunk size, never on the tokens after it or on the
 * prompt's length. Then a copy of that state continues (kr_prefill_span) any prompt that begins
 * with those tokens exactly as prefilling it from scratch would. docs/prefix-cache.md says
 * which families are and why. */
int kr_policy_prefix_deterministic(const kr_policy *p);

/* ------------------------------------------------------------------ sampler */

typedef struct kr_sampling {
    int greedy; /* argmax, lowest id on ties; ignores the rest */
    float temperature; /* <= 0 means greedy */
    int top_k; /* <= 0: off */
    float top_p; /* >= 1 or <= 0: off */
    uint64_t seed;
} kr_sampling;

/* Fills the defaults: greedy off, temperature 1, top_k off, top_p 1, seed 0. */
void kr_sampling_default(kr_sampling *s);
/* Validates ranges; message names the bad field. */
int kr_sampling_check(const kr_sampling *s, char *err);

typedef struct kr_sampler kr_sampler;
int kr_sampler_create(const kr_sampling *s, int vocab_size, kr_sampler **out, char *err);
void kr_sampler_free(kr_sampler *sp);
/* Draws a token id from a row of logits. Does not allocate. */
int32_t kr_sampler_sample(kr_sampler *sp, const float *logits);

/* Penalties on a row of logits before the sampler sees it, over the tokens a sequence has seen
 * (vLLM's and OpenAI's definitions; docs/openai.md). For a token with c occurrences in the
 * output so far and l its logit: when it occurs in the prompt or the output, l becomes l / r if
 * l > 0 and l * r otherwise (r = repetition); then l -= frequency * c, and l -= presence once
 * when c > 0. Tokens never seen keep their logit. */
typedef struct kr_penalties {
    float repetition; /* (0, 100]; 1 = off */
    float presence; /* [-2, 2]; 0 = off */
    float frequency; /* [-2, 2]; 0 = off */
} kr_penalties;

/* Fills the defaults: all off (1, 0, 0). */
void kr_penalties_default(kr_penalties *p);
/* Validates ranges; the message names the field ("repetition_penalty", ...). */
int kr_penalties_check(const kr_penalties *p, char *err);
/* 1 when any penalty is on. */
int kr_penalties_active(const kr_penalties *p);

/* What the penalties count for one sequence: per-token output counts and the seen set, sized
 * for the vocabulary at creation (kr_penalty_apply and kr_penalty_add do not allocate). */
typedef struct kr_penalty_state kr_penalty_state;
/* The state for penalties p over `vocab` ids, the prompt's n_prompt ids counted as seen (they
 * matter to the repetition penalty only). Prompt ids outside [0, vocab) are an error. The caller
 * frees *out with kr_penalty_free. */
int kr_penalty_create(const kr_penalties *p, int vocab, const int32_t *prompt, int n_prompt,
                      kr_penalty_state **out, char *err);
void kr_penalty_free(kr_penalty_state *s);
/* One more output token; an id outside the vocabulary is ignored. */
void kr_penalty_add(kr_penalty_state *s, int32_t id);
/* out = the penalized copy of logits[vocab] (out may be logits). Time: the vocabulary's copy
 * plus the distinct tokens seen. */
void kr_penalty_apply(const kr_penalty_state *s, const float *logits, float *out);

/* min_tokens' mask: while it is on, EOS and the stop ids cannot be drawn. */
typedef struct kr_draw_mask {
    int on;
    int32_t eos; /* -1 (or outside the vocabulary): none, as with ignore_eos */
    const int32_t *stop; /* [n_stop], ids in the vocabulary */
    int n_stop;
} kr_draw_mask;
/* The row a draw samples from, the same on the prefill node (the first token) and the decode
 * node (every later one): `logits` itself when pen is NULL and the mask is off; else out[vocab],
 * the penalized copy (a plain copy without pen) with -inf at the masked ids. */
const float *kr_draw_row(const kr_penalty_state *pen, const kr_draw_mask *m, const float *logits, int vocab,
                         float *out);

/* The argmax of a row of `vocab` logits, lowest id on ties (what greedy sampling takes). */
int32_t kr_argmax(const float *logits, int vocab);
/* log softmax(logits)[id] at temperature 1: the natural log-probability of `id` under the full
 * distribution, by log-sum-exp with the row's max subtracted, summed in double (finite and
 * <= 0 for any finite row; NaN in, NaN out). The row's argmax goes to *top_id when not NULL.
 * A plain function of the row: equal rows give bit-equal results, which is what lets the
 * cluster's scores equal kvrelay-generate's. Does not allocate. */
float kr_logprob(const float *logits, int vocab, int32_t id, int32_t *top_id);
enum { KR_TOP_LOGPROBS_MAX = 20 }; /* alternatives per row at most (OpenAI's limit) */
/* kr_logprob, and the row's k (0..KR_TOP_LOGPROBS_MAX) most probable ids into ids[k] and their
 * log-probabilities into lps[k], most probable first, lower id first on ties; each value is
 * what kr_logprob gives for that id, bit for bit. k 0: kr_logprob's cost, ids and lps untouched.
 * Time: one pass over the row plus an insertion into k sorted slots per id that beats the
 * k-th. Does not allocate. */
float kr_logprob_top(const float *logits, int vocab, int32_t id, int32_t *top_id, int k, int32_t *ids,
                     float *lps);

/* ------------------------------------------------------------------ chat templates
 * Hugging Face chat templates (tokenizer_config.json "chat_template", Jinja2) rendered by a
 * renderer of the Jinja subset real templates use, with jinja2's whitespace rules as
 * transformers sets them (trim_blocks, lstrip_blocks). docs/chat-templates.md lists the subset
 * and the known differences from jinja2. A compiled template is immutable: renders of one
 * template may run concurrently. */

typedef struct kr_chat_template kr_chat_template;
typedef struct kr_chat_message {
    const char *role; /* NULL renders as None */
    const char *content; /* NULL renders as None */
} kr_chat_message;

/* kr_chat_template_render's status when the template called raise_exception(msg): err is
 * exactly msg (cut to KR_ERR_MAX - 1 bytes), a message for the client. Other failures are -1. */
#define KR_CHAT_RAISED (-2)

/* Compiles template source `src` (NUL-terminated); bos/eos are the strings bound to bos_token
 * and eos_token (NULL: ""). On failure err names the line and column and what is wrong
 * (unterminated tags, unknown filters or tags, bad syntax). Free *out with
 * kr_chat_template_free. */
int kr_chat_template_parse(const char *src, const char *bos, const char *eos, kr_chat_template **out, char *err);
/* The model directory's template: tokenizer_config.json "chat_template" (a string, or a list
 * of {"name", "template"} objects: the one named "default", else the first) with its
 * bos_token/eos_token (strings or {"content": ...}); when the file has none, a built-in
 * template chosen by config.json "model_type": "llama" -> Llama 3 headers, "qwen2" -> ChatML,
 * "mistral" -> Mistral [INST] (bos/eos from tokenizer_config.json when it names them, else the
 * format's own). Any other model type is an error saying the model has no chat template. */
int kr_chat_template_load(const char *model_dir, kr_chat_template **out, char *err);
/* A built-in template by name ("llama3", "chatml", "mistral"); bos/eos NULL: the format's own
 * ("<|begin_of_text|>"/"<|eot_id|>", ""/"<|im_end|>", "<s>"/"</s>"). */
int kr_chat_template_builtin(const char *name, const char *bos, const char *eos, kr_chat_template **out, char *err);
/* Where the template came from, for logs and docs: "tokenizer_config.json", "built-in llama3",
 * "built-in chatml", "built-in mistral", or "template" (kr_chat_template_parse). Static. */
const char *kr_chat_template_source(const kr_chat_template *t);
/* The Jinja source it was compiled from, and its bos_token / eos_token (owned by t). */
const char *kr_chat_template_text(const kr_chat_template *t);
const char *kr_chat_template_bos(const kr_chat_template *t);
const char *kr_chat_template_eos(const kr_chat_template *t);
/* Renders with messages = msgs[0, n) (a list of {"role", "content"} dicts),
 * add_generation_prompt, bos_token and eos_token bound, and tools = documents = None as
 * transformers' apply_chat_template binds them without tools. On success *out is malloc'd and
 * NUL-terminated (caller frees) and *out_len (may be NULL) its length. On failure returns
 * KR_CHAT_RAISED (raise_exception; see above) or -1 with err naming the line and what failed
 * (type errors, undefined values used, output over 16 MiB, more than 1,000,000 loop
 * iterations, 256 MiB of intermediate values); *out is untouched. */
int kr_chat_template_render(const kr_chat_template *t, const kr_chat_message *msgs, int n, int add_generation_prompt,
                            char **out, size_t *out_len, char *err);
void kr_chat_template_free(kr_chat_template *t);
/* ------------------------------------------------------------------ end of chat templates */

#ifdef __cplusplus
}
#endif
#endif /* KR_H */
