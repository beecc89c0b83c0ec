/*
 * grammar-impl.h - the structures behind kr-grammar.h, shared by grammar.c (the schema
 * compiler), grammar-match.c (the matcher) and grammar-mask.c (vocabulary trie and mask).
 * docs/structured-output.md describes the automaton these encode.
 */
#ifndef KR_GRAMMAR_IMPL_H
#define KR_GRAMMAR_IMPL_H

#include "kr-grammar.h"

/* JSON types a node accepts (bits of gr_node.types). */
enum {
    GR_NULL = 1 << 0,
    GR_BOOLEAN = 1 << 1,
    GR_INTEGER = 1 << 2,
    GR_NUMBER = 1 << 3, /* any number; implies GR_INTEGER's values */
    GR_STRING = 1 << 4,
    GR_ARRAY = 1 << 5,
    GR_OBJECT = 1 << 6,
    GR_ALL = (1 << 7) - 1,
};

#define GR_MAX_PROPS 64 /* properties per object: one bit each in a frame's `seen` */
#define GR_MAX_LITS 4096 /* values of one enum */
#define GR_MAX_NODES 65535 /* frames hold node indices in 16 bits */
#define GR_ADDITIONAL 0xFFFF /* gr_frame.prop: the key is an additional property */

/* One schema: what a value at its place may be. Nodes live in kr_grammar.nodes; child links
 * are indices. A node with literals (enum / const) matches exactly their texts and nothing
 * else; its other constraints were applied to the literals at compile time. */
typedef struct gr_node {
    uint8_t types; /* GR_* */
    uint32_t min_len, max_len; /* string: characters */
    uint32_t min_items, max_items; /* array */
    int32_t items; /* array: node of every item */
    uint32_t props_off, n_props; /* object: in kr_grammar.props, sorted by encoded name */
    int32_t additional; /* object: node of other keys' values, -1 when none are allowed */
    uint32_t key_max; /* object: characters of an additional key (longer than every name) */
    uint64_t required; /* object: bit i = props[props_off + i] is required */
    uint32_t lits_off, n_lits; /* enum / const: in kr_grammar.lits, sorted bytewise */
    uint32_t min_doc; /* bytes of the shortest value it accepts (kr_matcher_remaining) */
} gr_node;

/* A byte string in kr_grammar.text: a property name JSON-encoded without its quotes (what the
 * document spells), or a literal's compact JSON text. */
typedef struct gr_str {
    uint32_t off, len;
} gr_str;

typedef struct gr_prop {
    gr_str name;
    int32_t node;
} gr_prop;

struct kr_grammar {
    gr_node *nodes;
    int n_nodes, cap_nodes;
    gr_prop *props;
    int n_props, cap_props;
    gr_str *lits; /* each node's literals, then the three of true/false/null at kw_lits */
    int n_lits, cap_lits;
    char *text;
    size_t n_text, cap_text;
    int root;
    uint32_t kw_lits; /* "false", "null", "true", in that (sorted) order */
    kr_grammar_limits lim; /* defaults filled in */
};

/* Frame kinds: one per open construct of the document. */
enum { GF_ROOT, GF_OBJECT, GF_KEY, GF_ARRAY, GF_STRING, GF_NUMBER, GF_LITERAL };

/* One open construct. `sub` is the position inside it (the GS_* of its kind); `ws` counts the
 * whitespace bytes it has read in a row. Frames are copied on every trie step of the mask, so
 * they are kept at 24 bytes. */
typedef struct gr_frame {
    uint8_t kind, sub, ws;
    uint8_t u8; /* string and key: UTF-8 continuation bytes still due (bits 0-1) and the range
                   the next one must be in (bits 2-4) */
    uint16_t node;
    uint16_t prop; /* object: the property whose key was just read (GR_ADDITIONAL: another) */
    uint32_t n; /* array: items; string and key: characters; number: digits of this part */
    union {
        uint64_t seen; /* object: bit i = property i was written */
        struct {
            uint16_t lo, hi; /* literal: candidates [lo, hi) of the node's literals; key:
                                of the object's properties */
            uint32_t pos; /* bytes matched */
        } lit;
    } u;
} gr_frame;

struct kr_matcher {
    const kr_grammar *g;
    int depth; /* frames in use */
    uint8_t dead, ended;
    gr_frame f[KR_GRAMMAR_MAX_DEPTH + 3];
};

/* The matcher's step for the mask: feeds `c` into a copy of src written to dst (depth frames
 * only). 0 when accepted; on -1 dst holds garbage. */
int gr_step(kr_matcher *dst, const kr_matcher *src, uint8_t c);
/* GR_PLAIN_STRING (a string) or GR_PLAIN_KEY (an additional key) when the top of m is between
 * characters there, where plain text (printable, no quote or backslash, whole UTF-8
 * characters) is accepted as long as it has at most *room characters and changes nothing but
 * their count; else 0. *need: the characters a string still lacks for its minLength (plain
 * text of c characters brings kr_matcher_remaining down by min(c, *need)); 0 for a key. */
enum { GR_PLAIN_STRING = 1, GR_PLAIN_KEY = 2 };
int gr_plain_room(const kr_matcher *m, uint32_t *room, uint32_t *need);
/* Bytes of the shortest value node accepts, from its children's (set at compile time). */
uint32_t gr_node_min_doc(const kr_grammar *g, const gr_node *n);

#endif /* KR_GRAMMAR_IMPL_H */
