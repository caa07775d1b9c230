// A Vercel AI SDK conversation (generateText or streamText, one tool, its defaults otherwise) against a base URL:
// one tool loop per user turn, each turn sent with the history as the SDK keeps it (its response messages: with
// `store` on, the Responses provider refers to its earlier output items by id, `item_reference`).
// Usage: node ai_sdk_loop.mjs '{"api": "chat|responses|messages", "baseURL": ..., "episode": ..., "stream": bool,
//   "store": bool|null, "system": ..., "messages": [...], "turns": [...], "maxSteps": n}'
// Prints one JSON line: each step's finish reason, tool calls, usage and response id; exits 1 on any error.
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createAnthropic } from "@ai-sdk/anthropic";

const spec = JSON.parse(process.argv[2]);
const headers = { "x-forge-episode-id": spec.episode };
const apiKey = "sk-test-not-a-real-key";
const model = spec.api === "messages"
  ? createAnthropic({ baseURL: spec.baseURL, apiKey, headers })("policy")
  : spec.api === "chat"
    ? createOpenAI({ baseURL: spec.baseURL, apiKey, headers }).chat("policy")
    : createOpenAI({ baseURL: spec.baseURL, apiKey, headers }).responses("policy");
let calls = 0;
const getWeather = tool({
  description: "Weather",
  inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
  execute: async ({ city }) => { calls += 1; return `sunny, ${20 + calls} C in ${city}`; },
});
const options = {
  model, system: spec.system, tools: { get_weather: getWeather },
  stopWhen: stepCountIs(spec.maxSteps), maxOutputTokens: 40, temperature: 0, maxRetries: 0,
  // After a tool ran, the model answers (no tool): each turn ends in text, which a later turn refers to by id with
  // `store` on (a 135M model shown its own tool call calls it again).
  prepareStep: ({ steps }) => (steps.at(-1)?.toolResults.length ? { toolChoice: "none" } : {}),
  ...(spec.store === null ? {} : { providerOptions: { openai: { store: spec.store } } }),
};
async function turn(messages) {
  if (!spec.stream) {
    const result = await generateText({ ...options, messages });
    return { steps: result.steps, messages: result.response.messages };
  }
  const errors = [];
  const result = streamText({ ...options, messages, onError: ({ error }) => errors.push(error) });
  await result.consumeStream();
  if (errors.length) throw errors[0];
  return { steps: await result.steps, messages: (await result.response).messages };
}

try {
  const steps = [];
  let history = spec.messages;
  for (const next of [...spec.turns, null]) {
    const done = await turn(history);
    steps.push(...done.steps);
    history = [...history, ...done.messages, ...(next === null ? [] : [{ role: "user", content: next }])];
  }
  console.log(JSON.stringify({ steps: steps.map((s) => ({
    finishReason: s.finishReason, toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
    toolResults: s.toolResults.length, text: s.text, usage: s.usage, responseId: s.response.id,
  })) }));
} catch (error) {
  console.error(`${error?.name}: ${error?.message}\n${JSON.stringify(error?.cause ?? error?.data ?? null)}\n${error?.responseBody ?? ""}`);
  process.exit(1);
}
