// The conversation: each question streams its answer from /v1/chat/completions; reasoning is
// folded above the answer, tool calls shown as such; stop aborts the request (the server frees
// its KV blocks when the stream closes), regenerate asks the last question again.

import { apiFetch, errorText, sseEvents } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);

export class Chat {
  constructor(modelSelect) {
    this.model = modelSelect;
    this.history = [];  // {role, content} of the finished turns
    this.controller = null;  // the streaming request's AbortController
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.ask(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); this.ask(); }
    });
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("clear").addEventListener("click", () => this.clear());
  }

  clear() {
    this.controller?.abort();
    this.history = [];
    $("messages").replaceChildren();
  }

  ask() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    $("prompt").value = "";
    this.history.push({ role: "user", content: text });
    this.addTurn("user").querySelector(".answer").textContent = text;
    this.generate();
  }

  regenerate() {
    if (this.controller || this.history.at(-1)?.role !== "assistant") return;
    this.history.pop();
    $("messages").lastElementChild.remove();
    this.generate();
  }

  addTurn(role) {
    const turn = document.createElement("article");
    turn.className = `message ${role}`;
    if (role === "assistant") {
      const reasoning = document.createElement("details");
      reasoning.className = "reasoning";
      reasoning.hidden = true;
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      reasoning.append(summary, Object.assign(document.createElement("div"), { className: "text" }));
      const tools = Object.assign(document.createElement("div"), { className: "tool-calls" });
      turn.append(reasoning, tools);
    }
    const answer = Object.assign(document.createElement("div"), { className: "answer" });
    turn.append(answer);
    if (role === "assistant") {
      const footer = Object.assign(document.createElement("footer"), { className: "stats" });
      turn.append(footer);
    }
    $("messages").append(turn);
    return turn;
  }

  request() {
    const messages = [...this.history];
    const system = $("system-prompt").value.trim();
    if (system) messages.unshift({ role: "system", content: system });
    return {
      model: this.model.value,
      messages,
      temperature: Number($("temperature").value),
      top_p: Number($("top-p").value),
      max_tokens: Number($("max-tokens").value),
      stream: true,
      stream_options: { include_usage: true },
    };
  }

  setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    for (const old of document.querySelectorAll(".regenerate")) old.remove();
  }

  async generate() {
    const turn = this.addTurn("assistant");
    const view = {
      reasoning: turn.querySelector(".reasoning"),
      tools: turn.querySelector(".tool-calls"),
      answer: turn.querySelector(".answer"),
      stats: turn.querySelector(".stats"),
    };
    const reply = { reasoning: "", content: "", tools: [], usage: null, finish: null };
    this.controller = new AbortController();
    this.setBusy(true);
    turn.classList.add("streaming");
    const times = { first: null, last: null };
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(this.request()),
        signal: this.controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) reply.usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (!choice) continue;
        if (choice.finish_reason) reply.finish = choice.finish_reason;
        const delta = choice.delta || {};
        if (delta.reasoning_content || delta.content || delta.tool_calls) {
          times.last = performance.now();
          times.first ??= times.last;
        }
        this.apply(delta, reply, view);
      }
    } catch (err) {
      if (err.name === "AbortError") reply.finish = "stopped";
      else {
        const error = Object.assign(document.createElement("p"), { className: "error" });
        error.textContent = err.message;
        view.answer.append(error);
        reply.finish = "error";
      }
    } finally {
      this.controller = null;
      turn.classList.remove("streaming");
      this.setBusy(false);
    }
    const summary = Object.assign(document.createElement("span"), { className: "summary" });
    summary.textContent = statsLine(reply, times);
    view.stats.append(summary);
    this.history.push({ role: "assistant", content: reply.content });
    this.addRegenerate(turn);
  }

  apply(delta, reply, view) {
    if (delta.reasoning_content) {
      reply.reasoning += delta.reasoning_content;
      view.reasoning.hidden = false;
      view.reasoning.querySelector(".text").textContent = reply.reasoning;
    }
    if (delta.content) {
      reply.content += delta.content;
      view.answer.replaceChildren(renderMarkdown(reply.content));
    }
    for (const call of delta.tool_calls || []) {
      const known = reply.tools[call.index] ??= { name: "", arguments: "" };
      known.name += call.function?.name || "";
      known.arguments += call.function?.arguments || "";
      view.tools.replaceChildren(...reply.tools.map(toolCallView));
    }
  }

  addRegenerate(turn) {
    const button = Object.assign(document.createElement("button"), {
      className: "regenerate", type: "button", textContent: "Regenerate" });
    button.addEventListener("click", () => this.regenerate());
    turn.querySelector(".stats").append(button);
  }
}

function toolCallView(call) {
  const box = Object.assign(document.createElement("div"), { className: "tool-call" });
  const name = Object.assign(document.createElement("div"), { className: "tool-name" });
  name.textContent = `Tool call: ${call.name}`;
  const args = document.createElement("pre");
  args.textContent = call.arguments;
  box.append(name, args);
  return box;
}

// "N tokens · X tok/s · C cached prompt tokens · finish" for one answer.
function statsLine(reply, times) {
  const parts = [];
  const usage = reply.usage;
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    const seconds = (times.last - times.first) / 1000;
    if (usage.completion_tokens > 1 && seconds > 0) {
      parts.push(`${((usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    }
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (reply.finish) parts.push(reply.finish);
  return parts.join(" · ");
}
