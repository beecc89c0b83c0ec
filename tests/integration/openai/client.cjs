// client.cjs - the official openai npm package (and Node's own fetch for what the SDK will not
// send) against kvrelay's OpenAI-compatible API; driven by tests/integration/openai_api.sh.
//   node client.cjs PHASE BASE_URL API_KEY MODEL
// PHASE: main (models, completions, chat, streams, stops, concurrency, an aborted stream, every
// 4xx), full (expects 429: the decode pool is held by the test), down (expects 503: no decode
// node). Expected texts come from the gRPC API in KR_EXPECT (JSON). Exits 1 on the first failed
// check, naming it.
'use strict';
const OpenAI = require('openai');

const [phase, base, key, model] = process.argv.slice(2);
const expect = JSON.parse(process.env.KR_EXPECT || '{}');
const client = new OpenAI({ baseURL: base, apiKey: key, maxRetries: 0, timeout: 120000 });

function check(cond, what) {
  if (!cond) {
    console.error(`FAIL: ${what}`);
    process.exit(1);
  }
  console.log(`ok: ${what}`);
}

// Awaits p, which must fail with HTTP `status`; returns the SDK's error.
async function refused(p, status, what) {
  try {
    await p;
  } catch (e) {
    check(e.status === status, `${what}: HTTP ${e.status} (${e.message})`);
    return e;
  }
  check(false, `${what}: succeeded, expected HTTP ${status}`);
}

// A raw request with Node's fetch: [status, parsed JSON body].
async function raw(path, init) {
  const r = await fetch(base + path, init);
  const text = await r.text();
  let body = null;
  try {
    body = JSON.parse(text);
  } catch (e) {
    body = text;
  }
  return [r.status, body];
}

function errorShape(body) {
  const e = body && body.error;
  return !!e && typeof e.message === 'string' && typeof e.type === 'string' && 'param' in e && 'code' in e;
}

async function metric(url, name) {
  const text = await (await fetch(url)).text();
  let sum = 0;
  let seen = false;
  for (const line of text.split('\n')) {
    if (line.startsWith(name + '{') || line.startsWith(name + ' ')) {
      sum += Number(line.split(' ').pop());
      seen = true;
    }
  }
  return seen ? sum : NaN;
}

// Polls until the decode node holds no used or reserved block and the router has counted
// `cancelled` CANCELLED requests (or 20 s pass); returns [used, reserved, cancelled].
async function settled(cancelled) {
  let now = [NaN, NaN, NaN];
  for (let i = 0; i < 400; i++) {
    now = [await metric(expect.decode_metrics, 'kvrelay_kv_blocks_used'),
           await metric(expect.decode_metrics, 'kvrelay_kv_blocks_reserved'),
           await metric(expect.router_metrics, 'kvrelay_requests_total{status="CANCELLED"}')];
    if (now[0] === 0 && now[1] === 0 && now[2] === cancelled) break;
    await new Promise((res) => setTimeout(res, 50));
  }
  return now;
}

async function streamText(params) {
  const stream = await client.completions.create({ ...params, stream: true });
  let text = '';
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) {
      text += chunk.choices[0].text;
      if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    }
  }
  return [text, finish];
}

async function main() {
  // models
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === model, `GET /v1/models lists ${model}`);
  check((await client.models.retrieve(model)).id === model, `GET /v1/models/${model}`);
  await refused(client.models.retrieve('no-such-model'), 404, 'GET /v1/models/no-such-model');

  // completions: greedy text equals the gRPC API's, under the full cache and a policy
  const prompt = expect.prompt;
  const greedy = { model, prompt, max_tokens: expect.max_tokens, temperature: 0 };
  let r = await client.completions.create(greedy);
  check(r.object === 'text_completion' && r.choices.length === 1, 'completion object');
  check(r.choices[0].text === expect.full, `completion text equals gRPC's: ${JSON.stringify(r.choices[0].text)}`);
  check(r.choices[0].finish_reason === expect.full_finish, `finish_reason ${r.choices[0].finish_reason}`);
  check(r.usage.prompt_tokens === expect.prompt_tokens && r.usage.completion_tokens === expect.completion_tokens &&
        r.usage.total_tokens === expect.prompt_tokens + expect.completion_tokens, `usage ${JSON.stringify(r.usage)}`);
  check(r.kvrelay && r.kvrelay.kv_bytes_shipped > 0 && r.kvrelay.kv_footprint === 1 && r.kvrelay.peak_kv_entries > 0,
        `kvrelay usage extras ${JSON.stringify(r.kvrelay)}`);
  r = await client.completions.create({ ...greedy, kv_policy: expect.policy });
  check(r.choices[0].text === expect.policy_text, `kv_policy ${expect.policy}: text equals gRPC's`);
  check(r.kvrelay.kv_policy === expect.policy && r.kvrelay.kv_footprint < 1, `kv_policy footprint ${r.kvrelay.kv_footprint}`);
  r = await client.completions.create({ ...greedy, prompt: expect.prompt_ids });
  check(r.choices[0].text === expect.full, 'a prompt of token ids gives the same text');

  // streamed: the same text, and the usage chunk when asked for
  const [text, finish] = await streamText(greedy);
  check(text === expect.full && finish === expect.full_finish, 'streamed completion equals the non-streamed one');
  const stream = await client.completions.create({ ...greedy, stream: true, stream_options: { include_usage: true } });
  let usage = null;
  let last = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    last = chunk;
  }
  check(usage && usage.completion_tokens === expect.completion_tokens && last.choices.length === 0,
        `include_usage: a last chunk with usage ${JSON.stringify(usage)}`);

  // stop strings end the text before them
  const stopAt = expect.full.indexOf(expect.stop);
  r = await client.completions.create({ ...greedy, stop: [expect.stop] });
  check(r.choices[0].text === expect.full.slice(0, stopAt) && r.choices[0].finish_reason === 'stop',
        `stop ${JSON.stringify(expect.stop)}: ${JSON.stringify(r.choices[0].text)}`);

  // chat, streamed and not
  const messages = [{ role: 'system', content: 'In the beginning' }, { role: 'user', content: 'God created the heaven' }];
  const chat = await client.chat.completions.create({ model, messages, max_completion_tokens: 20, temperature: 0 });
  check(chat.object === 'chat.completion' && chat.choices[0].message.role === 'assistant', 'chat.completion object');
  check(chat.choices[0].message.content === expect.chat, `chat text equals gRPC's on the rendered prompt: ${JSON.stringify(chat.choices[0].message.content)}`);
  check(chat.usage.completion_tokens === 20 && chat.choices[0].finish_reason === 'length', 'chat usage and finish');
  const cs = await client.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0, stream: true });
  let content = '';
  let role = null;
  for await (const chunk of cs) {
    const d = chunk.choices[0].delta;
    if (d.role) role = d.role;
    if (d.content) content += d.content;
  }
  check(role === 'assistant' && content === expect.chat, 'streamed chat equals the non-streamed one');
  // sampling with a seed repeats
  const seeded = { model, messages, max_tokens: 16, temperature: 0.8, seed: 7 };
  const a = await client.chat.completions.create(seeded);
  const b = await client.chat.completions.create(seeded);
  check(a.choices[0].message.content === b.choices[0].message.content, 'a seeded sampled chat repeats');

  // concurrent streams all give the greedy text
  const all = await Promise.all([0, 1, 2, 3].map(() => streamText(greedy)));
  check(all.every(([t]) => t === expect.full), '4 concurrent streams each equal the greedy text');

  // an aborted stream frees its decode slot: the decode node holds no block soon after
  const cancelledBefore = await metric(expect.router_metrics, 'kvrelay_requests_total{status="CANCELLED"}');
  const long = await client.completions.create({ model, prompt, max_tokens: expect.long_tokens, temperature: 0, stream: true });
  let chunks = 0;
  for await (const chunk of long) {
    if (++chunks === 2) break; // leaving the loop aborts the request (the SDK closes the socket)
  }
  check(chunks === 2, 'the long stream started');
  let [used, reserved, cancelled] = await settled(cancelledBefore + 1);
  check(cancelled === cancelledBefore + 1, `the router counted the aborted stream as CANCELLED (${cancelledBefore} -> ${cancelled})`);
  check(used === 0 && reserved === 0, `the decode node holds no block after the abort (used ${used}, reserved ${reserved})`);
  // the same for a non-streamed request whose client gives up while it is generated
  const controller = new AbortController();
  const whole = client.completions.create({ model, prompt, max_tokens: expect.long_tokens, temperature: 0 },
                                          { signal: controller.signal });
  let byPolicy = 0;
  for (let i = 0; i < 400; i++) { // abort once the decode node holds the request's blocks
    byPolicy = await metric(expect.decode_metrics, 'kvrelay_kv_blocks_used_by_policy{policy="full"}');
    if (byPolicy > 0) break;
    await new Promise((res) => setTimeout(res, 5));
  }
  controller.abort();
  check(byPolicy > 0, `the decode node counts the running request's blocks under its policy (${byPolicy})`);
  await whole.then(() => check(false, 'the aborted request finished'), () => {});
  [used, reserved, cancelled] = await settled(cancelledBefore + 2);
  check(cancelled === cancelledBefore + 2 && used === 0 && reserved === 0,
        `an aborted non-streamed request is CANCELLED and frees its blocks (used ${used}, reserved ${reserved})`);

  // errors: OpenAI's error object and status
  let e = await refused(client.completions.create({ ...greedy, model: 'gpt-4' }), 404, 'unknown model');
  check(e.code === 'model_not_found', 'unknown model: code model_not_found');
  e = await refused(client.completions.create({ ...greedy, max_tokens: 100000 }), 400, 'max_tokens beyond the context');
  check(e.code === 'context_length_exceeded' && e.param === 'max_tokens', 'context_length_exceeded on max_tokens');
  e = await refused(client.chat.completions.create({ model, messages, max_tokens: 100000 }), 400, 'chat max_tokens beyond the context');
  e = await refused(client.completions.create({ ...greedy, kv_policy: 'nosuchpolicy' }), 400, 'unknown kv_policy');
  check(e.param === 'kv_policy', `unknown kv_policy names param kv_policy (${e.param}: ${e.message})`);
  e = await refused(client.completions.create({ ...greedy, n: 17 }), 400, 'n = 17');
  check(e.param === 'n', 'n = 17 names param n');
  e = await refused(client.completions.create({ ...greedy, temperature: -1 }), 400, 'temperature -1');
  e = await refused(client.completions.create({ ...greedy, frobnicate: 1 }), 400, 'an unknown field');
  check(e.param === 'frobnicate', 'an unknown field is named');
  e = await refused(client.chat.completions.create({ model, messages: [] }), 400, 'empty messages');
  e = await refused(client.completions.create({ ...greedy, stream: true, kv_policy: 'nosuchpolicy' }), 400,
                    'a streamed request refused before its first token gets a real status');
  const badKey = new OpenAI({ baseURL: base, apiKey: 'wrong-key', maxRetries: 0 });
  e = await refused(badKey.models.list(), 401, 'a wrong API key');
  check(e.code === 'invalid_api_key', 'wrong key: code invalid_api_key');
  await refused(badKey.completions.create(greedy), 401, 'a wrong API key on completions');
  let [status, body] = await raw('/models', {});
  check(status === 401 && errorShape(body), 'no API key: 401 with an error object');
  const auth = { authorization: `Bearer ${key}`, 'content-type': 'application/json' };
  [status, body] = await raw('/completions', { method: 'POST', headers: auth, body: '{"model": ' });
  check(status === 400 && errorShape(body), `malformed JSON: 400 (${body.error && body.error.message})`);
  [status, body] = await raw('/completions', { method: 'POST', headers: auth, body: '[1, 2]' });
  check(status === 400 && errorShape(body), 'a body that is not an object: 400');
  [status, body] = await raw('/completions', { method: 'GET', headers: auth });
  check(status === 405 && errorShape(body), 'GET /v1/completions: 405');
  [status, body] = await raw('/completions', { method: 'POST', headers: { ...auth, 'x-request-id': 'my-id-42' },
                                               body: JSON.stringify({ ...greedy, max_tokens: 2 }) });
  check(status === 200 && body.id === 'cmpl-my-id-42' && body.kvrelay.request_id === 'my-id-42',
        'X-Request-Id names the request');
  [status, body] = await raw('/completions', { method: 'POST', headers: { ...auth, 'x-request-id': 'has space' },
                                               body: JSON.stringify(greedy) });
  check(status === 400 && body.error.param === 'X-Request-Id', 'a bad X-Request-Id: 400');
  [status, body] = await raw('/embeddings', { method: 'POST', headers: auth, body: '{}' });
  check(status === 404 && errorShape(body), 'an unknown route: 404');
  [status, body] = await raw('/completions', { method: 'POST', headers: auth, body: 'x'.repeat(5 << 20) });
  check(status === 413 && errorShape(body), 'a body over the limit: 413');
  const m413 = await metric(expect.router_metrics, 'kvrelay_http_responses_total{code="413"}');
  const m401 = await metric(expect.router_metrics, 'kvrelay_http_responses_total{code="401"}');
  check(m413 === 1 && m401 === 3, `kvrelay_http_responses_total counts them (413: ${m413}, 401: ${m401})`);
}

async function full() {
  await refused(client.completions.create({ model, prompt: expect.prompt, max_tokens: 8, temperature: 0 }), 429,
                'no decode room within --max-queue-ms');
  await refused(client.chat.completions.create({ model, messages: [{ role: 'user', content: 'And' }], max_tokens: 8, stream: true }),
                429, 'a streamed request with no room');
}

async function down() {
  await refused(client.completions.create({ model, prompt: expect.prompt, max_tokens: 8, temperature: 0 }), 503,
                'no decode node can serve');
}

({ main, full, down })[phase]().catch((e) => {
  console.error(`FAIL: ${phase}: ${e.stack || e}`);
  process.exit(1);
});
