// The chat page's script: keeps the conversation, streams each reply from this server's
// /v1/chat/completions (server-sent events over fetch), stops it on request (the server
// cancels a request whose client goes away) and shows the reply's time to first token and
// tokens per second as measured here.
"use strict";

const $ = (id) => document.getElementById(id);
const model = $("model").textContent;
let history = [];
let controller = null;

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("log").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function number(id, parse) {
  const raw = $(id).value.trim();
  return raw === "" ? undefined : parse(raw);
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = (system ? [{role: "system", content: system}] : []).concat(history);
  const body = {model, messages, stream: true, stream_options: {include_usage: true}};
  const fields = {temperature: parseFloat, top_p: parseFloat, top_k: parseInt,
                  max_tokens: parseInt, seed: parseInt};
  for (const [name, parse] of Object.entries(fields)) {
    const value = number(name, parse);
    if (value !== undefined && !Number.isNaN(value)) body[name] = value;
  }
  return body;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// One reply: its text, when its first token came, its token count and finish.
class Reply {
  constructor(div) {
    this.div = div; this.text = ""; this.start = performance.now();
    this.first = null; this.last = null; this.pieces = 0; this.tokens = null; this.finish = null;
    this.error = null;
  }
  failed(message) {
    this.error = message;
    this.div.classList.add("error");
    this.div.textContent = this.text + (this.text ? "\n" : "") + "error: " + message;
  }
  // "error", the server's finish_reason, or "stopped" (the stop button ended the stream)
  outcome() {
    if (this.error !== null) return "error";
    return this.finish === null ? "stopped" : this.finish;
  }
  event(data) {
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) this.tokens = chunk.usage.completion_tokens;
    const now = performance.now();
    for (const choice of chunk.choices || []) {
      const piece = (choice.delta && choice.delta.content) || "";
      // a last token that shows no text (end of sequence) still ends the decoding time
      if (this.first !== null) this.last = now;
      if (piece) {
        if (this.first === null) this.first = this.last = now;
        this.pieces += 1; this.text += piece;
        this.div.textContent = this.text;
        this.div.scrollIntoView({block: "end"});
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }
  stats() {
    // the server's usage count when the stream got to its end; a stopped stream has only
    // the text deltas it carried, about one a token
    const tokens = this.tokens !== null ? this.tokens : this.pieces;
    const approx = this.tokens !== null ? "" : "~";
    const parts = [`${approx}${tokens} token${tokens === 1 ? "" : "s"}`];
    if (this.first !== null) {
      parts.push(`time to first token ${(this.first - this.start).toFixed(0)} ms`);
      const span = (this.last - this.first) / 1000;
      if (tokens > 1 && span > 0) parts.push(`${((tokens - 1) / span).toFixed(1)} tokens/s`);
    }
    const outcome = this.outcome();
    parts.push(outcome === "error" || outcome === "stopped" ? outcome : `finish: ${outcome}`);
    return parts.join(" · ");
  }
}

async function readEvents(response, reply) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data !== "[DONE]") reply.event(data);
      }
    }
  }
}

async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  const reply = new Reply(bubble("assistant", ""));
  const body = requestBody();
  const headers = {"Content-Type": "application/json"};
  const key = $("api_key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  controller = new AbortController();
  busy(true);
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify(body), signal: controller.signal});
    if (!response.ok) {
      const err = await response.json().catch(() => null);
      throw new Error(err && err.error ? err.error.message : `HTTP ${response.status}`);
    }
    await readEvents(response, reply);
  } catch (e) {
    if (e.name !== "AbortError") reply.failed(e.message);
  } finally {
    controller = null;
    busy(false);
  }
  // a failed turn leaves the conversation as it was, so the next message can still be sent
  if (reply.error === null) history.push({role: "assistant", content: reply.text});
  else history.pop();
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = reply.stats();
  reply.div.after(stats);
  reply.div.dataset.finish = reply.outcome();
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (event) => {
  // Enter that ends an input method's composition (CJK) belongs to the composition
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});

$("stop").addEventListener("click", () => { if (controller) controller.abort(); });

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  $("log").replaceChildren();
});
