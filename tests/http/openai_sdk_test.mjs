// treeserve's HTTP API through OpenAI's own Node client (the `openai` package, pinned by
// package-lock.json): completions whole and streamed with logprobs, chat completions whole and
// streamed with n = 3 and logprobs, errors as the SDK's error classes, and a stream the client
// aborts, after which the server's pool is idle again. Every response is read by the SDK
// (its JSON and SSE parsing, its stream helpers) and checked against the fields the SDK's
// types declare.
// usage: node openai_sdk_test.mjs BASE_URL   ($TREESERVE_API_KEY: the server's key, if any)
import assert from "node:assert/strict";
import OpenAI from "openai";

const base = process.argv[2];
if (!base) throw new Error("usage: node openai_sdk_test.mjs BASE_URL");
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: process.env.TREESERVE_API_KEY ?? "none",
                            maxRetries: 0, timeout: 120_000 });
const prompt = "Once upon a time, in a quiet village, there lived";
const messages = [
  { role: "system", content: "You tell short stories." },
  { role: "user", content: "Tell me about a fox." },
];

// The fields OpenAI's types (openai/resources/...) declare required, with their JS types.
function checkUsage(u, where) {
  assert.ok(u, `${where}: usage`);
  for (const k of ["prompt_tokens", "completion_tokens", "total_tokens"]) {
    assert.equal(typeof u[k], "number", `${where}: usage.${k}`);
  }
  assert.equal(u.total_tokens, u.prompt_tokens + u.completion_tokens, `${where}: total_tokens`);
  assert.equal(typeof u.prompt_tokens_details?.cached_tokens, "number",
               `${where}: usage.prompt_tokens_details.cached_tokens`);
}
function checkHeader(r, object, where) {
  assert.equal(typeof r.id, "string", `${where}: id`);
  assert.equal(r.object, object, `${where}: object`);
  assert.equal(typeof r.created, "number", `${where}: created`);
  assert.equal(typeof r.model, "string", `${where}: model`);
  assert.ok(Array.isArray(r.choices), `${where}: choices`);
}
const finishReasons = new Set(["stop", "length"]);

async function poolIdle() {
  // GET /v1/server through the SDK's generic client.
  for (let i = 0; i < 500; ++i) {
    const s = await client.get("/server");
    if (s.live_branches === 0 && s.live_trees === 0 &&
        s.kv_pages_free + s.kv_pages_evictable === s.kv_pages_total) return s;
    await new Promise((r) => setTimeout(r, 20));
  }
  throw new Error("the pool did not go back to idle");
}

async function models() {
  const page = await client.models.list();
  assert.ok(page.data.length >= 1);
  const m = page.data[0];
  assert.equal(m.object, "model");
  assert.equal(typeof m.id, "string");
  assert.equal(typeof m.created, "number");
  assert.equal(typeof m.owned_by, "string");
  return m.id;
}

async function completions(model) {
  const c = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0, n: 3,
                                              logprobs: 2 });
  checkHeader(c, "text_completion", "completion");
  assert.equal(c.choices.length, 3);
  c.choices.forEach((choice, i) => {
    assert.equal(choice.index, i);
    assert.equal(typeof choice.text, "string");
    assert.ok(finishReasons.has(choice.finish_reason), choice.finish_reason);
    const lp = choice.logprobs;
    assert.equal(lp.tokens.length, lp.token_logprobs.length);
    assert.equal(lp.tokens.length, lp.text_offset.length);
    assert.equal(lp.tokens.length, lp.top_logprobs.length);
    for (const top of lp.top_logprobs) assert.ok(Object.keys(top).length <= 2);
    // Greedy, one prompt: every choice is the same.
    assert.equal(choice.text, c.choices[0].text);
  });
  checkUsage(c.usage, "completion");
  assert.equal(c.usage.completion_tokens, c.choices.reduce((n, ch) => n + ch.logprobs.tokens.length, 0));

  // Streamed, with the usage at the end: the text equals the whole answer's.
  const stream = await client.completions.create({ model, prompt, max_tokens: 8, temperature: 0,
                                                   stream: true,
                                                   stream_options: { include_usage: true } });
  let text = "", usage = null, finish = null;
  for await (const chunk of stream) {
    checkHeader(chunk, "text_completion", "completion chunk");
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.text;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(text, c.choices[0].text);
  assert.ok(finishReasons.has(finish));
  checkUsage(usage, "completion stream");
  assert.ok(usage.prompt_tokens_details.cached_tokens > 0, "the prompt was cached by now");
}

async function chatCompletions(model) {
  // Whole, n = 3, with logprobs.
  const c = await client.chat.completions.create({ model, messages, n: 3, max_tokens: 12,
                                                   temperature: 0, logprobs: true,
                                                   top_logprobs: 2 });
  checkHeader(c, "chat.completion", "chat completion");
  assert.equal(c.choices.length, 3);
  c.choices.forEach((choice, i) => {
    assert.equal(choice.index, i);
    assert.equal(choice.message.role, "assistant");
    assert.equal(typeof choice.message.content, "string");
    assert.ok(finishReasons.has(choice.finish_reason), choice.finish_reason);
    assert.equal(choice.message.content, c.choices[0].message.content);
    const content = choice.logprobs.content;
    assert.ok(content.length >= 1);
    for (const t of content) {
      assert.equal(typeof t.token, "string");
      assert.equal(typeof t.logprob, "number");
      assert.ok(Array.isArray(t.bytes));
      assert.ok(t.top_logprobs.length >= 1 && t.top_logprobs.length <= 2);
      for (const alt of t.top_logprobs) assert.equal(typeof alt.logprob, "number");
    }
  });
  checkUsage(c.usage, "chat completion");

  // Streamed, n = 3, through the SDK's stream helper, which rebuilds the whole completion
  // from the chunks: the same contents as the whole answer's.
  const stream = client.chat.completions.stream({ model, messages, n: 3, max_tokens: 12,
                                                  temperature: 0,
                                                  stream_options: { include_usage: true } });
  const seen = new Set();
  for await (const chunk of stream) {
    checkHeader(chunk, "chat.completion.chunk", "chat chunk");
    for (const ch of chunk.choices) seen.add(ch.index);
  }
  const final = await stream.finalChatCompletion();
  assert.deepEqual([...seen].sort(), [0, 1, 2]);
  assert.equal(final.choices.length, 3);
  for (const choice of final.choices) {
    assert.equal(choice.message.role, "assistant");
    assert.equal(choice.message.content, c.choices[0].message.content);
    assert.ok(finishReasons.has(choice.finish_reason));
  }
  checkUsage(final.usage, "chat stream");
}

async function errors(model) {
  await assert.rejects(
    client.completions.create({ model, prompt, temperature: "hot" }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === "temperature" &&
           e.code === "INVALID_ARGUMENT" && e.type === "invalid_request_error");
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 10_000_000 }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "max_tokens");
  await assert.rejects(client.get("/trees/t_unknown"),
                       (e) => e instanceof OpenAI.NotFoundError && e.param === "tree_id");
  await assert.rejects(client.chat.completions.create({ model, messages: [] }),
                       (e) => e instanceof OpenAI.BadRequestError && e.param === "messages");
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: "user", content: 5 }] }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === "messages[0].content");
}

async function abortMidStream(model) {
  const controller = new AbortController();
  const stream = await client.completions.create(
    { model, prompt, max_tokens: 4000, n: 4, temperature: 1, stream: true },
    { signal: controller.signal });
  const before = await client.get("/server");
  let chunks = 0;
  try {
    for await (const _ of stream) {
      if (++chunks === 5) controller.abort();  // the SDK closes the connection
    }
  } catch (e) {
    assert.ok(e.name === "AbortError" || e instanceof OpenAI.APIUserAbortError, e);
  }
  assert.ok(chunks >= 5);
  const after = await poolIdle();
  assert.ok(after.decode_steps - before.decode_steps < 3000, "the generation ran on");
}

const model = await models();
await completions(model);
await chatCompletions(model);
await errors(model);
await abortMidStream(model);
await poolIdle();
console.log("openai SDK test passed");
