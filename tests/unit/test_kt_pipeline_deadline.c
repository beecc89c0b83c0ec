/*
 * test_kt_pipeline_deadline.c - a call's deadline that passes while kvrelay-prefill is still
 * prefilling with --pipeline on ends the call DEADLINE_EXCEEDED, as it does without pipelining,
 * and not UNAVAILABLE (which counts and logs the decode node as a failed peer).
 * How: the real program on llama3-tiny with --chunk 1 (a prefill of many chunks) under a
 * streaming policy (no part is final, so none is sent, before the last chunk), and this test as
 * the decode node (a UCX reservation that takes any bytes). Once the node runs the call, the test
 * stops the process (SIGSTOP) until the call's deadline has passed, then lets it go on: its first
 * part is then ready only after the deadline. The node's verdict is read from /metrics
 * (kvrelay_requests_total by status), since the caller hears its own deadline either way. A
 * prefill that ended before the stop landed proves nothing: the attempt is made again. The same
 * with --pipeline off: the two paths report a passed deadline alike.
 * Run: ctest -R test_kt_pipeline_deadline (a few seconds). Exit 77 (SKIPPED) when kvrelay-prefill
 * is not built, the fixture model is missing, or UCX cannot listen on loopback.
 */
#include "kr_test.h"
#include "proc.h"

#include <pthread.h>

#include "kvrelay/v1/internal.pb-c.h"
#include "rpc.h"
#include "transport.h"

#define PREFILL "/kvrelay.v1.Prefill/Prefill"
#define N_PROMPT 600
#define DEADLINE_MS 2000
#define ATTEMPTS 3

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Polls until the node's running gauge is `want`; 0 when it never was within `ms`. */
static int wait_running(const char *http, double want, int ms)
{
    for (int i = 0; i < ms; i++) {
        if (test_metric(http, "kvrelay_running_sequences") == want) return 1;
        sleep_ms(1);
    }
    return 0;
}

typedef struct call {
    kc_channel *ch;
    const char *addr;
    uint64_t resv;
    const uint8_t *token;
    int32_t tok[N_PROMPT];
    kc_status st;
    int ok;
} call;

static void *call_main(void *arg)
{
    call *c = arg;
    uint32_t ids[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        ids[i] = (uint32_t)c->tok[i];
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    req.request_id = "deadline in prefill";
    req.n_token_ids = N_PROMPT;
    req.token_ids = ids;
    req.kv_policy = "streaming:sink=4,window=24";
    req.kv_wire_dtype = "";
    req.transfer_address = (char *)c->addr;
    req.reservation_id = c->resv;
    req.reservation_token =
        (ProtobufCBinaryData){.len = KT_RESV_TOKEN_BYTES, .data = (uint8_t *)c->token};
    req.decode_node = "test-decode";
    ProtobufCMessage *resp = NULL;
    c->ok = kc_unary(c->ch, PREFILL, &req.base, &kvrelay__v1__prefill_response__descriptor,
                     DEADLINE_MS, &resp, &c->st) == 0;
    kc_message_free(resp);
    return NULL;
}

static void resv_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    (void)arg, (void)id, (void)status, (void)bytes, (void)err;
}

/* One node (--pipeline `pipeline`): a call stopped in its prefill until its deadline passed
 * must end DEADLINE_EXCEEDED on the node. */
static void deadline_case(const char *exe, const char *model, kt_transport *rx,
                          const char *pipeline)
{
    char err[KT_ERR_MAX], addr[64], id[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", kt_transport_port(rx));
    snprintf(id, sizeof id, "prefill-deadline-%s", pipeline);
    char *argv[] = {(char *)exe, "--model", (char *)model, "--listen", "127.0.0.1:0", "--http",
                    "127.0.0.1:0", "--id", id, "--threads", "1", "--chunk", "1", "--max-prompt",
                    "1024", "--pipeline", (char *)pipeline, NULL};
    test_proc p;
    REQUIRE(test_proc_start(argv, 60, &p) == 0, "kvrelay-prefill did not start");
    call c = {.addr = addr};
    kc_status st;
    REQUIRE(kc_channel_create(p.grpc, 0, &c.ch, &st) == 0, "channel: %s", st.details);
    uint32_t x = 12345;
    for (int i = 0; i < N_PROMPT; i++) {
        x = x * 1664525u + 1013904223u;
        c.tok[i] = (int32_t)((x >> 8) % 500u);
    }

    const uint64_t cap = 4u << 20;
    uint8_t *buf = malloc(cap);
    int stopped_in_prefill = 0;
    for (int attempt = 0; attempt < ATTEMPTS && !stopped_in_prefill; attempt++) {
        uint8_t token[KT_RESV_TOKEN_BYTES];
        c.resv = 100 + (uint64_t)attempt;
        c.token = token;
        const kt_resv_opts ro = {.timeout_s = 60.0, .cb = resv_cb};
        REQUIRE(kt_transport_reserve(rx, c.resv, buf, cap, &ro, token, err) == 0, "reserve: %s",
                err);
        pthread_t th;
        pthread_create(&th, NULL, call_main, &c);
        /* The worker runs the call: stop the node a moment into its prefill. */
        REQUIRE(wait_running(p.http, 1, 30000), "the node never ran the call");
        sleep_ms(20);
        kill(p.pid, SIGSTOP);
        pthread_join(th, NULL); /* the caller's deadline passes while the node is stopped */
        sleep_ms(300);          /* and the node's copy of it, a transit time later */
        kill(p.pid, SIGCONT);
        REQUIRE(wait_running(p.http, 0, 60000), "the node never finished the call");
        kt_transport_release(rx, c.resv);
        stopped_in_prefill = !c.ok;
        if (c.ok)
            printf("--pipeline %s, attempt %d: the prefill ended before the stop; again\n",
                   pipeline, attempt + 1);
    }
    REQUIRE(stopped_in_prefill, "the prefill always ended before the node was stopped");
    CHECK(c.st.code == GRPC_STATUS_DEADLINE_EXCEEDED, "--pipeline %s: the caller heard %s %s",
          pipeline, kc_status_name(c.st.code), c.st.details);
    double dl = test_metric(p.http, "kvrelay_requests_total{status=\"DEADLINE_EXCEEDED\"}"),
           un = test_metric(p.http, "kvrelay_requests_total{status=\"UNAVAILABLE\"}");
    CHECK(dl == 1 && un <= 0,
          "--pipeline %s: the node ended the call %g time(s) DEADLINE_EXCEEDED and %g time(s) "
          "UNAVAILABLE; want a deadline, not a failed decode node",
          pipeline, dl, un);

    kc_channel_destroy(c.ch);
    int status = test_proc_stop(&p, SIGTERM, 60);
    CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "SIGTERM: status %d",
          status);
    free(buf);
}

int main(void)
{
    const char *bin_dir = kt_env("KR_BIN"), *fixtures = kt_env("KR_FIXTURES");
    REQUIRE(bin_dir && fixtures, "KR_BIN and KR_FIXTURES must be set (run through ctest)");
    char exe[1024], model[1024], cfg[1100];
    snprintf(exe, sizeof exe, "%s/kvrelay-prefill", bin_dir);
    snprintf(model, sizeof model, "%s/models/llama3-tiny", fixtures);
    snprintf(cfg, sizeof cfg, "%s/config.json", model);
    if (access(exe, X_OK) != 0 || access(cfg, R_OK) != 0) {
        printf("SKIP: %s or %s is missing\n", exe, cfg);
        return KT_SKIP;
    }
    char err[KT_ERR_MAX];
    kt_transport *rx;
    kt_transport_config tc = {.listen_host = "127.0.0.1", .name = "test-decode"};
    if (kt_transport_create(&tc, &rx, err) != 0) {
        printf("SKIP: UCX cannot listen on loopback: %s\n", err);
        return KT_SKIP;
    }
    signal(SIGPIPE, SIG_IGN);
    deadline_case(exe, model, rx, "on");
    deadline_case(exe, model, rx, "off"); /* what the pipelined path must agree with */
    kt_transport_destroy(rx);
    return kt_done("test_kt_pipeline_deadline");
}
