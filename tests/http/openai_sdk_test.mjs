// treeserve's HTTP API through OpenAI's own Node client (the `openai` package, pinned by
// package-lock.json): completions whole and streamed with logprobs, chat completions whole and
// streamed with n = 3 and logprobs, errors as the SDK's error classes, and a stream the client
// aborts, after which the server's pool is idle again. Every response is read by the SDK
// (its JSON and SSE parsing, its stream helpers) and checked against the fields the SDK's
// types declare. Every response object the SDK hands back (whole answers, each streamed chunk,
// the stream helper's final chat completion, the models list, error bodies) is also saved to
// RESPONSES_JSON as {type, where, value}: sdk_types_gen.mjs turns them into TypeScript that
// tsc checks against the SDK's own declared types (run.sh).
// usage: node openai_sdk_test.mjs BASE_URL RESPONSES_JSON
//        ($TREESERVE_API_KEY: the server's key, if any)
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import OpenAI from "openai";

const [base, responsesPath] = process.argv.slice(2);
if (!base || !responsesPath) {
  throw new Error("usage: node openai_sdk_test.mjs BASE_URL RESPONSES_JSON");
}
// type: the name sdk_types_gen.mjs maps to the SDK's type; a copy, taken as it arrives.
const saved = [];
function save(type, where, value) {
  saved.push({ type, where, value: JSON.parse(JSON.stringify(value)) });
}
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
  save("ModelsPage", "GET /v1/models", page.body);
  for (const m of page.data) save("Model", "GET /v1/models: data[]", m);
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
  save("Completion", "completion, n = 3, logprobs: 2", c);
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
    save("CompletionChunk", "completion stream, include_usage", chunk);
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

  // logprobs: 0 (the token's own logprob only) and the token_ids extension, whole and streamed.
  const ids = await client.completions.create({ model, prompt, max_tokens: 4, temperature: 0,
                                                logprobs: 0, return_token_ids: true });
  save("Completion", "completion, logprobs: 0, return_token_ids", ids);
  assert.equal(ids.choices[0].token_ids.length, ids.usage.completion_tokens);
  const idStream = await client.completions.create({ model, prompt, max_tokens: 4,
                                                     temperature: 0, logprobs: 0, stream: true,
                                                     return_token_ids: true });
  let streamed = 0;
  for await (const chunk of idStream) {
    save("CompletionChunk", "completion stream, logprobs: 0, return_token_ids", chunk);
    for (const ch of chunk.choices) streamed += ch.token_ids?.length ?? 0;
  }
  assert.equal(streamed, ids.choices[0].token_ids.length);
}

async function chatCompletions(model) {
  // Whole, n = 3, with logprobs.
  const c = await client.chat.completions.create({ model, messages, n: 3, max_tokens: 12,
                                                   temperature: 0, logprobs: true,
                                                   top_logprobs: 2 });
  save("ChatCompletion", "chat completion, n = 3, logprobs", c);
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

  // Streamed, n = 3, with logprobs, through the SDK's stream helper, which rebuilds the whole
  // completion from the chunks: the same contents as the whole answer's.
  const stream = client.chat.completions.stream({ model, messages, n: 3, max_tokens: 12,
                                                  temperature: 0, logprobs: true,
                                                  top_logprobs: 2,
                                                  stream_options: { include_usage: true } });
  const seen = new Set();
  for await (const chunk of stream) {
    save("ChatCompletionChunk", "chat stream, n = 3, logprobs, include_usage", chunk);
    checkHeader(chunk, "chat.completion.chunk", "chat chunk");
    for (const ch of chunk.choices) seen.add(ch.index);
  }
  const final = await stream.finalChatCompletion();
  save("ParsedChatCompletion", "chat stream: the SDK's finalChatCompletion()", final);
  assert.deepEqual([...seen].sort(), [0, 1, 2]);
  assert.equal(final.choices.length, 3);
  for (const choice of final.choices) {
    assert.equal(choice.message.role, "assistant");
    assert.equal(choice.message.content, c.choices[0].message.content);
    assert.ok(finishReasons.has(choice.finish_reason));
  }
  checkUsage(final.usage, "chat stream");

  // The token_ids extension, whole and streamed.
  const ids = await client.chat.completions.create({ model, messages, max_tokens: 4,
                                                     temperature: 0, return_token_ids: true });
  save("ChatCompletion", "chat completion, return_token_ids", ids);
  assert.equal(ids.choices[0].token_ids.length, ids.usage.completion_tokens);
  const idStream = await client.chat.completions.create({ model, messages, max_tokens: 4,
                                                          temperature: 0, stream: true,
                                                          return_token_ids: true });
  for await (const chunk of idStream) {
    save("ChatCompletionChunk", "chat stream, return_token_ids", chunk);
  }
}

// An assert.rejects check that also saves the error object the SDK read from the body.
function apiError(where, check) {
  return (e) => {
    if (e instanceof OpenAI.APIError) save("ErrorObject", where, e.error);
    return check(e);
  };
}

async function errors(model) {
  await assert.rejects(
    client.completions.create({ model, prompt, temperature: "hot" }),
    apiError("completion, temperature: \"hot\"",
             (e) => e instanceof OpenAI.BadRequestError && e.status === 400 &&
                    e.param === "temperature" && e.code === "INVALID_ARGUMENT" &&
                    e.type === "invalid_request_error"));
  await assert.rejects(
    client.completions.create({ model, prompt, max_tokens: 10_000_000 }),
    apiError("completion, max_tokens too large",
             (e) => e instanceof OpenAI.BadRequestError && e.param === "max_tokens"));
  await assert.rejects(client.get("/trees/t_unknown"),
                       apiError("GET /v1/trees/t_unknown",
                                (e) => e instanceof OpenAI.NotFoundError && e.param === "tree_id"));
  await assert.rejects(client.chat.completions.create({ model, messages: [] }),
                       apiError("chat, messages: []",
                                (e) => e instanceof OpenAI.BadRequestError &&
                                       e.param === "messages"));
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: "user", content: 5 }] }),
    apiError("chat, content: 5", (e) => e instanceof OpenAI.BadRequestError &&
                                        e.param === "messages[0].content"));
  // The whole body, which the SDK unwraps to its `error` (fetch, with the SDK's key).
  const r = await fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json",
               Authorization: `Bearer ${process.env.TREESERVE_API_KEY ?? "none"}` },
    body: JSON.stringify({ model, prompt, n: 0 }),
  });
  assert.equal(r.status, 400);
  save("ErrorBody", "completion, n: 0 (fetch: the whole body)", await r.json());
}

async function abortMidStream(model) {
  const controller = new AbortController();
  const stream = await client.completions.create(
    { model, prompt, max_tokens: 4000, n: 4, temperature: 1, stream: true },
    { signal: controller.signal });
  const before = await client.get("/server");
  let chunks = 0;
  try {
    for await (const chunk of stream) {
      save("CompletionChunk", "completion stream, n = 4, aborted", chunk);
      if (++chunks === 5) controller.abort();  // the SDK closes the connection
    }
  } catch (e) {
    assert.ok(e.name === "AbortError" || e instanceof OpenAI.APIUserAbortError, e);
  }
  assert.ok(chunks >= 5);
  const after = await poolIdle();
  assert.ok(after.decode_steps - before.decode_steps < 3000, "the generation ran on");
}

try {
  const model = await models();
  await completions(model);
  await chatCompletions(model);
  await errors(model);
  await abortMidStream(model);
  await poolIdle();
} finally {
  writeFileSync(responsesPath, JSON.stringify(saved, null, 1));
}
console.log(`openai SDK test passed (${saved.length} response objects saved)`);
