/*
 * chain-hash.h - the hash chain over chunk-aligned token blocks that keys prefix KV states
 * (docs/prefix-cache.md): h_i = kc_chain_hash(h_{i-1}, tokens of block i). The prefill node keys
 * its prefix cache with it, and the router indexes what it sent to each prefill node with the
 * same function, so that both cut and hash a prompt alike. 64-bit FNV-1a over the bytes, then
 * splitmix64's finalizer so that nearby inputs spread over every bit: fast, not cryptographic
 * (a match must be confirmed on the tokens wherever a wrong one would matter).
 * Header-only: the prefill node and the router each inline it.
 */
#ifndef KC_CHAIN_HASH_H
#define KC_CHAIN_HASH_H

#include <stddef.h>
#include <stdint.h>

#define KC_HASH_SEED 0xcbf29ce484222325ULL /* FNV-1a's offset basis */

/* splitmix64's finalizer. */
static inline uint64_t kc_hash_mix(uint64_t h)
{
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

/* FNV-1a over n bytes, continuing from h (KC_HASH_SEED to start). */
static inline uint64_t kc_hash_bytes(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* The hash of the block tokens[0, n) chained to its parent's. */
static inline uint64_t kc_chain_hash(uint64_t parent, const int32_t *tokens, int n)
{
    return kc_hash_mix(kc_hash_bytes(parent ^ KC_HASH_SEED, tokens, sizeof *tokens * (size_t)n));
}

#endif /* KC_CHAIN_HASH_H */
