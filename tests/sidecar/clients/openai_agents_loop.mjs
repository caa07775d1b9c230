// The OpenAI Agents SDK's default loop (Runner over the Responses API, one function tool) against a base URL.
// Usage: node openai_agents_loop.mjs '{"baseURL": ..., "episode": ..., "system": ..., "input": [...], "maxTurns": n}'
// Prints one JSON line: the final output (or maxTurnsExceeded: the model called the tool on every turn), each model
// answer's response id and usage, the tool's runs; exits 1 on any other error.
import OpenAI from "openai";
import { Agent, run, setDefaultOpenAIClient, setTracingDisabled, tool } from "@openai/agents";

const spec = JSON.parse(process.argv[2]);
setTracingDisabled(true);  // its default exporter would post traces to api.openai.com
setDefaultOpenAIClient(new OpenAI({
  baseURL: spec.baseURL, apiKey: "sk-test-not-a-real-key", maxRetries: 0,
  defaultHeaders: { "x-forge-episode-id": spec.episode },
}));
let runs = 0;
const getWeather = tool({
  name: "get_weather", description: "Weather",
  parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"], additionalProperties: false },
  strict: true,
  execute: async ({ city }) => { runs += 1; return `sunny, ${20 + runs} C in ${city}`; },
});
const agent = new Agent({
  name: "weather", instructions: spec.system, model: "policy", tools: [getWeather],
  modelSettings: { temperature: 0, maxTokens: 40 },
});
const answers = (responses) => responses.map((r) => ({ responseId: r.responseId, usage: r.usage }));
try {
  const result = await run(agent, spec.input, { maxTurns: spec.maxTurns });
  console.log(JSON.stringify({ finalOutput: result.finalOutput, toolRuns: runs, responses: answers(result.rawResponses) }));
} catch (error) {
  if (error?.name === "MaxTurnsExceededError" && error.state?._modelResponses) {  // the model kept calling the tool
    console.log(JSON.stringify({ maxTurnsExceeded: true, toolRuns: runs, responses: answers(error.state._modelResponses) }));
    process.exit(0);
  }
  console.error(`${error?.name}: ${error?.message}\n${error?.stack ?? ""}`);
  process.exit(1);
}
