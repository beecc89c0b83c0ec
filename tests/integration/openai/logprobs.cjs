// logprobs.cjs - the official openai npm package asking kvrelay's OpenAI-compatible API for
// log-probabilities and echo; driven by tests/integration/openai_logprobs.py, which compares
// what this prints with the gRPC API's values.
//   node logprobs.cjs BASE_URL MODEL PROMPT
// Prints one JSON object: the values as the SDK parsed them (completions with logprobs 3,
// streamed and not; echo + logprobs 1 + max_tokens 0; chat with logprobs and top_logprobs 2,
// streamed and not). Exits 1 when a request fails.
'use strict';
const OpenAI = require('openai');

const [base, model, prompt] = process.argv.slice(2);
const client = new OpenAI({ baseURL: base, apiKey: 'none', maxRetries: 0, timeout: 120000 });
const messages = [{ role: 'user', content: 'In the beginning' }];

async function main() {
  const out = {};
  const c = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0, logprobs: 3 });
  out.completion = c.choices[0].logprobs;
  out.completion_stream = [];
  for await (const chunk of await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0,
                                                              logprobs: 3, stream: true })) {
    const lp = chunk.choices[0]?.logprobs;
    if (lp) out.completion_stream.push(...lp.token_logprobs);
  }
  const e = await client.completions.create({ model, prompt, max_tokens: 0, echo: true, logprobs: 1,
                                              temperature: 0 });
  out.echo = e.choices[0].logprobs;
  out.echo_text = e.choices[0].text;
  const ch = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0,
                                                    logprobs: true, top_logprobs: 2 });
  out.chat = ch.choices[0].logprobs.content;
  out.chat_stream = [];
  for await (const chunk of await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0,
                                                                   logprobs: true, top_logprobs: 2, stream: true })) {
    const lp = chunk.choices[0]?.logprobs;
    if (lp && lp.content) out.chat_stream.push(...lp.content.map((x) => x.logprob));
  }
  console.log(JSON.stringify(out));
}

main().catch((err) => {
  console.error(`FAIL: ${err.status || ''} ${err.message}`);
  process.exit(1);
});
