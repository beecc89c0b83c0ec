/*
 * test_rpc_nul.c - kc_message_unpack refuses a string field holding a NUL byte (protobuf-c would
 * hand it over cut at the NUL) with INVALID_ARGUMENT naming the message and the field, in the
 * message itself (GenerateRequest.text, the second of the repeated stop strings) and in a
 * sub-message three levels down (GenerateResponse.finish.usage.served_by.prefill_node); and lets
 * through what is not a string: a bytes field of zeros, packed ids that encode as zero bytes, an
 * unknown field, and clean strings, whose values arrive whole. The wire bytes are written here by
 * hand, as a client in another language would send them.
 * No network. Run: ctest -R test_rpc_nul.
 */
#include "kr_test.h"

#include "rpc.h"

#include "kvrelay/v1/internal.pb-c.h"

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

/* Unpacks bytes[0, n) as `desc`: the message (freed by the caller), or NULL with *st set. */
static ProtobufCMessage *unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t n,
                                kc_status *st)
{
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)bytes, n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    ProtobufCMessage *msg = NULL;
    *st = (kc_status){GRPC_STATUS_OK, ""};
    int rc = kc_message_unpack(bb, desc, 0, &msg, st);
    grpc_byte_buffer_destroy(bb);
    CHECK((rc == 0) == (msg != NULL), "rc %d with message %p", rc, (void *)msg);
    return rc == 0 ? msg : NULL;
}

static void refused(const ProtobufCMessageDescriptor *desc, const uint8_t *bytes, size_t n, const char *needle)
{
    kc_status st;
    ProtobufCMessage *msg = unpack(desc, bytes, n, &st);
    CHECK(msg == NULL, "%s: a NUL in a string was let through", needle);
    kc_message_free(msg);
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT, "%s: code %d (%s)", needle, st.code, st.details);
    CHECK_ERR_HAS(st.details, needle);
}

int main(void)
{
    /* GenerateRequest{text (1): "a\0b", max_tokens (3): 5} */
    static const uint8_t text_nul[] = {0x0a, 3, 'a', 0, 'b', 0x18, 5};
    refused(&kvrelay__v1__generate_request__descriptor, text_nul, sizeof text_nul,
            "kvrelay.v1.GenerateRequest.text holds U+0000");

    /* GenerateRequest{text: "hi", stop (5): ["ok", "x\0"]} */
    static const uint8_t stop_nul[] = {0x0a, 2, 'h', 'i', 0x2a, 2, 'o', 'k', 0x2a, 2, 'x', 0};
    refused(&kvrelay__v1__generate_request__descriptor, stop_nul, sizeof stop_nul,
            "kvrelay.v1.GenerateRequest.stop holds U+0000");

    /* GenerateRequest{kv_policy (7): "\0"}: a NUL at the start leaves an empty string behind */
    static const uint8_t policy_nul[] = {0x3a, 1, 0};
    refused(&kvrelay__v1__generate_request__descriptor, policy_nul, sizeof policy_nul, "kv_policy holds U+0000");

    /* GenerateResponse{finish (2): Finish{usage (2): Usage{served_by (9): ServedBy{prefill_node (1): "p\0"}}}} */
    static const uint8_t nested_nul[] = {0x12, 8, 0x12, 6, 0x4a, 4, 0x0a, 2, 'p', 0};
    refused(&kvrelay__v1__generate_response__descriptor, nested_nul, sizeof nested_nul,
            "kvrelay.v1.ServedBy.prefill_node holds U+0000");

    /* not strings: PrefillRequest{reservation_token (10): 4 zero bytes, token_ids (2, packed): [0, 5, 0]},
     * an unknown field 99 (length-delimited, holding a zero), then request_id (1): "r-1" */
    static const uint8_t clean[] = {0x52, 4, 0, 0, 0, 0, 0x12, 3, 0, 5, 0, 0x9a, 0x06, 2, 'z', 0, 0x0a, 3, 'r', '-', '1'};
    kc_status st;
    Kvrelay__V1__PrefillRequest *p =
        (Kvrelay__V1__PrefillRequest *)unpack(&kvrelay__v1__prefill_request__descriptor, clean, sizeof clean, &st);
    CHECK(p != NULL, "bytes, packed ids and an unknown field with zeros were refused: %s", st.details);
    if (p) {
        CHECK(p->reservation_token.len == 4 && p->n_token_ids == 3 && p->token_ids[1] == 5,
              "token %zu bytes, %zu ids", p->reservation_token.len, p->n_token_ids);
        CHECK(!strcmp(p->request_id, "r-1"), "request_id '%s'", p->request_id);
    }
    kc_message_free(p ? &p->base : NULL);

    /* a clean GenerateRequest arrives whole */
    static const uint8_t ok[] = {0x0a, 3, 'a', 'b', 'c', 0x18, 5, 0x3a, 4, 'f', 'u', 'l', 'l'};
    Kvrelay__V1__GenerateRequest *g =
        (Kvrelay__V1__GenerateRequest *)unpack(&kvrelay__v1__generate_request__descriptor, ok, sizeof ok, &st);
    CHECK(g && !strcmp(g->text, "abc") && g->max_tokens == 5 && !strcmp(g->kv_policy, "full"),
          "a clean request: %s", g ? "wrong values" : st.details);
    kc_message_free(g ? &g->base : NULL);
    return kt_done("test_rpc_nul");
}
