/*
 * bundle-impl.h - what the two files of the bundle codec (bundle.h: bundle.c, bundle-set.c) share
 * besides the public header: the error helper and the list table record reader. Not a public
 * header.
 */
#ifndef KT_BUNDLE_IMPL_H
#define KT_BUNDLE_IMPL_H

#include <stdarg.h>
#include <stdio.h>

#include "bundle.h"
#include "le.h"

/* Bytes of a list table record (docs/bundle.md, "Section 1: lists"): u64 first; u32 count,
 * pinned, window, sink, lazy, slack, max_drop, flags. */
enum { BL_LIST_ENTRY = 40 };

/* Writes "bundle: " and the message into err (KT_ERR_MAX bytes, may be NULL); returns -1. */
static inline int fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline int fail(char *err, const char *fmt, ...)
{
    if (err) {
        int n = snprintf(err, KT_ERR_MAX, "bundle: ");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err + n, KT_ERR_MAX - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* A list table record: u64 first, then the kt_bundle_list fields in declaration order. */
static inline void list_rd(const uint8_t *t, kt_bundle_list *l)
{
    l->count = kt_rd32(t + 8);
    l->pinned = kt_rd32(t + 12);
    l->window = kt_rd32(t + 16);
    l->sink = kt_rd32(t + 20);
    l->lazy = kt_rd32(t + 24);
    l->slack = kt_rd32(t + 28);
    l->max_drop = kt_rd32(t + 32);
    l->flags = kt_rd32(t + 36);
}

#endif /* KT_BUNDLE_IMPL_H */
