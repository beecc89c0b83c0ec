/*
 * quant_bound.h - the round-trip bound of a quantized KV bundle element (bundle.h,
 * docs/bundle.md), written out independently of the codec for the tests that check it.
 */
#ifndef KR_QUANT_BOUND_H
#define KR_QUANT_BOUND_H

#include "bundle.h"

#include <math.h>

/* 1 when `got` (what came back for element x of a row of `dim` elements) is within the bound:
 * int8 max|row| / 254, fp8 max(|x| / 16, max|row| / 448 / 1024), each with a float32
 * rounding's worth of slack; 0 otherwise, and on NaN. */
static inline int quant_within_bound(kt_dtype t, const float *row, int dim, float x, float got)
{
    double amax = 0;
    for (int e = 0; e < dim; e++) amax = fmax(amax, fabs((double)row[e]));
    const double bound = t == KT_DTYPE_INT8_TOKEN ? amax / 254 : fmax(fabs((double)x) / 16, amax / 448 / 1024);
    return fabs((double)got - x) <= bound * (1 + 1e-5) + 1e-30;
}

#endif
