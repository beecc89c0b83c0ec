/*
 * test_penalties.c - the logit penalties (kr_penalty_*) against a hand computation: the
 * repetition penalty divides a seen token's positive logit and multiplies a negative one (the
 * prompt's tokens count as seen), the frequency penalty subtracts per output occurrence, the
 * presence penalty once per output token, unseen tokens keep their logits bit for bit, all three
 * combine in vLLM's order; bad values are refused naming the field; a greedy sampler on the
 * penalized row stops repeating.
 */
#include "kr_test.h"

#include "kr.h"

enum { V = 8 };

static kr_penalty_state *make(float rep, float pres, float freq, const int32_t *prompt, int n)
{
    kr_penalties p = {.repetition = rep, .presence = pres, .frequency = freq};
    kr_penalty_state *s;
    char err[KR_ERR_MAX];
    REQUIRE(kr_penalty_create(&p, V, prompt, n, &s, err) == KR_OK, "%s", err);
    return s;
}

/* every out[i] equals want[i] exactly (NaN fails) */
static void check_row(const char *what, const float *out, const float *want)
{
    for (int i = 0; i < V; i++)
        CHECK(out[i] == want[i], "%s: logit %d is %.9g, want %.9g", what, i, out[i], want[i]);
}

int main(void)
{
    const float logits[V] = {2.0f, -1.0f, 0.5f, 3.0f, -4.0f, 0.0f, 1.5f, -0.25f};
    float out[V];

    /* repetition 2: prompt {0, 1} and output {3}; 0 and 3 positive (/2), 1 negative (*2) */
    const int32_t prompt[] = {0, 1, 1};
    kr_penalty_state *s = make(2.0f, 0.0f, 0.0f, prompt, 3);
    kr_penalty_add(s, 3);
    kr_penalty_add(s, 3);
    kr_penalty_apply(s, logits, out);
    check_row("repetition", out, (const float[V]){1.0f, -2.0f, 0.5f, 1.5f, -4.0f, 0.0f, 1.5f, -0.25f});
    kr_penalty_free(s);

    /* frequency 0.5 and presence 0.25 over the output {6, 6, 6, 4}; the prompt does not count */
    s = make(1.0f, 0.25f, 0.5f, prompt, 3);
    const int32_t gen[] = {6, 6, 6, 4};
    for (int i = 0; i < 4; i++) kr_penalty_add(s, gen[i]);
    kr_penalty_apply(s, logits, out);
    check_row("frequency+presence", out,
              (const float[V]){2.0f, -1.0f, 0.5f, 3.0f, -4.0f - 0.5f - 0.25f, 0.0f, 1.5f - 1.5f - 0.25f, -0.25f});
    kr_penalty_free(s);

    /* all three: repetition first, then frequency, then presence (vLLM's order); in place */
    s = make(1.5f, -0.5f, 1.0f, (const int32_t[]){7}, 1);
    kr_penalty_add(s, 2);
    kr_penalty_add(s, 2);
    kr_penalty_add(s, 4);
    memcpy(out, logits, sizeof out);
    kr_penalty_apply(s, out, out);
    check_row("combined", out,
              (const float[V]){2.0f, -1.0f, 0.5f / 1.5f - 2.0f + 0.5f, 3.0f, -4.0f * 1.5f - 1.0f + 0.5f, 0.0f, 1.5f,
                               -0.25f * 1.5f});
    kr_penalty_free(s);

    /* negative penalties reward; a zero logit stays zero under repetition */
    s = make(3.0f, -1.0f, -2.0f, (const int32_t[]){5}, 1);
    kr_penalty_add(s, 1);
    kr_penalty_apply(s, logits, out);
    check_row("negative", out, (const float[V]){2.0f, -3.0f + 2.0f + 1.0f, 0.5f, 3.0f, -4.0f, 0.0f, 1.5f, -0.25f});
    kr_penalty_free(s);

    /* a greedy sampler repeats token 3 forever; with a frequency penalty it moves on */
    kr_sampling g;
    kr_sampling_default(&g);
    g.greedy = 1;
    kr_sampler *sp;
    char err[KR_ERR_MAX];
    REQUIRE(kr_sampler_create(&g, V, &sp, err) == KR_OK, "%s", err);
    s = make(1.0f, 0.0f, 2.0f, NULL, 0);
    int32_t seq[4];
    for (int i = 0; i < 4; i++) {
        kr_penalty_apply(s, logits, out);
        seq[i] = kr_sampler_sample(sp, out);
        kr_penalty_add(s, seq[i]);
    }
    /* 3 (3.0), then 0 (2.0 beats 3's 3 - 2), then 6 (1.5 beats 3's 1.0 and 0's 0.0), then 3 (1.0) */
    CHECK(seq[0] == 3 && seq[1] == 0 && seq[2] == 6 && seq[3] == 3, "greedy with frequency 2: %d %d %d %d", seq[0],
          seq[1], seq[2], seq[3]);
    kr_penalty_free(s);
    kr_sampler_free(sp);

    /* refusals name the field */
    kr_penalties p;
    kr_penalties_default(&p);
    CHECK(!kr_penalties_active(&p), "the defaults are off");
    CHECK(kr_penalties_check(&p, err) == KR_OK, "%s", err);
    p.repetition = 0.0f;
    CHECK(kr_penalties_check(&p, err) != KR_OK, "repetition 0 accepted");
    CHECK_ERR_HAS(err, "repetition_penalty");
    p.repetition = NAN;
    CHECK(kr_penalties_check(&p, err) != KR_OK, "repetition NaN accepted");
    kr_penalties_default(&p);
    p.presence = 2.5f;
    CHECK(kr_penalties_check(&p, err) != KR_OK, "presence 2.5 accepted");
    CHECK_ERR_HAS(err, "presence_penalty");
    kr_penalties_default(&p);
    p.frequency = -2.01f;
    CHECK(kr_penalties_check(&p, err) != KR_OK, "frequency -2.01 accepted");
    CHECK_ERR_HAS(err, "frequency_penalty");
    CHECK(kr_penalties_active(&p), "a frequency penalty is active");
    kr_penalties_default(&p);
    p.repetition = 1.2f;
    kr_penalty_state *bad = NULL;
    CHECK(kr_penalty_create(&p, V, (const int32_t[]){V}, 1, &bad, err) != KR_OK, "a prompt id out of range accepted");
    CHECK(bad == NULL, "no state on failure");
    return kt_done("test_penalties");
}
