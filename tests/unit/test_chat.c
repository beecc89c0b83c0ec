/*
 * test_chat.c - the chat template renderer (engine/chat*.c) on hand-checked cases: every
 * construct of the subset, whitespace control with trim_blocks/lstrip_blocks, the three built-in
 * templates, raise_exception, parse and render errors with their messages, the limits, and
 * kr_chat_template_load's choices. Expected strings were worked out by hand from jinja2's rules
 * (tests/integration/chat_template.sh compares with jinja2 itself). Exact string comparisons.
 * Run: ctest -R test_chat
 */
#include "kr.h"
#include "kr_test.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const kr_chat_message CONV[] = {
    {"system", " Be brief. "},
    {"user", "Hi 'there'"},
    {"assistant", "Hello!\n"},
};

/* Renders src over CONV[0..n) and compares with want exactly. */
static void check_render_n(int line, const char *src, int n, int gen, const char *want)
{
    char err[KR_ERR_MAX] = "";
    kr_chat_template *t;
    if (kr_chat_template_parse(src, "<s>", "</s>", &t, err)) {
        kt_failures++;
        fprintf(stderr, "test_chat.c:%d: parse failed: %s\n  template: %s\n", line, err, src);
        return;
    }
    char *out = NULL;
    size_t len = 0;
    int rc = kr_chat_template_render(t, CONV, n, gen, &out, &len, err);
    if (rc) {
        kt_failures++;
        fprintf(stderr, "test_chat.c:%d: render failed (%d): %s\n  template: %s\n", line, rc, err, src);
    } else if (strcmp(out, want) || len != strlen(want)) {
        kt_failures++;
        fprintf(stderr, "test_chat.c:%d: got [%s] want [%s]\n  template: %s\n", line, out, want, src);
    }
    free(out);
    kr_chat_template_free(t);
}
#define R(src, want) check_render_n(__LINE__, src, 3, 1, want)

/* The template must fail to parse (parse=1) or to render, with err containing needle. */
static void check_error(int line, const char *src, int parse, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_chat_template *t;
    int prc = kr_chat_template_parse(src, "<s>", "</s>", &t, err);
    if (!prc) {
        char *out = NULL;
        int rc = kr_chat_template_render(t, CONV, 3, 1, &out, NULL, err);
        kr_chat_template_free(t);
        if (!rc) {
            kt_failures++;
            fprintf(stderr, "test_chat.c:%d: rendered [%s], want an error with '%s'\n", line, out, needle);
            free(out);
            return;
        }
        if (parse) {
            kt_failures++;
            fprintf(stderr, "test_chat.c:%d: parsed, want a parse error with '%s' (render said: %s)\n", line, needle, err);
            return;
        }
        if (rc != -1) { kt_failures++; fprintf(stderr, "test_chat.c:%d: render error status %d, want -1\n", line, rc); }
    } else if (!parse) {
        kt_failures++;
        fprintf(stderr, "test_chat.c:%d: parse failed (%s), want a render error\n", line, err);
        return;
    }
    if (!strstr(err, needle)) {
        kt_failures++;
        fprintf(stderr, "test_chat.c:%d: error '%s' lacks '%s'\n", line, err, needle);
    }
}
#define PE(src, needle) check_error(__LINE__, src, 1, needle)
#define RE(src, needle) check_error(__LINE__, src, 0, needle)

static void test_expressions(void)
{
    R("{{ 'a' }}{{ \"b\" }}{{ 'c' 'd' }}", "abcd");
    R("{{ 'x\\ny\\t\\\\\\'\\\"' }}", "x\ny\t\\'\"");
    R("{{ '\\x41\\u00e9\\q' }}", "A\xc3\xa9\\q");
    R("{{ 1 }} {{ -2 }} {{ 1.5 }} {{ 1e3 }} {{ 1_000 }}", "1 -2 1.5 1000.0 1000");
    R("{{ true }}{{ False }}{{ none }}{{ None }}", "TrueFalseNoneNone");
    R("{{ [1, 'a', none] }} {{ (1,) }} {{ () }} {{ {'k': [1, 2]} }}", "[1, 'a', None] (1,) () {'k': [1, 2]}");
    R("{{ 7 + 2 }} {{ 7 - 2 }} {{ 7 * 2 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ 7 % 2 }} {{ 2 ** 10 }}", "9 5 14 3.5 3 1 1024");
    R("{{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 4 / 2 }} {{ 7.5 // 2 }} {{ 0.1 + 0.2 }}", "-4 2 -2 2.0 3.0 0.30000000000000004");
    R("{{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 2 ** -1 }}", "1e+16 1000000000000000.0 0.0001 1e-05 0.5");
    R("{{ 'a' ~ 1 ~ none ~ undefined_name ~ [1] }}", "a1None[1]");
    R("{{ 'ab' + 'cd' }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ 2 * [0] }}", "abcd [1, 2] ababab [0, 0]");
    R("{{ 1 == 1.0 }}{{ true == 1 }}{{ '1' == 1 }}{{ 1 != 2 }}{{ 'a' < 'b' }}{{ 2 >= 3 }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}",
      "TrueTrueFalseTrueTrueFalseTrueFalse");
    R("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 3 not in [3] }}{{ 'x' in undefined_name }}",
      "TrueTrueTrueFalseFalse");
    R("{{ not 0 }}{{ 0 or 'x' }}{{ 1 and 'y' }}{{ '' and 'z' }}|{{ none or [] }}", "Truexy|[]");
    R("{{ 'yes' if 1 else 'no' }}{{ 'yes' if 0 else 'no' }}[{{ 'only' if 0 }}]", "yesno[]");
    R("{{ (1 + 2) * 3 }}{{ -(2) }}{{ +3 }}", "9-23");
    /* variables, attributes, items, slices */
    R("{{ messages[1].role }} {{ messages[1]['content'] }} {{ messages[-1].content|trim }}", "user Hi 'there' Hello!");
    R("{{ messages|length }} {{ messages[1:]|length }} {{ messages[::-1][0].role }} {{ messages[5] }}|", "3 2 assistant |");
    R("{{ 'hello'[1] }}{{ 'hello'[-1] }}{{ 'hello'[1:3] }}{{ 'hello'[::-1] }}{{ 'hello'[::2] }}{{ 'héllo'[1] }}",
      "eoelollehhlo\xc3\xa9");
    R("{{ [1, 2, 3, 4][-3:-1] }}{{ [1, 2, 3][5:] }}{{ [1, 2, 3][:-5] }}", "[2, 3][][]");
    R("{{ messages[0].nosuch }}|{{ none.x }}|{{ 'abc'.nosuch }}|{{ messages[1].0 }}", "|||");
    R("{{ messages.0.role }}", "system");
    R("{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ tools }}{{ documents }}", "<s></s>TrueNoneNone");
}

static void test_filters_tests_methods(void)
{
    R("{{ '  a b \\n'|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 5|trim }}", "a b|a|5");
    R("{{ 'héllo'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ nothing|length }}", "5 2 1 0");
    R("{{ 'a\"b\\n'|tojson }} {{ {'k': [1, 2.5, true, none]}|tojson }} {{ 'é'|tojson }}",
      "\"a\\\"b\\n\" {\"k\": [1, 2.5, true, null]} \"\xc3\xa9\"");
    R("{{ {'a': [1, {}], 'b': []}|tojson(indent=2) }}", "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
    R("{{ messages[1]|tojson }}", "{\"role\": \"user\", \"content\": \"Hi 'there'\"}");
    R("{{ 12|string ~ 'x' }} {{ 'AbC'|lower }} {{ 'AbC'|upper }} {{ 'hELLO wORLD'|capitalize }} {{ 'ab-cd ef'|title }}",
      "12x abc ABC Hello world Ab-Cd Ef");
    R("{{ nothing|default('d') }} {{ ''|default('e') }}|{{ ''|default('e', true) }} {{ none|d('n') }}", "d |e None");
    R("{{ [3, 1]|first }}{{ [3, 1]|last }}{{ 'xyz'|first }}{{ []|first }}|{{ [1, 2]|join('-') }}{{ 'ab'|join(',') }}",
      "31x|1-2a,b");
    R("{{ {'a': 1, 'b': 2}|items|list }} {{ 'ab'|list }} {{ {'k': 1}|list }} {{ [1, 2]|reverse|list }} {{ 'ab'|reverse }}",
      "[('a', 1), ('b', 2)] ['a', 'b'] ['k'] [2, 1] ba");
    R("{{ 'aXbX'|replace('X', 'y') }} {{ '3'|int + 1 }} {{ 'x'|int }} {{ -2|abs }} {{ '1.5'|float }}", "ayby 4 0 2 1.5");
    R("{{ x is defined }}{{ x is not defined }}{{ messages is defined }}{{ none is none }}{{ 'a' is string }}"
      "{{ {} is mapping }}{{ [] is iterable }}{{ 3 is number }}{{ 3 is integer }}{{ 3.0 is float }}{{ true is boolean }}",
      "FalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrue");
    R("{{ 4 is even }}{{ 4 is odd }}{{ 9 is divisibleby 3 }}{{ 2 is eq 2 }}{{ 'a' is in 'cat' }}{{ 'ab' is lower }}",
      "TrueFalseTrueTrueTrueTrue");
    R("[{{ '  a b  '.strip() }}|{{ '  a'.lstrip() }}|{{ 'a  '.rstrip() }}|{{ '--a--'.strip('-') }}]", "[a b|a|a|a]");
    R("{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}{{ 'Hello'.startswith('lo') }}", "TrueTrueFalse");
    R("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }}", "['a', 'b', '', 'c'] ['a', 'b'] ['a', 'b c']");
    R("{{ 'abc'.upper() }}{{ 'ABC'.lower() }}{{ 'aaa'.replace('a', 'b', 2) }}{{ 'ab'.replace('', '-') }}{{ 'hi there'.title() }}",
      "ABCabcbba-a-b-Hi There");
    R("{% set d = {'a': 1, 'b': 2} %}{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 0) }}{{ d.keys()|list }}{{ d.values()|list }}"
      "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
      "1None0['a', 'b'][1, 2]a=1;b=2;");
    R("{{ range(3)|list }}{{ range(1, 7, 2)|list }}{{ range(3, 0, -1)|list }}", "[0, 1, 2][1, 3, 5][3, 2, 1]");
}

/* Every filter and test docs/chat-templates.md lists is known to the parser (their tables in
 * engine/chat-builtins.c), and names beyond those are not. */
static void test_builtin_names(void)
{
    static const char *const filters[] = {
        "trim", "length", "count", "tojson", "string", "safe", "lower", "upper", "capitalize", "title",
        "default", "d", "first", "last", "join", "items", "list", "reverse", "replace", "int", "float", "abs"};
    static const char *const tests[] = {
        "defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number", "integer",
        "float", "boolean", "true", "false", "even", "odd", "divisibleby", "eq", "equalto", "ne", "lt", "le",
        "gt", "ge", "in", "lower", "upper", "sameas"};
    static const char *const unknown[] = {"selectattr", "map", "sort", "unique", "indent", "round", "Trim", "tri"};
    char src[128], err[KR_ERR_MAX];
    kr_chat_template *t;
    for (size_t i = 0; i < sizeof filters / sizeof filters[0]; i++) {
        snprintf(src, sizeof src, "{{ x|%s }}", filters[i]);
        if (kr_chat_template_parse(src, "", "", &t, err)) { kt_failures++; fprintf(stderr, "test_chat.c: %s: %s\n", src, err); }
        else kr_chat_template_free(t);
    }
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        snprintf(src, sizeof src, "{{ x is %s }}", tests[i]);
        if (kr_chat_template_parse(src, "", "", &t, err)) { kt_failures++; fprintf(stderr, "test_chat.c: %s: %s\n", src, err); }
        else kr_chat_template_free(t);
    }
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        snprintf(src, sizeof src, "{{ x|%s }}", unknown[i]);
        check_error(__LINE__, src, 1, "no filter named");
        snprintf(src, sizeof src, "{{ x is %s }}", unknown[i]);
        check_error(__LINE__, src, 1, "no test named");
    }
}

static void test_statements(void)
{
    R("{% if messages[0].role == 'system' %}S{% elif false %}E{% else %}N{% endif %}", "S");
    R("{% if 0 %}a{% elif 1 %}b{% else %}c{% endif %}{% if 0 %}a{% elif 0 %}b{% else %}c{% endif %}", "bc");
    R("{% for m in messages %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
      "{{ loop.first|int }}{{ loop.last|int }}{{ loop.length }};{% endfor %}",
      "1032103;2121003;3210013;");
    R("{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined else '-' }}"
      "{{ loop.cycle('a', 'b') }}{% endfor %}", "-asystembusera");
    R("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}{{ m.role[0] }} {% endfor %}", "1/2u 2/2a ");
    R("{% for x in [] %}a{% else %}empty{% endfor %}{% for x in nothing %}a{% else %}undef{% endfor %}", "emptyundef");
    R("{% for i in range(6) %}{% if i == 4 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}", "023");
    R("{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}", "37");
    R("{% for c in 'ab' %}{{ c }}.{% endfor %}{% for k in {'x': 1} %}{{ k }}{% endfor %}", "a.b.x");
    /* set: a loop body's assignments are its own; an if's are not */
    R("{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = x + 1 %}{{ x }}{% endfor %}{{ x }}", "0101010");
    R("{% if true %}{% set y = 5 %}{% endif %}{{ y }}", "5");
    R("{% set ns = namespace(n=0, seen=false) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ ns.seen }}",
      "3False");
    R("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}", "12(1, 2)");
    R("{% set c %}<{{ messages|length }}>{% endset %}[{{ c }}]", "[<3>]");
    R("{% set messages = messages[1:] %}{{ messages|length }}", "2");
    R("{% generation %}{{ 'g' }}{% endgeneration %}", "g");
    R("a{# comment #}b{% raw %}{{ x }}{% if %}{% endraw %}c", "ab{{ x }}{% if %}c");
    R("{{ {'a': {'b': 1}} }}", "{'a': {'b': 1}}"); /* }} inside brackets does not end the tag */
}

static void test_whitespace(void)
{
    /* trim_blocks: the newline after a block tag goes; after }} it stays */
    R("{% if true %}\nx\n{% endif %}\ny", "x\ny");
    R("{{ 'a' }}\nb", "a\nb");
    /* lstrip_blocks: spaces and tabs before a block tag at a line's start go */
    R("  {% if true %}\n  x\n  {% endif %}\n  y", "  x\n  y");
    R("a  {% if true %}b{% endif %}", "a  b"); /* not at a line's start */
    R("  {{ 'v' }}", "  v"); /* not for expressions */
    R("\t{# c #}\nx", "x");
    /* explicit control */
    R("a  \n  {{- 'b' -}}  \n  c", "abc");
    R("a \n {%- if true -%} \n b \n {%- endif %}", "ab");
    R("a\n  {%+ if true %}b{% endif +%}\nc", "a\n  b\nc");
    R("a {#- x -#} b", "ab");
    R("x\n", "x"); /* one trailing newline of the source is dropped */
    R("x\n\n", "x\n");
    R("a\r\nb\rc", "a\nb\nc");
    R("{% for m in messages %}\n    {{ m.role }}\n{% endfor %}\n", "    system\n    user\n    assistant\n");
}

static void test_builtins(void)
{
    char err[KR_ERR_MAX];
    kr_chat_template *t;
    char *out;
    static const kr_chat_message two[] = {{"user", " Hi \n"}, {"assistant", "Hello"}};
    static const kr_chat_message sys2[] = {{"system", "Sys"}, {"user", "Q"}, {"assistant", "A"}, {"user", "Q2"}};
    static const kr_chat_message bad[] = {{"user", "a"}, {"user", "b"}};
    static const kr_chat_message tool[] = {{"user", "a"}, {"tool", "b"}};

    REQUIRE(kr_chat_template_builtin("llama3", NULL, NULL, &t, err) == 0, "%s", err);
    CHECK(!strcmp(kr_chat_template_source(t), "built-in llama3"), "%s", kr_chat_template_source(t));
    REQUIRE(kr_chat_template_render(t, two, 2, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n"), "llama3: [%s]", out);
    free(out);
    kr_chat_template_free(t);

    REQUIRE(kr_chat_template_builtin("chatml", NULL, NULL, &t, err) == 0, "%s", err);
    REQUIRE(kr_chat_template_render(t, two, 2, 0, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n Hi \n<|im_end|>\n"
                       "<|im_start|>assistant\nHello<|im_end|>\n"), "chatml: [%s]", out);
    free(out);
    REQUIRE(kr_chat_template_render(t, sys2, 1, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "<|im_start|>system\nSys<|im_end|>\n<|im_start|>assistant\n"), "chatml system: [%s]", out);
    free(out);
    kr_chat_template_free(t);

    REQUIRE(kr_chat_template_builtin("mistral", NULL, NULL, &t, err) == 0, "%s", err);
    REQUIRE(kr_chat_template_render(t, sys2, 4, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "<s>[INST] Sys\n\nQ [/INST]A</s>[INST] Q2 [/INST]"), "mistral: [%s]", out);
    free(out);
    out = NULL;
    CHECK(kr_chat_template_render(t, bad, 2, 1, &out, NULL, err) == KR_CHAT_RAISED && !out, "user twice renders");
    CHECK(!strcmp(err, "Conversation roles must alternate user/assistant/user/assistant/..."), "[%s]", err);
    CHECK(kr_chat_template_render(t, tool, 2, 1, &out, NULL, err) == KR_CHAT_RAISED, "tool role renders");
    CHECK_ERR_HAS(err, "Only user and assistant roles");
    kr_chat_template_free(t);

    CHECK(kr_chat_template_builtin("gpt2", NULL, NULL, &t, err) == -1, "unknown built-in");
    CHECK_ERR_HAS(err, "no built-in chat template named 'gpt2'");
}

static void test_errors_and_limits(void)
{
    char err[KR_ERR_MAX];
    kr_chat_template *t;
    char *out = NULL;
    /* raise_exception: the message exactly, and its own status */
    REQUIRE(kr_chat_template_parse("ok{{ raise_exception('No ' ~ messages|length ~ ' here') }}", NULL, NULL, &t, err) == 0, "%s", err);
    CHECK(kr_chat_template_render(t, CONV, 3, 1, &out, NULL, err) == KR_CHAT_RAISED && !out, "raise");
    CHECK(!strcmp(err, "No 3 here"), "[%s]", err);
    kr_chat_template_free(t);

    PE("{{ x", "line 1 column 1: unterminated expression (no closing }})");
    PE("a\n{% if x %}", "line 2 column 11: unexpected end of template: expected {% endif %}");
    PE("{% for x in y %}{% endif %}", "unknown tag 'endif'");
    PE("{# open", "unterminated comment");
    PE("{{ 'abc }}", "unterminated string");
    PE("{{ x|nosuch }}", "line 1 column 6: no filter named 'nosuch'");
    PE("{{ x is nosuch }}", "no test named 'nosuch'");
    PE("{% macro m() %}{% endmacro %}", "'macro' tags are not supported");
    PE("{% frobnicate %}", "unknown tag 'frobnicate'");
    PE("{{ 1 + }}", "unexpected end of print statement");
    PE("{{ (1 }}", "unexpected '}', expected ')'");
    PE("{{ ] }}", "unexpected ']'");
    PE("{% break %}", "'break' outside of a for loop");
    PE("{{ a @ b }}", "unexpected character '@'");
    PE("{{ 99999999999999999999 }}", "does not fit in 64 bits");
    PE("{% set %}", "expected a variable name");
    PE("{% raw %}never closed", "missing {% endraw %}");
    RE("{{ x.y }}", "line 1: 'x' is undefined");
    RE("\n{{ 'a' + 1 }}", "line 2: unsupported operand type(s) for +: 'str' and 'int'");
    RE("{{ 1 < 'a' }}", "'<' not supported between instances of 'int' and 'str'");
    RE("{{ 1 // 0 }}", "integer division or modulo by zero");
    RE("{{ nosuchfunction() }}", "'nosuchfunction' is undefined");
    RE("{% for x in 5 %}{% endfor %}", "'int' object is not iterable");
    RE("{{ [].append(1) }}", "templates cannot modify lists");
    RE("{% set v = 1 %}{% set v.a = 2 %}", "not a namespace()");
    RE("{{ 2 ** 64 }}", "integer overflow");
    RE("{{ nothing|tojson }}", "not JSON serializable");
    RE("{% for a, b in [[1]] %}{% endfor %}", "not enough values to unpack (expected 2, got 1)");
    RE("{{ messages|items }}", "can only get item pairs from a mapping");
    /* limits */
    RE("{{ range(100001)|length }}", "range() too big");
    RE("{% for i in range(100000) %}{% for j in range(11) %}{% endfor %}{% endfor %}", "more than 1000000 loop iterations");
    RE("{{ 'x' * 20000000 }}", "string longer than 16 MiB");
    RE("{% for i in range(5000) %}{{ 'x' * 4000 }}{% endfor %}", "rendered output longer than 16 MiB");
    RE("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
       "longer than 16 MiB");
    {
        /* nesting: deep brackets are refused, not a stack overflow */
        char src[4096];
        size_t k = 0;
        k += (size_t)snprintf(src + k, sizeof src - k, "{{ ");
        for (int i = 0; i < 500; i++) src[k++] = '(';
        src[k++] = '1';
        for (int i = 0; i < 500; i++) src[k++] = ')';
        snprintf(src + k, sizeof src - k, " }}");
        PE(src, "nested too deep");
        k = 0;
        for (int i = 0; i < 200; i++) k += (size_t)snprintf(src + k, sizeof src - k, "{%% if 1 %%}");
        PE(src, "nested too deep");
    }
    /* rendering twice gives the same bytes (no state kept in the template) */
    REQUIRE(kr_chat_template_parse("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
                                   NULL, NULL, &t, err) == 0, "%s", err);
    for (int r = 0; r < 2; r++) {
        REQUIRE(kr_chat_template_render(t, CONV, 3, 1, &out, NULL, err) == 0, "%s", err);
        CHECK(!strcmp(out, "3"), "render %d: [%s]", r, out);
        free(out);
    }
    kr_chat_template_free(t);
    /* NULL content is None */
    static const kr_chat_message nul[] = {{"user", NULL}};
    REQUIRE(kr_chat_template_parse("{{ messages[0].content }}|{{ messages[0].content is none }}", NULL, NULL, &t, err) == 0, "%s", err);
    REQUIRE(kr_chat_template_render(t, nul, 1, 0, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "None|True"), "[%s]", out);
    free(out);
    kr_chat_template_free(t);
}

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    REQUIRE(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

static void test_load(void)
{
    char dir[] = "/tmp/test_chat_XXXXXX", err[KR_ERR_MAX], path[600];
    REQUIRE(mkdtemp(dir), "mkdtemp");
    kr_chat_template *t;
    char *out;
    static const kr_chat_message one[] = {{"user", "Hi"}};

    /* no tokenizer_config.json: the built-in by model_type, with the format's own tokens */
    write_file(dir, "config.json", "{\"model_type\": \"qwen2\"}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    CHECK(!strcmp(kr_chat_template_source(t), "built-in chatml"), "%s", kr_chat_template_source(t));
    kr_chat_template_free(t);
    write_file(dir, "config.json", "{\"model_type\": \"mistral\"}");
    write_file(dir, "tokenizer_config.json", "{\"bos_token\": {\"content\": \"<B>\"}, \"eos_token\": \"<E>\"}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    CHECK(!strcmp(kr_chat_template_source(t), "built-in mistral"), "%s", kr_chat_template_source(t));
    CHECK(!strcmp(kr_chat_template_bos(t), "<B>") && !strcmp(kr_chat_template_eos(t), "<E>"), "bos/eos from the config");
    kr_chat_template_free(t);
    write_file(dir, "config.json", "{\"model_type\": \"llama\"}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    CHECK(!strcmp(kr_chat_template_source(t), "built-in llama3"), "%s", kr_chat_template_source(t));
    kr_chat_template_free(t);
    write_file(dir, "config.json", "{\"model_type\": \"gpt2\"}");
    CHECK(kr_chat_template_load(dir, &t, err) == -1, "gpt2 has a template");
    CHECK_ERR_HAS(err, "the model has no chat template");
    CHECK_ERR_HAS(err, "\"gpt2\"");

    /* the file's own template wins: a string, or a list where "default" wins */
    write_file(dir, "tokenizer_config.json", "{\"bos_token\": \"<B>\", \"chat_template\": \"{{ bos_token }}{{ messages[0].content }}\"}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    CHECK(!strcmp(kr_chat_template_source(t), "tokenizer_config.json"), "%s", kr_chat_template_source(t));
    REQUIRE(kr_chat_template_render(t, one, 1, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "<B>Hi"), "[%s]", out);
    free(out);
    kr_chat_template_free(t);
    write_file(dir, "tokenizer_config.json",
               "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}, {\"name\": \"default\", \"template\": \"D\"}]}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    REQUIRE(kr_chat_template_render(t, one, 1, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "D"), "[%s]", out);
    free(out);
    kr_chat_template_free(t);
    write_file(dir, "tokenizer_config.json", "{\"chat_template\": [{\"name\": \"a\", \"template\": \"A\"}, {\"name\": \"b\", \"template\": \"B\"}]}");
    REQUIRE(kr_chat_template_load(dir, &t, err) == 0, "%s", err);
    REQUIRE(kr_chat_template_render(t, one, 1, 1, &out, NULL, err) == 0, "%s", err);
    CHECK(!strcmp(out, "A"), "[%s]", out);
    free(out);
    kr_chat_template_free(t);
    /* a broken template names the file */
    write_file(dir, "tokenizer_config.json", "{\"chat_template\": \"{% if %}\"}");
    CHECK(kr_chat_template_load(dir, &t, err) == -1, "broken template loads");
    CHECK_ERR_HAS(err, "tokenizer_config.json: chat_template line 1 column 7");
    write_file(dir, "tokenizer_config.json", "{\"chat_template\": 5}");
    CHECK(kr_chat_template_load(dir, &t, err) == -1, "numeric template loads");
    CHECK_ERR_HAS(err, "chat_template must be a string or a list");

    /* the default model's template: BOS, then the contents, system first, one per line */
    const char *src = kt_env("KR_FIXTURES");
    if (src) {
        snprintf(path, sizeof path, "%s/../../models/kjv-2l128-2k", src);
        static const kr_chat_message c3[] = {{"user", "And God said"}, {"system", "In the beginning"}, {"assistant", "Let there be light"}};
        REQUIRE(kr_chat_template_load(path, &t, err) == 0, "%s", err);
        CHECK(!strcmp(kr_chat_template_source(t), "tokenizer_config.json"), "%s", kr_chat_template_source(t));
        REQUIRE(kr_chat_template_render(t, c3, 3, 1, &out, NULL, err) == 0, "%s", err);
        CHECK(!strcmp(out, "<|begin_of_text|>In the beginning\nAnd God said\nLet there be light"), "kjv: [%s]", out);
        free(out);
        kr_chat_template_free(t);
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    test_expressions();
    test_filters_tests_methods();
    test_builtin_names();
    test_statements();
    test_whitespace();
    test_builtins();
    test_errors_and_limits();
    test_load();
    return kt_done("test_chat");
}
