/*
 * names.h - the lower-case words for kvrelay.v1 enum values that logs, the CLI's JSON and its
 * tables print ("length", "serving", "decode"), one function per enum so every process spells
 * them alike. Unknown values give "unspecified".
 */
#ifndef KC_NAMES_H
#define KC_NAMES_H

#include "kvrelay/v1/kvrelay.pb-c.h"

const char *kc_finish_reason_name(Kvrelay__V1__FinishReason r);
const char *kc_node_state_name(Kvrelay__V1__NodeState s);
const char *kc_node_role_name(Kvrelay__V1__NodeRole r);

#endif /* KC_NAMES_H */
