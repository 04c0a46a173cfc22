// lucy serve's chat page: the server's own /v1/chat/completions stream, nothing else.
// Model text is only ever put in the page as text nodes (never innerHTML).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_SLOT = "lucy-api-key";
const chat = { messages: [], controller: null, model: null };

function authHeaders() {
  const key = sessionStorage.getItem(KEY_SLOT);
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// The message of the server's JSON error body, {"error": {"message": ...}}, or the status.
async function errorText(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: fall through */ }
  return "HTTP " + res.status + " " + res.statusText;
}

function showError(text) {
  const p = $("error");
  p.textContent = text;
  p.hidden = !text;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("api-key").focus();
}

// GET /v1/models: the model's name, and whether the key (if any) is accepted.
async function checkServer() {
  let res;
  try {
    res = await fetch("/v1/models", { headers: authHeaders() });
  } catch (err) {
    showError("cannot reach the server: " + err.message);
    return false;
  }
  if (res.status === 401) {
    const had = sessionStorage.getItem(KEY_SLOT);
    const message = await errorText(res);
    askForKey(had ? message : "");
    return false;
  }
  if (!res.ok) {
    showError(await errorText(res));
    return false;
  }
  const body = await res.json();
  const card = body.data && body.data[0];
  chat.model = card ? card.id : null;
  $("model").textContent = chat.model || "";
  if (card && card.meta) showDefaults(card.meta);
  $("key-form").hidden = true;
  showError("");
  return true;
}

// The model's own settings (what an empty field means), from the /v1/models card's "meta".
function showDefaults(meta) {
  const d = meta.defaults || {};
  if (d.temperature != null) $("temperature").placeholder = "model default: " + d.temperature;
  $("max-tokens").placeholder = d.max_tokens != null ? "model default: " + d.max_tokens
    : "to the context end (" + meta.context + " tokens)";
  const shown = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"]
    .filter((k) => d[k] != null).map((k) => k + " " + d[k]);
  $("defaults").textContent = shown.length ? "Model defaults: " + shown.join(", ") + "." : "";
}

// --- rendering: paragraphs, ``` code blocks, `inline code` and **bold**, as DOM nodes ---

function inline(parent, text) {
  const parts = text.split(/(`[^`\n]+`|\*\*[^*\n]+\*\*)/);
  for (const part of parts) {
    if (!part) continue;
    if (part.startsWith("`") && part.endsWith("`") && part.length > 1) {
      const code = document.createElement("code");
      code.textContent = part.slice(1, -1);
      parent.appendChild(code);
    } else if (part.startsWith("**") && part.endsWith("**") && part.length > 4) {
      const b = document.createElement("strong");
      b.textContent = part.slice(2, -2);
      parent.appendChild(b);
    } else {
      parent.appendChild(document.createTextNode(part));
    }
  }
}

function renderMarkdown(box, text) {
  box.replaceChildren();
  const pieces = text.split("```");
  pieces.forEach((piece, i) => {
    if (i % 2 === 1) { // inside a fence: the first line names the language
      const nl = piece.indexOf("\n");
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      code.textContent = nl >= 0 ? piece.slice(nl + 1) : piece;
      if (nl > 0) code.dataset.lang = piece.slice(0, nl).trim();
      pre.appendChild(code);
      box.appendChild(pre);
      return;
    }
    for (const para of piece.split(/\n{2,}/)) {
      if (para.trim()) box.appendChild(block(para.replace(/^\n+|\n+$/g, "")));
    }
  });
}

// One paragraph: a list when every line is an item ("- ", "* ", "1. "), a heading ("# "), or text.
function block(para) {
  const lines = para.split("\n");
  const bullet = /^\s*[-*] +/, numbered = /^\s*\d+[.)] +/;
  for (const [re, tag] of [[bullet, "ul"], [numbered, "ol"]]) {
    if (!lines.every((ln) => re.test(ln))) continue;
    const list = document.createElement(tag);
    for (const ln of lines) {
      const li = document.createElement("li");
      inline(li, ln.replace(re, ""));
      list.appendChild(li);
    }
    return list;
  }
  const heading = /^(#{1,3}) +(.*)$/.exec(para);
  const el = document.createElement(heading && lines.length === 1 ? "h" + (heading[1].length + 2) : "p");
  inline(el, el.tagName === "P" ? para : heading[2]);
  return el;
}

function addTurn(role, text) {
  const li = document.createElement("li");
  li.className = "turn " + role;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  const meta = document.createElement("p");
  meta.className = "meta";
  li.append(who, body, meta);
  $("log").appendChild(li);
  if (role === "user") body.textContent = text;
  li.scrollIntoView({ block: "end" });
  return { li, body, meta };
}

// --- sending ---

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    messages: messages.concat(chat.messages),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (chat.model) body.model = chat.model;
  const t = $("temperature").value;
  if (t !== "") body.temperature = Number(t);
  const m = $("max-tokens").value;
  if (m !== "") body.max_tokens = Number(m);
  return body;
}

// Reads the SSE stream: onData(object) per `data:` event until [DONE], then onChunk() after
// each piece the network delivers (one redraw per piece, so tokens show as they arrive).
async function readEvents(res, onData, onChunk) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
    onChunk();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("log").setAttribute("aria-busy", busy ? "true" : "false");
}

async function send(text) {
  showError("");
  chat.messages.push({ role: "user", content: text });
  const userTurn = addTurn("user", text);
  const controller = new AbortController();
  chat.controller = controller;
  setBusy(true);
  let res;
  try {
    res = await fetch("/v1/chat/completions", {
      method: "POST", headers: authHeaders(),
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
  } catch (err) {
    return failed(userTurn, text, err.name === "AbortError" ? "" : "request failed: " + err.message);
  }
  if (!res.ok) {
    const message = await errorText(res);
    if (res.status === 401) askForKey(message);
    return failed(userTurn, text, message);
  }
  await stream(res, controller);
}

// The request was refused: the turn leaves the conversation, its text goes back to the box.
function failed(userTurn, text, message) {
  chat.messages.pop();
  userTurn.li.remove();
  $("prompt").value = text;
  showError(message);
  chat.controller = null;
  setBusy(false);
}

async function stream(res, controller) {
  const turn = addTurn("assistant", "");
  turn.li.setAttribute("aria-busy", "true");
  let text = "", pieces = 0, usage = null, first = 0, finish = null, shown = 0;
  const draw = () => {
    if (text.length === shown) return;
    shown = text.length;
    renderMarkdown(turn.body, text);
    turn.li.scrollIntoView({ block: "end" });
  };
  try {
    await readEvents(res, (ev) => {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      const choice = ev.choices && ev.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const piece = choice.delta && choice.delta.content;
      if (!piece) return;
      if (!first) first = performance.now();
      text += piece;
      pieces += 1;
    }, draw);
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else showError(err.message);
  }
  const seconds = first ? (performance.now() - first) / 1000 : 0;
  const tokens = usage ? usage.completion_tokens : pieces;
  draw();
  turn.li.setAttribute("aria-busy", "false");
  turn.meta.textContent = describe(tokens, seconds, finish);
  if (text) chat.messages.push({ role: "assistant", content: text });
  if (chat.controller === controller) chat.controller = null;
  setBusy(false);
}

function describe(tokens, seconds, finish) {
  let s = tokens + " tokens";
  if (seconds > 0 && tokens > 1) s += ", " + ((tokens - 1) / seconds).toFixed(1) + " tok/s";
  if (finish === "stopped") s += ", stopped";
  else if (finish === "length") s += ", cut at max tokens";
  return s;
}

// --- wiring ---

function init() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || chat.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort(); // closes the connection: the server cancels
  });
  $("new-chat").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.messages = [];
    $("log").replaceChildren();
    showError("");
    $("prompt").focus();
  });
  $("settings-toggle").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_SLOT, $("api-key").value);
    $("api-key").value = "";
    if (await checkServer()) $("prompt").focus();
  });
  setBusy(false);
  checkServer();
}

init();
