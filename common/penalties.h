/*
 * penalties.h - the sampling penalties of kvrelay.v1.Sampling as the engine's kr_penalties, and
 * the state that counts them over a prompt and the completion so far, for the two nodes that
 * draw tokens: the prefill node (the first token) and the decode node (every later one), so that
 * both read the fields and count the same way. Header-only: kr_common does not link the engine.
 */
#ifndef KC_PENALTIES_H
#define KC_PENALTIES_H

#include <stdint.h>
#include <stdio.h>

#include "kr.h"
#include "kvrelay/v1/kvrelay.pb-c.h"

/* *p from s (NULL: all off; repetition 0 means off, as 1), checked: -1 with err naming the field
 * when out of range. */
static inline int kc_penalties_from_pb(const Kvrelay__V1__Sampling *s, kr_penalties *p, char *err)
{
    kr_penalties_default(p);
    if (s) {
        p->repetition = s->repetition_penalty == 0.0f ? 1.0f : s->repetition_penalty;
        p->presence = s->presence_penalty;
        p->frequency = s->frequency_penalty;
    }
    return kr_penalties_check(p, err) == KR_OK ? 0 : -1;
}

/* The state for p over `vocab` ids, the n_prompt prompt ids seen and the n_output ids of the
 * completion so far counted: *out NULL when no penalty is on. -1 with err when an id is outside
 * the vocabulary (each side named as `what_prompt` / `what_output`) or memory runs out. */
static inline int kc_penalty_state_make(const kr_penalties *p, int vocab, const uint32_t *prompt, size_t n_prompt,
                                        const uint32_t *output, size_t n_output, kr_penalty_state **out,
                                        char *err)
{
    *out = NULL;
    if (!kr_penalties_active(p)) return 0;
    for (size_t i = 0; i < n_output; i++)
        if (output[i] >= (uint32_t)vocab) {
            snprintf(err, KR_ERR_MAX, "completion token %zu = %u is outside the vocabulary [0, %d)", i,
                     output[i], vocab);
            return -1;
        }
    if (n_prompt > (size_t)INT32_MAX) {
        snprintf(err, KR_ERR_MAX, "%zu prompt ids", n_prompt);
        return -1;
    }
    /* kr_penalty_create refuses ids outside the vocabulary: those below it are the same bits as
     * int32 */
    if (kr_penalty_create(p, vocab, (const int32_t *)prompt, (int)n_prompt, out, err) != KR_OK) return -1;
    for (size_t i = 0; i < n_output; i++) kr_penalty_add(*out, (int32_t)output[i]);
    return 0;
}

#endif /* KC_PENALTIES_H */
