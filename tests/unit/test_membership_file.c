/*
 * test_membership_file.c - the router's static membership file (common/membership-file.c): a
 * valid file with IPv4, IPv6 and host-name addresses read into kc_members (prefill first, state
 * serving), then one broken file per rule, each rejected with a message naming the file, the
 * entry and the field; and a missing file.
 * No network. Run: ctest -R test_membership_file.
 */
#include "kr_test.h"
#include "membership.h"

static void valid(void)
{
    const char *json = "{\"prefill\": [{\"id\": \"prefill-0\", \"address\": \"127.0.0.1:7101\"},"
                       "             {\"id\": \"prefill-1\", \"address\": \"[::1]:7102\"}],"
                       " \"decode\": [{\"id\": \"decode_0.a\", \"address\": \"node-3.cluster:7201\"}]}";
    kc_member *ms;
    int n;
    char err[KC_MEMBER_ERR_LEN];
    REQUIRE(kc_members_file_parse(json, strlen(json), "nodes.json", &ms, &n, err) == 0, "%s", err);
    REQUIRE(n == 3, "%d members", n);
    int n_prefill = 0, n_decode = 0;
    for (int i = 0; i < n; i++) {
        n_prefill += !strcmp(ms[i].role, "prefill");
        n_decode += !strcmp(ms[i].role, "decode");
        CHECK(!strcmp(ms[i].state, "serving") && !ms[i].fingerprint[0], "%s: state %s", ms[i].id, ms[i].state);
    }
    CHECK(n_prefill == 2 && n_decode == 1, "%d prefill %d decode", n_prefill, n_decode);
    CHECK(!strcmp(ms[0].role, "prefill") && !strcmp(ms[0].id, "prefill-0") && !strcmp(ms[0].grpc, "127.0.0.1:7101"),
          "prefill[0]");
    CHECK(!strcmp(ms[1].role, "prefill") && !strcmp(ms[1].grpc, "[::1]:7102"), "prefill[1] %s", ms[1].grpc);
    CHECK(!strcmp(ms[2].role, "decode") && !strcmp(ms[2].id, "decode_0.a") && !strcmp(ms[2].grpc, "node-3.cluster:7201"),
          "decode[0]");
    free(ms);
}

static void rejected(const char *json, const char *needle)
{
    kc_member *ms;
    int n;
    char err[KC_MEMBER_ERR_LEN] = "";
    int rc = kc_members_file_parse(json, strlen(json), "nodes.json", &ms, &n, err);
    CHECK(rc == -1, "accepted: %s", json);
    if (rc == 0) {
        free(ms);
        return;
    }
    CHECK_ERR_HAS(err, "nodes.json: ");
    CHECK_ERR_HAS(err, needle);
}

#define P0 "{\"id\": \"p0\", \"address\": \"127.0.0.1:1\"}"
#define D0 "{\"id\": \"d0\", \"address\": \"127.0.0.1:2\"}"

static void invalid(void)
{
    rejected("", "not valid JSON");
    rejected("{\"prefill\": [" P0 "], \"decode\": [" D0 "]", "not valid JSON");
    rejected("[]", "the top level must be an object");
    rejected("{\"prefill\": [" P0 "]}", "\"decode\" is missing");
    rejected("{\"decode\": [" D0 "]}", "\"prefill\" is missing");
    rejected("{\"prefill\": [], \"decode\": [" D0 "]}", "\"prefill\" is empty");
    rejected("{\"prefill\": " P0 ", \"decode\": [" D0 "]}", "\"prefill\" must be a list");
    rejected("{\"prefill\": [" P0 "], \"decode\": [" D0 "], \"router\": []}", "unknown key \"router\"");
    rejected("{\"prefill\": [" P0 "], \"decode\": [\"d0\"]}", "decode[0] must be an object");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"address\": \"127.0.0.1:2\"}]}", "decode[0].id is missing");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": 3, \"address\": \"127.0.0.1:2\"}]}", "decode[0].id is not a string");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d 0\", \"address\": \"127.0.0.1:2\"}]}", "decode[0].id 'd 0'");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"\", \"address\": \"127.0.0.1:2\"}]}", "decode[0].id ''");
    rejected("{\"prefill\": [" P0 ", {\"id\": \"p1\"}], \"decode\": [" D0 "]}", "prefill[1].address is missing");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1\"}]}", "decode[0].address '127.0.0.1': must be HOST:PORT");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1:0\"}]}", "the port '0' is not in 1..65535");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1:70000\"}]}", "the port '70000'");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1:7x\"}]}", "the port '7x'");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \":7000\"}]}", "must be HOST:PORT");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"::1:7000\"}]}", "IPv6 host must be in brackets");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1:2\", \"port\": 3}]}",
             "decode[0]: unknown key \"port\"");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"p0\", \"address\": \"127.0.0.1:2\"}]}", "node id 'p0' appears twice");
    rejected("{\"prefill\": [" P0 "], \"decode\": [{\"id\": \"d0\", \"address\": \"127.0.0.1:1\"}]}", "the same address 127.0.0.1:1");
}

static void missing_file(void)
{
    kc_member *ms;
    int n;
    char err[KC_MEMBER_ERR_LEN] = "";
    CHECK(kc_members_file_load("/nonexistent/nodes.json", &ms, &n, err) == -1, "a missing file loaded");
    CHECK_ERR_HAS(err, "/nonexistent/nodes.json: cannot open");
}

int main(void)
{
    valid();
    invalid();
    missing_file();
    return kt_done("test_membership_file");
}
