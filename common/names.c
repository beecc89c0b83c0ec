/* names.c - kvrelay.v1 enum values as words (names.h). */
#include "names.h"

const char *kc_finish_reason_name(Kvrelay__V1__FinishReason r)
{
    switch (r) {
    case KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS: return "eos";
    case KVRELAY__V1__FINISH_REASON__FINISH_REASON_CONTEXT: return "context";
    default: return "unspecified";
    }
}

const char *kc_node_state_name(Kvrelay__V1__NodeState s)
{
    switch (s) {
    case KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING: return "serving";
    case KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING: return "draining";
    case KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE: return "unreachable";
    case KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT: return "suspect";
    case KVRELAY__V1__NODE_STATE__NODE_STATE_GONE: return "gone";
    default: return "unspecified";
    }
}

const char *kc_node_role_name(Kvrelay__V1__NodeRole r)
{
    switch (r) {
    case KVRELAY__V1__NODE_ROLE__NODE_ROLE_ROUTER: return "router";
    case KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL: return "prefill";
    case KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE: return "decode";
    default: return "unspecified";
    }
}
