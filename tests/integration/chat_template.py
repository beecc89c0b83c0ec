"""chat_template.py - the chat template renderer (engine/chat.c) against jinja2, the reference.

Renders every template below (the three built-in ones, exported by kvrelay-tokenize so that
engine/chat.c stays their one source, the default model's, and handwritten templates in the
style of real Hugging Face ones) over many random conversations, once with jinja2 set up as
transformers sets it up (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
loopcontrols; HF's tojson and raise_exception; tools = documents = None) and once with
`kvrelay-tokenize --chat FILE --jsonl`, and requires byte-identical text, the same
raise_exception messages, and an error from ours wherever jinja2 fails otherwise.
Usage: chat_template.py KVRELAY_TOKENIZE MODEL_DIR   (exit 0 pass, 1 fail, 77 no jinja2)
"""
import json
import os
import random
import subprocess
import sys
import tempfile

try:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("chat_template: python3-jinja2 missing: SKIPPED")
    sys.exit(77)

TOOL, MODEL = sys.argv[1], sys.argv[2]
CONVERSATIONS = 300  # per template

# ChatML with Qwen2.5's default system message and tool-response grouping, no tools.
QWEN25 = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 3.1 style: system message taken out with messages[1:], a namespace, tojson.
LLAMA31 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- set ns = namespace(count=0, last_role=none) %}
{%- for message in messages %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {{- {"output": message.content, "n": ns.count, "previous": ns.last_role}|tojson }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
    {%- set ns.last_role = message.role %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral v0.3 style: the system message goes into the last user turn (loop.last).
MISTRAL03 = r"""{%- if messages and messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- if message["role"] == "user" %}
        {%- if loop.index0 == ns.last_user and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Gemma style: no system role, assistant renamed to model, alternation enforced.
GEMMA = r"""{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '
' + message['content'] | trim + '<end_of_turn>
' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model
'}}{% endif %}"""

# Phi-3 style: one tag per role, eos at the end without a generation prompt.
PHI3 = r"""{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'user' %}{{'<|user|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>
' + message['content'] + '<|end|>
'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>
' }}{% else %}{{ eos_token }}{% endif %}"""

# Plain tags, indentation, comments, {%+ and +%}, raw: trim_blocks and lstrip_blocks decide.
WHITESPACE = """{# A template written with plain tags: trim_blocks and lstrip_blocks decide its whitespace #}
{% for message in messages %}
    {% if message.role == 'system' %}
  [SYS]  {{ message.content }}
    {% else %}
{{ message.role | upper }}:   {{ message.content }}   
    {% endif %}
\t{#- a tab-indented comment -#}
    {%+ if loop.last %}  (last)  {% endif +%}
  {% raw %}{{ raw }} {% x %}{% endraw %}

   {{- '<' -}}   {{ loop.index }}   {#- gap #}   {{ '>' }}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:{{ ' ' }}
{% endif %}
"""

# Expressions: dict literal and .get, slices, string methods, filters, tests, loop fields.
EXPRESSIONS = r"""{%- set names = {'user': 'U', 'assistant': 'A', 'system': 'S'} %}
{%- for m in messages %}
{{- names.get(m.role, '?') ~ loop.index ~ '/' ~ loop.revindex0 ~ (loop.previtem.role if loop.previtem is defined else '-') ~ ':' }}
{{- m.content[:5] ~ '|' ~ m.content[::-2] ~ '|' ~ (m.content|length) ~ '|' ~ m.content.split()|join(',') }}
{{- '|' ~ m.content.strip().upper() ~ '|' ~ m.content.lstrip()|tojson ~ '|' ~ (m.content.startswith(' ') and 'sp' or 'ns') }}
{{- '|' ~ (m|tojson(indent=2)) ~ '|' ~ ('x' if m.content is string and m.content|trim else 'empty') }}
{{- '|' ~ m.content.replace('a', '4').split('\n')|length ~ '|' ~ (m.content|string|lower) ~ '|' ~ m['content'][-1:] ~ '\n' }}
{%- endfor %}
{{- (messages|length) ~ (messages|length is even) ~ (messages|first|default({'role': 'none'})).role ~ [1, 2.5, none, true, 'q']|tojson }}
{{- (messages|length // 2) ~ (messages|length % 3) ~ (messages|length / 4) ~ range(3)|list|string ~ 'x' * 3 }}
"""

HANDWRITTEN = {"qwen2.5-like": QWEN25, "llama3.1-like": LLAMA31, "mistral0.3-like": MISTRAL03,
               "gemma-like": GEMMA, "phi3-like": PHI3, "whitespace": WHITESPACE,
               "expressions": EXPRESSIONS}

PIECES = ["hello", "Hello, world.", "", " ", "  padded  ", "\n", "two\nlines", "trailing\n\n",
          "\ttab", "it's", 'say "hi"', "back\\slash", "héllo wörld", "日本語のテキスト", "emoji 🙂✓",
          "\u00a0nbsp\u2003em", "{{ not a tag }}", "{% if %}", "<|eot_id|>", "[INST]", "a" * 50,
          "end.", "And God said, Let there be light", "x" * 3 + "\r\n"]
ROLES = ["system", "user", "assistant", "tool"]


def content(rng):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 3)))


def conversation(rng, i):
    """Half well-formed chats (optional system, alternating user/assistant), half anything."""
    if i % 2 == 0:
        msgs = [{"role": "system", "content": content(rng)}] if rng.random() < 0.4 else []
        for k in range(rng.randint(1, 6)):
            msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": content(rng)})
    else:
        msgs = [{"role": rng.choice(ROLES), "content": content(rng)} for _ in range(rng.randint(0, 5))]
    if rng.random() < 0.03 and msgs:
        msgs[rng.randrange(len(msgs))]["content"] = None
    return {"messages": msgs, "add_generation_prompt": rng.random() < 0.6}


def tool_output(args):
    r = subprocess.run([TOOL, "--model", MODEL] + args, capture_output=True)
    if r.returncode != 0:
        print("FAIL: kvrelay-tokenize %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr.decode()))
        sys.exit(1)
    return r.stdout.decode("utf-8")


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Raised(TemplateError):
        pass

    def raise_exception(message):
        raise Raised(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(os.path.join(MODEL, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    bos, eos = tcfg["bos_token"], tcfg["eos_token"]

    templates = {}
    for name in ("llama3", "chatml", "mistral"):
        templates["builtin:" + name] = ("builtin:" + name,
                                        tool_output(["--template", "builtin:" + name, "--show-template"]))
    templates["model"] = (None, tool_output(["--show-template"]))
    if templates["model"][1] != tcfg["chat_template"]:
        print("FAIL: --show-template is not the model's chat_template")
        return 1

    rng = random.Random(20250101)
    fails = checked = raised = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in HANDWRITTEN.items():
            path = os.path.join(tmp, name + ".jinja")
            with open(path, "w", encoding="utf-8") as f:
                f.write(src)
            templates[name] = (path, src)
        for name, (arg, src) in templates.items():
            convs = [conversation(rng, i) for i in range(CONVERSATIONS)]
            jl = os.path.join(tmp, "convs.jsonl")
            with open(jl, "w", encoding="utf-8") as f:
                for cv in convs:
                    f.write(json.dumps(cv, ensure_ascii=False) + "\n")
            args = ["--chat", jl, "--jsonl"] + (["--template", arg] if arg else [])
            ours = [json.loads(line) for line in tool_output(args).splitlines()]
            if len(ours) != len(convs):
                print("FAIL %s: %d results for %d conversations" % (name, len(ours), len(convs)))
                return 1
            tpl = env.from_string(src)
            for cv, got in zip(convs, ours):
                try:
                    want, kind = tpl.render(messages=cv["messages"], add_generation_prompt=cv["add_generation_prompt"],
                                            bos_token=bos, eos_token=eos, tools=None, documents=None), "text"
                except Raised as e:
                    want, kind = str(e), "raised"
                except Exception as e:  # any other failure: ours must fail too, any message
                    want, kind = "%s: %s" % (type(e).__name__, e), "error"
                checked += 1
                ok = (kind == "text" and got.get("text") == want) or \
                     (kind == "raised" and got.get("raised") is True and got.get("error") == want) or \
                     (kind == "error" and "error" in got and not got.get("raised"))
                raised += kind == "raised"
                if not ok:
                    fails += 1
                    if fails <= 5:
                        print("FAIL %s: %s\n  jinja2 (%s): %r\n  ours: %r" % (name, json.dumps(cv, ensure_ascii=False),
                                                                        kind, want, got))
    print("chat_template: %d renders over %d templates, %d raise_exception cases, %d mismatches"
          % (checked, len(templates), raised, fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
