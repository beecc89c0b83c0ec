/*
 * bundle.h - the KV bundle: the one message a prefill node sends a decode node per request,
 * holding the eviction-compressed KV cache after chunked prefill (DESIGN.md section 2). The
 * byte-by-byte format is in docs/bundle.md; this header is the codec's whole API.
 *
 * What it is: an encoder that writes a bundle into a caller-provided buffer in one pass
 * (rows can be streamed straight from KV blocks, no gather copy), a size function so a
 * receiver can reserve exactly, and a parser that validates every byte of a received buffer
 * before handing out a read-only view into it.
 * What it is not: a transport (UCX lives beside it), and it knows nothing of engine/: the API
 * works on plain C data, so the same code runs on both node kinds and in the fuzzer.
 *
 * Conventions: functions return 0 on success and -1 on failure; on failure they write a
 * message starting with "bundle: " into `err` (KT_ERR_MAX bytes, may be NULL) that names the
 * field and the values at fault, and leave their outputs untouched. Nothing here allocates;
 * the only global state is the CRC32C table, built once under pthread_once, so every function
 * is thread-safe on distinct objects.
 * Tests: tests/unit/test_bundle.c, test_bundle_parts.c, tests/fuzz/fuzz_bundle.c (ctest -R
 * bundle).
 */
#ifndef KT_BUNDLE_H
#define KT_BUNDLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KT_ERR_MAX 512

#define KT_BUNDLE_VERSION_MAJOR 2 /* a different major is refused */
/* The highest minor this build writes and reads: 2.1 adds the per-row scale sections of the
 * quantized dtypes, 2.2 the layer segment (a layer-pipelined transfer's parts), 2.3 block-padded
 * rows (kt_bundle_header.block_rows). A whole unpadded bundle of f32, f16 or bf16 is still
 * written as 2.0, byte for byte. */
#define KT_BUNDLE_VERSION_MINOR 3

/* Bounds every field is checked against: generous for real models (Llama 3 405B has 126
 * layers of 8 KV heads of 128), tight enough that no product of them overflows. */
#define KT_BUNDLE_MAX_LAYERS 1024
#define KT_BUNDLE_MAX_KV_HEADS 1024
#define KT_BUNDLE_MAX_HEAD_DIM 4096
#define KT_BUNDLE_MAX_POLICY 1024 /* bytes of the policy spec, UTF-8, no NUL */
#define KT_BUNDLE_MAX_BYTES ((uint64_t)1 << 38) /* 256 GiB: a bundle is never larger */
/* Bytes a layer segment can take beyond its layers' share of the whole bundle (its own header,
 * policy spec and section padding): a receiver of up to S segments reserves S times this more. */
#define KT_BUNDLE_SEGMENT_SLACK 2560
/* Parts a sender may send before the layer segments of the last chunk (the entries of earlier
 * chunks that are final already): a receiver makes room for n_layers plus this many parts. */
#define KT_BUNDLE_MAX_EARLY_PARTS 32
/* kt_bundle_header.block_rows: a block-padded bundle (format 2.3) pads each list to a multiple
 * of 1..this many rows. */
#define KT_BUNDLE_MAX_BLOCK_ROWS 4096
/* kt_bundle_list.window for a list the decode node never trims (a dense head). */
#define KT_BUNDLE_WINDOW_DENSE 0xffffffffu
/* kt_bundle_list.flags: after each decode step the list's positions become 0..count-1 (pos=rel).
 * Every other bit is refused. */
#define KT_BUNDLE_LIST_REL 1u

/* Payload dtype of the K and V rows. The numeric codes are the wire codes. */
typedef enum kt_dtype {
    KT_DTYPE_F32 = 0,
    KT_DTYPE_F16 = 1, /* IEEE binary16 */
    KT_DTYPE_BF16 = 2,
    /* Quantized (format 2.1): one byte per element and one float32 scale per row, that is per
     * (token, KV head) of K and of V: element x travels as q = x / scale, with
     * scale = max|row| / 127 and q rounded to the nearest int8 in [-127, 127] (int8), or
     * scale = max|row| / 448 and q rounded to the nearest fp8 E4M3 (OCP "fn": bias 7, no
     * infinity, 0x7f and 0xff are NaN and never written). Round trip, per element:
     * int8 |x - x'| <= scale / 2 = max|row| / 254; fp8 |x - x'| <= max(|x| / 16,
     * scale / 1024), as 3 mantissa bits round to half a step of 1/8 and subnormals to half of
     * 2^-9 (docs/bundle.md). */
    KT_DTYPE_INT8_TOKEN = 16,
    KT_DTYPE_FP8_E4M3_TOKEN = 17,
} kt_dtype;

/* "f32", "f16", "bf16", "int8+scale", "fp8_e4m3+scale", or "?" */
const char *kt_dtype_name(kt_dtype t);
/* Bytes per element of a supported dtype (1 for the quantized ones, whose scale is per row);
 * 0 for any other code. */
size_t kt_dtype_size(kt_dtype t);
/* 1 for the quantized dtypes (a scale per row), 0 otherwise. */
int kt_dtype_quantized(kt_dtype t);
/* Bytes one K or V row of head_dim elements takes on the wire, its scale included; 0 for an
 * unknown dtype. */
uint64_t kt_dtype_row_bytes(kt_dtype t, uint32_t head_dim);
/* The dtype a user names: "f32", "f16", "bf16", "int8" or "fp8" (also the kt_dtype_name
 * spellings). Returns 0 and sets *out, or -1 for anything else. */
int kt_dtype_parse(const char *s, kt_dtype *out);

/* What a bundle says about the sequence as a whole. Filled by the sender for the writer and
 * by kt_bundle_parse for the receiver. */
typedef struct kt_bundle_header {
    char fingerprint[17]; /* the model's kr_model_fingerprint: 16 lowercase hex chars + NUL */
    uint32_t n_layers; /* 1..KT_BUNDLE_MAX_LAYERS */
    uint32_t n_kv_heads; /* 1..KT_BUNDLE_MAX_KV_HEADS */
    uint32_t head_dim; /* 1..KT_BUNDLE_MAX_HEAD_DIM */
    kt_dtype dtype; /* payload dtype of K and V */
    int32_t first_token; /* the token prefill sampled; >= 0 */
    int32_t prompt_len; /* prompt tokens prefilled; >= 1 */
    int32_t next_pos; /* position the first token is fed at; every position in the bundle is
                         below it */
    char policy[KT_BUNDLE_MAX_POLICY + 1]; /* the eviction policy spec with defaults filled in
                                              (kr_policy_spec), NUL-terminated */
    /* A layer segment (format 2.2): one part of a layer-pipelined transfer, holding layers
     * [first_layer, first_layer + n_layers) of the model; the parts of one request are
     * assembled by kt_bundle_set. In every part but the last, first_token and next_pos are
     * provisional (0 and a bound on the positions). 0 and 0: a whole bundle. */
    uint32_t segment; /* 1: a layer segment (required flag bit 0) */
    uint32_t first_layer; /* a segment's first layer, < KT_BUNDLE_MAX_LAYERS */
    /* Block padding (format 2.3, required flag bit 1): 0, rows packed; else
     * 1..KT_BUNDLE_MAX_BLOCK_ROWS, and every list's rows start on a multiple of block_rows rows
     * of the positions, K, V and scale sections, the rows after a list's entries up to the next
     * multiple being zero. A receiver whose KV blocks hold block_rows rows can then take the K
     * and V sections straight into a run of its blocks: the lists' blocks in order have the
     * byte image of the section. */
    uint32_t block_rows;
} kt_bundle_header;

/* What a bundle says about one (layer, KV head) list: its entries and the decode rule the decode
 * node applies to it after every step (the engine's kr_list_rule; docs/bundle.md). Every value
 * but `window` and `flags` is at most 2^31-1. */
typedef struct kt_bundle_list {
    uint32_t count; /* entries kept */
    uint32_t pinned; /* the first `pinned` entries are the pinned set; <= count */
    uint32_t window; /* decode-side recent window W of this list, or KT_BUNDLE_WINDOW_DENSE */
    uint32_t sink; /* the pinned set grows to the list's first `sink` entries during decode */
    uint32_t lazy; /* Lazy Pruning's R (0: never prunes; plain "pinned + window" is 1) */
    uint32_t slack; /* Lazy Pruning's slack */
    uint32_t max_drop; /* Lazy Pruning's max-drop (0: prune straight to sink + window) */
    uint32_t flags; /* KT_BUNDLE_LIST_REL or 0 */
} kt_bundle_list;

/* Exact bundle size for `h` and `lists` ([n_layers * n_kv_heads], layer-major), after
 * validating both as the writer would: what a decode node reserves. */
int kt_bundle_size(const kt_bundle_header *h, const kt_bundle_list *lists, uint64_t *size_out,
                   char *err);

/* ------------------------------------------------------------------ encoding */

/* One bundle being written. Lives on the caller's stack; fields are private (read them only
 * through the functions). Usage:
 *
 *     kt_bundle_writer w;
 *     kt_bundle_writer_begin(&w, &hdr, lists, buf, cap, err);
 *     for each layer, for each KV head, for each run of consecutive entries (a KV block):
 *         kt_bundle_writer_put(&w, layer, head, &(kt_rows_in){n, positions, KT_DTYPE_F32, k, v}, err);
 *     kt_bundle_writer_finish(&w, &size, err);
 *
 * Lists are written in layer-major order, each list's entries in order, in as many `put`
 * calls as convenient; a list may be skipped only when its count is 0. Rows are converted to
 * the payload dtype straight into `buf`. After any failure the writer refuses further calls
 * and `buf` holds no valid bundle. */
typedef struct kt_bundle_writer {
    uint8_t *buf; /* caller's, cap >= size */
    uint64_t size; /* total bundle bytes */
    const kt_bundle_list *lists; /* caller's, [n_lists], must outlive the writer */
    uint32_t n_lists, n_kv_heads, head_dim;
    kt_dtype dtype;
    int32_t next_pos;
    size_t row_bytes; /* head_dim * element size */
    uint32_t cur; /* list being filled */
    uint32_t filled; /* entries of lists[cur] written */
    int32_t last_pos; /* last position written in lists[cur] (-1: none yet) */
    uint32_t block_rows; /* the header's: 0 (packed) or the row multiple each list is padded to */
    uint64_t row; /* rows written in each row section so far, padding rows included */
    uint64_t off_pos, off_k, off_v, off_ks, off_vs; /* section offsets (ks, vs: row scales) */
    uint32_t crc_pos, crc_k, crc_v, crc_ks, crc_vs; /* running CRC32C of each section */
    int state; /* 1: open, 0: finished or failed */
} kt_bundle_writer;

/* Validates `h` and `lists`, lays the bundle out in `buf` (`cap` bytes, any alignment; the
 * sections are 64-byte aligned relative to buf, so an aligned buf gives aligned rows) and
 * writes the header and list table. Fails when cap < kt_bundle_size. With h->block_rows set
 * the writer also writes each list's zero padding rows (when it moves on to the next list and
 * at finish), so buf need not be zeroed. */
int kt_bundle_writer_begin(kt_bundle_writer *w, const kt_bundle_header *h,
                           const kt_bundle_list *lists, void *buf, size_t cap, char *err);
/* Entries a caller hands over: `n` positions and the K and V rows of head_dim elements of
 * `dtype` each (contiguous, any alignment). */
typedef struct kt_rows_in {
    uint32_t n;
    const int32_t *positions;
    kt_dtype dtype;
    const void *k, *v;
} kt_rows_in;
/* Where entries go out: `n` positions and the K and V rows of head_dim elements of `dtype` each
 * (contiguous, any alignment); any of positions, k, v may be NULL (not read out). */
typedef struct kt_rows {
    uint32_t n;
    int32_t *positions;
    kt_dtype dtype;
    void *k, *v;
} kt_rows;

/* Appends rows->n entries to list (layer, head): their positions (strictly increasing, >= 0,
 * below next_pos, above the list's previous entry) and K and V rows of rows->dtype (f32, f16 or
 * bf16), converted to the payload dtype with round to nearest even, or quantized row by row with
 * its scale. A quantized payload refuses a row with a NaN or infinity (its scale would be
 * meaningless). */
int kt_bundle_writer_put(kt_bundle_writer *w, uint32_t layer, uint32_t head,
                         const kt_rows_in *rows, char *err);
/* Checks every list got exactly its count, writes the checksums; *size_out = bytes to send. */
int kt_bundle_writer_finish(kt_bundle_writer *w, uint64_t *size_out, char *err);

/* ------------------------------------------------------------------ decoding */

/* A validated bundle: pointers into the caller's buffer, which must outlive the view. The
 * buffer may have any alignment, so row and position pointers are byte pointers: read them
 * with kt_bundle_list_read (or memcpy), never by casting to float* or int32_t*. */
typedef struct kt_bundle_view {
    kt_bundle_header hdr;
    uint16_t version_major, version_minor;
    uint32_t flags; /* optional flag bits of a newer minor version (ignored here) */
    uint64_t size; /* bytes of the bundle */
    uint64_t n_entries; /* entries summed over every list */
    uint64_t n_rows; /* rows of the positions, K, V (and scale) sections: n_entries, plus the
                        padding rows of a block-padded bundle (hdr.block_rows) */
    size_t row_bytes; /* bytes of one K or V row */
    uint32_t n_lists; /* n_layers * n_kv_heads */
    const uint8_t *base; /* the bundle's first byte (the buffer parsed); for a view from
                            kt_bundle_parse_head, the head buffer */
    const uint8_t *lists; /* list table: 40 bytes per list (docs/bundle.md) */
    const uint8_t *positions; /* int32 LE per row, all lists in order */
    const uint8_t *k; /* n_rows rows of row_bytes; NULL until kt_bundle_parse_rows for a view
                         from kt_bundle_parse_head */
    const uint8_t *v;
    const uint8_t *k_scale, *v_scale; /* quantized dtypes: a float32 LE per row; else NULL */
} kt_bundle_view;

/* One list of a view. */
typedef struct kt_bundle_list_view {
    uint32_t count, pinned, window; /* as kt_bundle_list */
    uint32_t sink, lazy, slack, max_drop, flags; /* the decode rule, as kt_bundle_list */
    uint64_t first; /* row index of the list's first entry in the row sections (padding rows of
                       a block-padded bundle counted: a multiple of block_rows) */
    const uint8_t *positions; /* count int32 LE, maybe unaligned */
    const uint8_t *k, *v; /* count rows of view->row_bytes in the payload dtype, maybe unaligned;
                             NULL while the view's rows are (kt_bundle_parse_head) */
    const uint8_t *k_scale, *v_scale; /* count float32 LE row scales (quantized), else NULL */
} kt_bundle_list_view;

/* Validates the `len` bytes at `buf` as a whole bundle: structure, every bound, every list,
 * every position, every padding byte and every checksum. On success *out points into buf. */
int kt_bundle_parse(const void *buf, size_t len, kt_bundle_view *out, char *err);

/* Parsing in two steps, for a receiver whose sections land in different places (the head in a
 * buffer of its own, K and V straight into runs of KV blocks): kt_bundle_layout_read on the
 * first bytes says where the pieces lie, kt_bundle_parse_head validates the head and
 * kt_bundle_parse_rows the K and V sections, with the same checks kt_bundle_parse makes. */
typedef struct kt_bundle_layout {
    uint64_t size; /* total_size: bytes of the bundle */
    uint64_t head_len; /* bytes before section K: header, list table, positions, gaps */
    uint64_t k_off, k_len, v_off, v_len; /* sections K and V */
    uint32_t block_rows; /* the header's: 0 (rows packed) or the padding's row multiple */
    int split; /* 1: the bundle can travel as three pieces [0, head_len), K, V: unquantized
                  (V is the last section) and V starts where K ends */
} kt_bundle_layout;
/* Where the sections of a bundle lie, from its fixed header and section table alone (`len` >=
 * the bundle's header_size bytes at `buf`; more may follow): checks magic, version, flags,
 * every header field, the header checksum and the section table's placement. The lengths of K
 * and V are checked against the counts only by kt_bundle_parse_head. */
int kt_bundle_layout_read(const void *buf, size_t len, kt_bundle_layout *out, char *err);
/* Validates the bytes [0, head_len) of a bundle of `size` bytes (header, list table, positions
 * with their checksums and every rule on them, head_len being the layout's) and fills *out
 * with k and v NULL: n_lists, counts and positions are usable through kt_bundle_view_list,
 * rows not yet. Fails for a layout without `split`. `head` must outlive the view (out->base,
 * lists and positions point into it). */
int kt_bundle_parse_head(const void *head, size_t head_len, uint64_t size, kt_bundle_view *out,
                         char *err);
/* Completes a view from kt_bundle_parse_head with its K and V sections, wherever they lie
 * (the layout's k_len and v_len bytes each, any alignment): their checksums and zero padding
 * rows. On success v->k and v->v point at them; on failure *v is left as it was (k and v NULL,
 * not usable for rows). */
int kt_bundle_parse_rows(kt_bundle_view *v, const void *k, const void *vrows, char *err);
/* The receiver's own model: fails with both values named when the bundle (a view's or a set's
 * header) was made for another fingerprint or shape (checked field by field; `fingerprint` may
 * be NULL to skip it). */
int kt_bundle_check_model(const kt_bundle_header *h, const char *fingerprint, uint32_t n_layers,
                          uint32_t n_kv_heads, uint32_t head_dim, char *err);
/* List (layer, head) of a validated view (from kt_bundle_parse, or kt_bundle_parse_head with
 * k and v NULL until kt_bundle_parse_rows); fails only for layer or head out of range. */
int kt_bundle_view_list(const kt_bundle_view *v, uint32_t layer, uint32_t head,
                        kt_bundle_list_view *out, char *err);
/* Copies entries [first, first + out->n) of a list out, rows converted to out->dtype: float32,
 * float16 or bfloat16 (round to nearest even; a plain copy when it is the payload's dtype, so a
 * receiver whose cache has the wire's dtype copies each row once). A quantized payload is read
 * as float32 only (dequantized with its scales). Fails when the range is outside the list, the
 * dtype cannot be given, or rows are asked of a view whose rows are not parsed yet. */
int kt_bundle_list_read(const kt_bundle_view *v, const kt_bundle_list_view *l, uint32_t first,
                        const kt_rows *out, char *err);

/* ------------------------------------------------------------------ assembling parts */

/* One request's KV as a receiver holds it: a whole bundle, or the layer segments of a
 * pipelined transfer, in the order sent. Each part is a validated view into the receive
 * buffer; kt_bundle_set_add checks that the parts fit together. A segment may hold layers an
 * earlier part already held: its lists then continue theirs (the entries of a chunk that was
 * final before the last one, sent early), and the last piece of a list carries its decode
 * rule. */
typedef struct kt_bundle_set kt_bundle_set;
/* A receiver's hook on a set the transport fills (kt_transport_reserve and _rma with a set):
 * called on the transport's progress thread, without its lock, right after part `i` was validated and
 * joined the set and before that part is acknowledged, so that the receiver can take the part's
 * rows while they are still in cache. Non-zero (with a message in err, KT_ERR_MAX bytes) refuses
 * the part: the reservation fails as for a part that does not validate, and the sender hears
 * the message. */
typedef int (*kt_bundle_part_fn)(void *arg, const kt_bundle_set *s, uint32_t i, char *err);
/* A receiver's placement hook on a set the transport fills, for a part that travels in pieces
 * (head, K, V: a block-padded bundle whose layout is split): called on the transport's progress
 * thread, without its lock, once the part's head arrived and was validated (`head`, from
 * kt_bundle_parse_head: counts and positions readable, rows not yet), before K and V arrive.
 * Returns 0 with *k and *v set to where the K and V sections (the layout's k_len and v_len
 * bytes) land, typically runs of the receiver's KV blocks, which stay the receiver's; 1 to let
 * the transport land them in a buffer of its own; -1 (with a message in err, KT_ERR_MAX bytes)
 * to refuse the part. The rows are validated there (kt_bundle_parse_rows) before the part joins
 * the set and kt_bundle_part_fn runs. */
typedef int (*kt_bundle_place_fn)(void *arg, const kt_bundle_set *s, const kt_bundle_view *head,
                                  void **k, void **v, char *err);

struct kt_bundle_set {
    /* The request's header once complete: n_layers summed over the parts, first_token and
     * next_pos from the last part, segment and first_layer 0. */
    kt_bundle_header hdr;
    uint64_t size; /* bytes over every part */
    uint64_t n_entries; /* entries over every part */
    uint32_t n_parts, cap;
    kt_bundle_view *parts; /* the caller's array of cap views */
    int complete; /* the last part was added */
    int owned; /* each part is a buffer of its own (parts[i].base, partbuf.h), which the set owns:
                  a receiver that had the transport allocate parts as they arrived */
    void *region; /* a buffer from kt_partbuf_alloc holding the parts, which the set owns: an RMA
                     reservation's, where the sender put them (NULL: none) */
    kt_bundle_part_fn on_part; /* NULL: none; set after kt_bundle_set_init */
    void *on_part_arg; /* the argument of on_part and of on_place */
    kt_bundle_place_fn on_place; /* NULL: none (K and V land in the transport's buffers) */
};

/* An empty set over the caller's `parts` (cap views, at least 1). */
void kt_bundle_set_init(kt_bundle_set *s, kt_bundle_view *parts, uint32_t cap);
/* Frees the parts' buffers when the set owns them, and its region, and empties the set (parts
 * and cap stay, `owned` too). Safe on an empty set. */
void kt_bundle_set_free(kt_bundle_set *s);
/* Adds the next part (`part` may be &s->parts[s->n_parts]; it is copied there). A whole bundle
 * must come alone and last; the first segment starts at layer 0 and each later one at or
 * before the end of the layers so far, agreeing with the first on the model, dtype, prompt
 * length and policy; where it holds a layer already held, each of its lists must continue the
 * list (positions after its last one; pinned entries only after pinned ones). `last` (the
 * sender said no part follows) completes the set, and then every position of every part must
 * lie below the last part's next_pos. Parts may be padded differently (each is read through its
 * own view; the set's header carries block_rows when all parts agree, else 0). A part needs its
 * rows (a view from kt_bundle_parse_head joins once kt_bundle_parse_rows completed it). Fails, leaving the set as it was, when the part does not
 * fit, the set is full or already complete. */
int kt_bundle_set_add(kt_bundle_set *s, const kt_bundle_view *part, int last, char *err);
/* List (layer, head) of a complete set, over every part holding a piece of it: count and
 * pinned summed, the decode rule of the last piece. */
int kt_bundle_set_list(const kt_bundle_set *s, uint32_t layer, uint32_t head, kt_bundle_list *out,
                       char *err);
/* Entries [first, first + out->n) of list (layer, head) of a complete set, as
 * kt_bundle_list_read gives them, across the parts that hold them. Fails when the range is
 * outside the list or the dtype cannot be given. */
int kt_bundle_set_read(const kt_bundle_set *s, uint32_t layer, uint32_t head, uint32_t first,
                       const kt_rows *out, char *err);

/* ------------------------------------------------------------------ helpers */

/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF) of
 * `n` bytes continuing from `crc` (0 to start): kt_crc32c(kt_crc32c(0, a), b) = crc of a||b.
 * Uses the SSE4.2 instruction when the CPU has it, a table otherwise; same results. */
uint32_t kt_crc32c(uint32_t crc, const void *data, size_t n);
/* The table path alone, whatever the CPU: for the test that holds both paths to one result. */
uint32_t kt_crc32c_portable(uint32_t crc, const void *data, size_t n);

/* Element conversions, round to nearest even, NaN stays NaN, overflow becomes infinity. */
uint16_t kt_f32_to_f16(float f);
float kt_f16_to_f32(uint16_t h);
uint16_t kt_f32_to_bf16(float f);
float kt_bf16_to_f32(uint16_t b);
/* fp8 E4M3 ("fn": bias 7, largest 448, no infinity, NaN 0x7f/0xff): |f| above 448 saturates
 * to +-448, NaN becomes 0x7f. */
uint8_t kt_f32_to_fp8_e4m3(float f);
float kt_fp8_e4m3_to_f32(uint8_t b);

#ifdef __cplusplus
}
#endif
#endif /* KT_BUNDLE_H */
