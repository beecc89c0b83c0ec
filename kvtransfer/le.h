/*
 * le.h - little-endian loads and stores at any alignment, for the bundle format (the wire is
 * little-endian whatever the host; bundle.c refuses to build on big-endian hosts anyway).
 * Internal to kvtransfer/ and its tests.
 */
#ifndef KT_LE_H
#define KT_LE_H

#include <stdint.h>

static inline uint16_t kt_rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t kt_rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t kt_rd64(const uint8_t *p) { return kt_rd32(p) | (uint64_t)kt_rd32(p + 4) << 32; }
static inline void kt_wr16(uint8_t *p, uint16_t x)
{
    p[0] = (uint8_t)x;
    p[1] = (uint8_t)(x >> 8);
}
static inline void kt_wr32(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(x >> (8 * i));
}
static inline void kt_wr64(uint8_t *p, uint64_t x)
{
    kt_wr32(p, (uint32_t)x);
    kt_wr32(p + 4, (uint32_t)(x >> 32));
}

#endif
