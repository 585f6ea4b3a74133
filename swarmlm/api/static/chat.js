// The chat page: a conversation streamed through this gateway's own /v1/chat/completions (fetch + ReadableStream
// over server-sent events). Stop aborts the fetch: the gateway sees the client go away and closes the sessions on
// the servers. An answer is shown as Markdown (markdown.js: marked, vendored and served by the gateway itself, with
// raw HTML shown as text); its text as received is kept in the message's data-raw; a question is only textContent.
// An API key can be given as #key=... in the URL, as for the monitor. The conversations and the settings are kept
// in the browser (localStorage, per served model) and come back after a reload: "New conversation" starts another,
// the list of past chats switches between them (x deletes one). An answer can be copied; the last one regenerated.
// A gateway that serves tuned models beside the base (swarmlm api --adapter) lists them in a menu by the title.
"use strict";
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const $ = (id) => document.getElementById(id);
let conversation = []; // the shown chat's turns, [{role, content}]; the system prompt is added to each request
let chats = []; // the past chats, newest first: [{id, conversation, updated}] (the shown one included once it has turns)
let currentId = newId(); // the shown chat's id
let model = null; // the served id the page talks to (GET /v1/models: the base model, then any tuned ones)
let running = null; // the AbortController of the answer being streamed
const SETTINGS = ["system", "temperature", "top-p", "max-tokens"]; // the inputs kept across reloads
const MAX_CHATS = 50; // older chats are dropped (the browser's storage is small)
const CHOICE_KEY = "swarmlm-chat-choice"; // the served id last chosen, when the gateway serves several

function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
}

function storageKey() {
  return `swarmlm-chat/${model}`;
}

// Keeps the chats, the shown one's id and the settings; a chat that changed moves to the top of the list.
function save() {
  const i = chats.findIndex((c) => c.id === currentId);
  if (i < 0 || JSON.stringify(chats[i].conversation) !== JSON.stringify(conversation)) {
    if (i >= 0) chats.splice(i, 1);
    if (conversation.length) chats.unshift({ id: currentId, conversation: conversation.slice(), updated: Date.now() });
  }
  chats = chats.slice(0, MAX_CHATS);
  const settings = Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]));
  try {
    localStorage.setItem(storageKey(), JSON.stringify({ chats, current: currentId, settings }));
  } catch (e) { /* storage full or disabled: the page works without it */ }
  renderChatList();
}

function validTurns(turns) {
  if (!Array.isArray(turns)) return [];
  return turns.filter((t) => t && typeof t.content === "string" && ["user", "assistant"].includes(t.role))
    .map((t) => ({ role: t.role, content: t.content }));
}

function restore() {
  let saved = null;
  try {
    saved = JSON.parse(localStorage.getItem(storageKey()) || "null");
  } catch (e) { /* a corrupt entry is ignored */ }
  if (!saved || typeof saved !== "object") return;
  for (const id of SETTINGS) {
    if (typeof (saved.settings || {})[id] === "string") $(id).value = saved.settings[id];
  }
  const stored = Array.isArray(saved.chats) ? saved.chats : [{ id: newId(), conversation: saved.conversation }];
  chats = stored.filter((c) => c && typeof c.id === "string")
    .map((c) => ({ id: c.id, conversation: validTurns(c.conversation), updated: Number(c.updated) || 0 }))
    .filter((c) => c.conversation.length);
  const current = chats.find((c) => c.id === saved.current) || (saved.chats ? null : chats[0]);
  if (current) show(current);
  renderChatList();
}

// The shown chat: its turns as messages.
function show(chat) {
  currentId = chat.id;
  conversation = chat.conversation.slice();
  $("messages").replaceChildren();
  for (const turn of conversation) {
    const box = addMessage(turn.role, turn.content);
    if (turn.role === "assistant") box.dataset.state = "done";
  }
  status("");
}

function chatTitle(chat) {
  const first = chat.conversation.find((t) => t.role === "user");
  const text = (first ? first.content : "").replace(/\s+/g, " ").trim();
  return text.length > 48 ? `${text.slice(0, 47)}…` : text || "(empty)";
}

function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren();
  for (const chat of chats) {
    const item = el("li", "chat-item");
    item.dataset.id = chat.id;
    if (chat.id === currentId) item.setAttribute("aria-current", "true");
    const open = el("button", "open", chatTitle(chat));
    open.type = "button";
    open.title = chatTitle(chat);
    open.addEventListener("click", () => {
      if (running) return;
      show(chats.find((c) => c.id === chat.id));
      save(); // (the shown chat comes back after a reload)
    });
    const remove = el("button", "delete", "×");
    remove.type = "button";
    remove.title = "delete this chat";
    remove.addEventListener("click", () => deleteChat(chat.id));
    item.append(open, remove);
    list.append(item);
  }
}

function deleteChat(id) {
  if (running) return;
  chats = chats.filter((c) => c.id !== id);
  if (id === currentId) newChat();
  else save();
}

function newChat() {
  conversation = [];
  currentId = newId();
  $("messages").replaceChildren();
  status("");
  save();
}

function el(tag, cls, text = "") {
  const e = document.createElement(tag);
  e.className = cls;
  e.textContent = text;
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function status(text) {
  $("status").textContent = text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : `HTTP ${response.status}`;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await errorText(r));
    const ids = (await r.json()).data.map((m) => m.id);
    let chosen = null;
    try {
      chosen = localStorage.getItem(CHOICE_KEY);
    } catch (e) { /* storage disabled: the first id */ }
    const choice = $("model-choice");
    choice.replaceChildren(...ids.map((id) => Object.assign(el("option", "", id), { value: id })));
    choice.hidden = ids.length < 2; // (then the menu names the model, not the title)
    $("model").hidden = !choice.hidden;
    useModel(ids.includes(chosen) ? chosen : ids[0]);
    $("send").disabled = false;
    status("");
  } catch (e) {
    status(`cannot reach the gateway: ${e.message} (retrying)`);
    setTimeout(loadModel, 2000);
  }
}

// The served model the page talks to, with its own chats and settings (kept per model id).
function useModel(id) {
  model = id;
  $("model").textContent = id;
  $("model-choice").value = id;
  conversation = [];
  chats = [];
  currentId = newId();
  $("messages").replaceChildren();
  restore();
  renderChatList();
}

function setText(box, text) {
  box.dataset.raw = text;
  const target = box.querySelector(".text");
  if (box.classList.contains("assistant")) target.innerHTML = renderMarkdown(text);
  else target.textContent = text;
}

function addMessage(role, text) {
  const box = el("div", `msg ${role}`);
  box.append(el("div", "role", role === "user" ? "you" : "assistant"), el("div", role === "user" ? "text" : "text md"));
  setText(box, text);
  if (role === "assistant") {
    box.dataset.state = "streaming";
    const actions = el("div", "actions");
    const copy = el("button", "copy", "Copy");
    const again = el("button", "regenerate", "Regenerate");
    copy.type = again.type = "button";
    copy.addEventListener("click", () => copyText(box, copy));
    again.addEventListener("click", regenerate);
    actions.append(copy, again);
    box.append(el("div", "meta"), el("div", "route"), actions);
  }
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  return {
    model, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
}

// Server-sent events: "data: {json}\n\n" ... "data: [DONE]\n\n"
async function readEvents(body, onEvent) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}

// One answer's clocks (ms, performance.now()) and what the gateway reported.
function newStats() {
  return { sent: performance.now(), first: null, last: null, chunks: 0, usage: null, route: null };
}

function onChunk(chunk, answer, stats) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.usage) stats.usage = chunk.usage;
  for (const choice of chunk.choices) {
    const delta = choice.delta || {};
    if (typeof delta.content === "string" && delta.role === undefined) { // a generated token's text (may be "")
      const now = performance.now();
      if (stats.first === null) stats.first = now;
      stats.last = now;
      stats.chunks += 1;
      setText(answer, answer.dataset.raw + delta.content);
    }
    if (choice.swarmlm) stats.route = choice.swarmlm.route;
  }
  showStats(answer, stats);
}

function showStats(answer, stats) {
  const tokens = stats.usage ? stats.usage.completion_tokens : stats.chunks;
  const parts = [`${tokens} tokens`];
  if (stats.chunks > 1 && stats.last > stats.first) {
    const perS = (stats.chunks - 1) / ((stats.last - stats.first) / 1000); // decode rate, after the first token
    parts.push(`${perS.toFixed(1)} tokens/s`);
    answer.dataset.tokensPerS = perS.toFixed(3);
  }
  if (stats.first !== null) {
    const ttft = (stats.first - stats.sent) / 1000;
    parts.push(`first token ${ttft.toFixed(2)} s`);
    answer.dataset.ttftS = ttft.toFixed(3);
  }
  answer.dataset.tokens = tokens;
  answer.querySelector(".meta").textContent = parts.join(" · ");
  if (stats.route) {
    answer.querySelector(".route").textContent = "route: " + stats.route
      .map((s) => `${s.server_id.slice(-8)} ${s.address} [${s.blocks[0]}, ${s.blocks[1]})`).join(" → ");
  }
  answer.scrollIntoView({ block: "end" });
}

// Blocks nobody serves make an answer wait (up to the gateway's --wait-for-blocks): while no token has come, the
// answer says which blocks it waits for, from the swarm view (GET /v1/swarm), instead of a bare cursor.
function blockRanges(blocks) {
  const ranges = [];
  for (const b of blocks) {
    const last = ranges[ranges.length - 1];
    if (last && last[1] === b) last[1] = b + 1;
    else ranges.push([b, b + 1]);
  }
  return ranges.map(([s, e]) => `[${s}, ${e})`).join(", ");
}

function watchMissingBlocks(answer, stats) {
  const timer = setInterval(async () => {
    if (stats.first !== null || answer.dataset.state !== "streaming") {
      clearInterval(timer);
      return;
    }
    try {
      const r = await fetch("/v1/swarm", { headers: headers() });
      const missing = r.ok ? (await r.json()).missing_blocks : [];
      if (missing.length && stats.first === null && answer.dataset.state === "streaming") {
        answer.dataset.waiting = blockRanges(missing);
        answer.querySelector(".meta").textContent =
          `waiting for blocks ${answer.dataset.waiting}: no server serves them yet`;
      }
    } catch (e) { /* the answer's own request reports a gateway that is gone */ }
  }, 1500);
}

function setRunning(controller) {
  running = controller;
  $("send").disabled = controller !== null || model === null;
  $("stop").disabled = controller === null;
  $("clear").disabled = controller !== null;
  document.body.classList.toggle("answering", controller !== null); // (hides Regenerate while an answer streams)
}

// Copy: the answer's text as the model wrote it (Markdown), through the clipboard API (a secure context: https or
// this machine), else the older execCommand way.
async function copyText(box, button) {
  try {
    await navigator.clipboard.writeText(box.dataset.raw);
  } catch (e) {
    const area = el("textarea", "copy-buffer");
    area.value = box.dataset.raw;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  box.dataset.copied = "true";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// Regenerate: the last answer is dropped and asked for again (the same conversation before it).
function regenerate() {
  const last = conversation[conversation.length - 1];
  if (running || !model || !last || last.role !== "assistant") return;
  conversation.pop();
  const boxes = $("messages").querySelectorAll(".msg.assistant");
  boxes[boxes.length - 1].remove();
  const questions = $("messages").querySelectorAll(".msg.user");
  answerConversation(questions[questions.length - 1]);
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || running || !model) return;
  conversation.push({ role: "user", content: text });
  const question = addMessage("user", text);
  $("prompt").value = "";
  answerConversation(question);
}

// Streams the answer to the conversation as it is (its last turn a question, shown in `question`).
async function answerConversation(question) {
  status("");
  const answer = addMessage("assistant", "");
  const stats = newStats();
  const controller = new AbortController();
  setRunning(controller);
  watchMissingBlocks(answer, stats);
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    await readEvents(r.body, (chunk) => onChunk(chunk, answer, stats));
    answer.dataset.state = "done";
  } catch (e) {
    controller.abort(); // whatever went wrong, the gateway stops generating
    answer.dataset.state = e.name === "AbortError" ? "stopped" : "error";
    if (answer.dataset.state === "error") status(e.message);
  } finally {
    setRunning(null);
  }
  const reply = answer.dataset.raw;
  if (answer.dataset.state === "error" && !reply) { // nothing was answered: the question leaves the conversation
    conversation.pop();
    question.classList.add("failed");
  } else {
    conversation.push({ role: "assistant", content: reply }); // a stopped answer stays, as far as it went
  }
  save();
  showStats(answer, stats);
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => running && running.abort());
$("clear").addEventListener("click", () => model && !running && newChat());
$("model-choice").addEventListener("change", (e) => {
  if (running) {
    e.target.value = model; // (an answer is streaming: finish or stop it first)
    return;
  }
  try {
    localStorage.setItem(CHOICE_KEY, e.target.value);
  } catch (err) { /* the choice lasts until a reload */ }
  useModel(e.target.value);
});
for (const id of SETTINGS) $(id).addEventListener("change", () => model && save());
if (key) $("monitor-link").href = `/#key=${encodeURIComponent(key)}`;
loadModel();
