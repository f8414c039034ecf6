/* The M* playground: only the public HTTP API, the API key on every call, errors shown as the API returns them. */
"use strict";
const $ = (id) => document.getElementById(id);
const view = { cards: new Map(), history: [] };

function authHeaders(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function api(path, { body, form } = {}) {
  const init = { method: body || form ? "POST" : "GET", headers: authHeaders(Boolean(body)) };
  if (body) init.body = JSON.stringify(body);
  if (form) init.body = form;
  const r = await fetch(path, init);
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try {
      const e = (await r.json()).error;
      if (e && e.message) message = e.param ? `${e.message} (param: ${e.param})` : e.message;
    } catch (_) { /* not JSON: the status says it */ }
    throw new Error(message);
  }
  return r;
}

function showError(err) { $("error").textContent = err.message; $("error").hidden = false; }
function clearError() { $("error").hidden = true; $("error").textContent = ""; }
const model = () => $("model").value;
const card = () => view.cards.get(model()) || {};

// Which models each tab offers: those serving its route (the policy tab: models with no OpenAI route, run through
// their walks; the walks tab: every model). A tab opens on a model that can serve it.
const TABS = {
  speak: (c) => (c.routes || []).includes("speech"),
  images: (c) => (c.routes || []).includes("images"),
  video: (c) => (c.routes || []).includes("videos"),
  chat: (c) => (c.routes || []).includes("chat"),
  policy: (c) => !(c.routes || []).length,
  walks: () => true,
};
const TAB_WORDS = { speak: "speech (/v1/audio/speech)", images: "images", video: "videos (/v1/videos)", chat: "chat",
  policy: "native walks only", walks: "walks" };
const currentTab = () => document.querySelector("#tabs button.active")?.dataset.tab || "speak";
const servingModels = (tab) => [...view.cards.values()].filter(TABS[tab]).map((c) => c.id);

// A field shows only for a model that takes it (`data-needs`): "speed" (the model honours it), "voices" (it has
// some), or "field:NAME" (its declared request fields include NAME). A field every model refuses never shows.
function showFields() {
  const c = card(), fields = c.fields || [];
  document.querySelectorAll("[data-needs]").forEach((el) => {
    const need = el.dataset.needs;
    const ok = need === "speed" ? c.speed === true : need === "voices" ? (c.voices || []).length > 0
      : need.startsWith("field:") ? fields.includes(need.slice(6)) : true;
    el.hidden = !ok;
  });
}

async function busy(button, status, work) {
  clearError(); button.disabled = true;
  const t0 = performance.now();
  if (status) status.textContent = "working...";
  try {
    await work();
    if (status && status.textContent === "working...") status.textContent = `done in ${((performance.now() - t0) / 1000).toFixed(1)} s`;
  } catch (err) {
    if (status) status.textContent = "";
    showError(err);
  } finally { button.disabled = false; }
}

function fill(select, values, chosen) {
  select.replaceChildren(...values.map((v) => new Option(v, v, false, v === chosen)));
}

// --- models -------------------------------------------------------------------------------------------------

async function loadModels() {
  clearError();
  const auth = document.querySelector("meta[name=mstar-api-key]")?.content;
  if (auth === "required" && !$("api-key").value.trim()) {
    $("model-info").textContent = "this server wants an API key: type it above";
    $("api-key").focus();
    return;
  }
  try {
    const list = (await (await api("/v1/models")).json()).data;
    view.cards = new Map(list.map((c) => [c.id, c]));
    const first = Object.keys(TABS).find((tab) => servingModels(tab).length);  // the first tab a model serves
    showTab(servingModels(currentTab()).length ? currentTab() : first || "walks");
  } catch (err) { showError(err); }
}

function pickModel() {
  const c = card();
  const routes = c.routes || [];
  $("model-info").textContent = c.id ? `routes: ${routes.join(", ") || "native only"}; walks: ${(c.walks || []).join(", ")}`
    + (c.random_weights ? " (random weights: output is noise)" : "") : "";
  fill($("speech-voice"), c.voices || [], (c.voices || [])[0]);
  fill($("speech-format"), c.audio_formats || ["mp3"], (c.audio_formats || []).includes("wav") ? "wav" : undefined);
  showFields();
  const sizes = [...(c.image_sizes || [])];
  if (c.default_image_size && !sizes.includes(c.default_image_size)) sizes.unshift(c.default_image_size);
  fill($("image-size"), sizes, c.default_image_size);
  if (currentTab() === "walks") loadWalks().catch(showError);
}

// --- speech: PCM plays as it arrives (Web Audio), then the whole reply sits in the audio element -------------

function wavFile(samples, rate) {
  const data = new Int16Array(samples), buf = new ArrayBuffer(44 + data.byteLength), v = new DataView(buf);
  const text = (o, s) => [...s].forEach((ch, i) => v.setUint8(o + i, ch.charCodeAt(0)));
  text(0, "RIFF"); v.setUint32(4, 36 + data.byteLength, true); text(8, "WAVE"); text(12, "fmt ");
  v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true); v.setUint32(24, rate, true);
  v.setUint32(28, rate * 2, true); v.setUint16(32, 2, true); v.setUint16(34, 16, true); text(36, "data");
  v.setUint32(40, data.byteLength, true); new Int16Array(buf, 44).set(data);
  return new Blob([buf], { type: "audio/wav" });
}

class LivePlayer {
  constructor() { this.ctx = null; this.at = 0; }
  play(int16, rate) {
    if (!int16.length) return;
    try {
      this.ctx = this.ctx || new AudioContext();
      const buffer = this.ctx.createBuffer(1, int16.length, rate), ch = buffer.getChannelData(0);
      for (let i = 0; i < int16.length; i++) ch[i] = int16[i] / 32768;
      const src = this.ctx.createBufferSource();
      src.buffer = buffer; src.connect(this.ctx.destination);
      this.at = Math.max(this.at, this.ctx.currentTime + 0.05);
      src.start(this.at); this.at += buffer.duration;
    } catch (_) { this.ctx = null; /* no audio device: the audio element still gets the whole reply */ }
  }
}

async function speak() {
  const fmt = $("speech-format").value;
  const body = { model: model(), input: $("speech-input").value, response_format: fmt };
  if ($("speech-voice").value) body.voice = $("speech-voice").value;
  if (Number($("speech-speed").value) !== 1) body.speed = Number($("speech-speed").value);
  if ($("speech-seed").value !== "") body.seed = Number($("speech-seed").value);
  const r = await api("/v1/audio/speech", { body });
  const rate = Number(r.headers.get("X-Sample-Rate") || 24000), audio = $("speech-audio");
  if (fmt !== "pcm" && fmt !== "wav") {  // compressed: the element decodes it once the body is in
    audio.src = URL.createObjectURL(await r.blob());
    $("speech-status").textContent = `${fmt} at ${rate} Hz`;
    return;
  }
  const reader = r.body.getReader(), player = new LivePlayer(), samples = [];
  let skip = fmt === "wav" ? 44 : 0, odd = null, first = null;
  const t0 = performance.now();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    let bytes = value;
    if (skip) { const s = Math.min(skip, bytes.length); bytes = bytes.subarray(s); skip -= s; }
    if (odd !== null) { const joined = new Uint8Array(bytes.length + 1); joined[0] = odd; joined.set(bytes, 1); bytes = joined; odd = null; }
    if (bytes.length % 2) { odd = bytes[bytes.length - 1]; bytes = bytes.subarray(0, bytes.length - 1); }
    const chunk = new Int16Array(bytes.slice().buffer);
    if (chunk.length && first === null) first = performance.now() - t0;
    samples.push(...chunk);
    player.play(chunk, rate);
    $("speech-status").textContent = `playing as it arrives: ${(samples.length / rate).toFixed(2)} s`;
  }
  audio.src = URL.createObjectURL(wavFile(samples, rate));
  $("speech-status").textContent = `${(samples.length / rate).toFixed(2)} s at ${rate} Hz; first audio after ${(first ?? 0).toFixed(0)} ms`;
}

// --- images -------------------------------------------------------------------------------------------------

function showImages(data, seed, size) {
  $("image-results").replaceChildren(...data.map((d, i) => {
    const fig = document.createElement("figure"), img = new Image(), cap = document.createElement("figcaption");
    img.src = `data:image/png;base64,${d.b64_json}`; img.alt = `image ${i}`; img.className = "generated";
    img.onload = () => { cap.textContent = `seed ${seed === "" ? "random" : Number(seed) + i}, ${img.naturalWidth}x${img.naturalHeight}`; };
    cap.textContent = size || "";
    fig.append(img, cap);
    return fig;
  }));
}

function imageExtras(body) {
  if ($("image-seed").value !== "") body.seed = Number($("image-seed").value);
  if ($("image-steps").value !== "") body.num_steps = Number($("image-steps").value);
  return body;
}

async function draw() {
  const body = imageExtras({ model: model(), prompt: $("image-prompt").value, n: Number($("image-n").value) });
  if ($("image-size").value) body.size = $("image-size").value;
  const out = await (await api("/v1/images/generations", { body })).json();
  showImages(out.data, $("image-seed").value, body.size);
}

async function edit() {
  const file = $("image-source").files[0];
  const form = new FormData();
  if (file) form.append("image", file, file.name);
  const fields = imageExtras({ model: model(), prompt: $("image-prompt").value, n: Number($("image-n").value) });
  for (const [k, v] of Object.entries(fields)) form.append(k, String(v));
  const out = await (await api("/v1/images/edits", { form })).json();
  showImages(out.data, $("image-seed").value, "");
}

// --- chat ---------------------------------------------------------------------------------------------------

const asDataUrl = (file) => new Promise((ok, fail) => {
  const r = new FileReader(); r.onload = () => ok(r.result); r.onerror = () => fail(r.error); r.readAsDataURL(file);
});

function addMessage(role, text, extras = []) {
  const div = document.createElement("div");
  div.className = `msg ${role}`; div.textContent = text;
  div.append(...extras);
  $("chat-log").append(div);
  return div;
}

async function chat() {
  const parts = [{ type: "text", text: $("chat-input").value }], shown = [];
  const image = $("chat-image").files[0], audioFile = $("chat-audio-file").files[0];
  if (image) {
    const url = await asDataUrl(image);
    parts.unshift({ type: "image_url", image_url: { url } });
    const img = new Image(); img.src = url; shown.push(img);
  }
  if (audioFile) {
    const url = await asDataUrl(audioFile);
    parts.unshift({ type: "input_audio", input_audio: { data: url.split(",")[1], format: audioFile.type.includes("mpeg") ? "mp3" : "wav" } });
  }
  const body = { model: model(), messages: [...view.history, { role: "user", content: parts }], max_tokens: Number($("chat-max").value) };
  if ($("chat-spoken").checked) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: (card().voices || [])[0], format: "wav" };
  }
  const out = await (await api("/v1/chat/completions", { body })).json();
  addMessage("user", $("chat-input").value, shown);
  const message = out.choices[0].message, extras = [];
  if (message.audio && message.audio.data) {
    const el = document.createElement("audio");
    el.controls = true; el.className = "reply-audio"; el.src = `data:audio/wav;base64,${message.audio.data}`;
    extras.push(el);
  }
  const text = message.content ?? (message.audio ? message.audio.transcript : "");
  const usage = document.createElement("div");
  usage.className = "muted"; usage.textContent = `usage: ${out.usage.prompt_tokens} prompt + ${out.usage.completion_tokens} completion tokens`;
  addMessage("assistant", text || "(empty reply)", [...extras, usage]).classList.add("answer");
  view.history.push({ role: "user", content: parts.filter((p) => p.type === "text") }, { role: "assistant", content: text });
}

// --- policy: the model's example observation through the native route ----------------------------------------

const DTYPES = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array, int16: Int16Array, int8: Int8Array, uint8: Uint8Array };

function tensorValues(t) {
  const raw = Uint8Array.from(atob(t.data), (c) => c.charCodeAt(0));
  const Kind = DTYPES[t.dtype];
  return Kind ? Array.from(new Kind(raw.buffer), Number) : null;
}

function tensorTable(name, t) {
  const values = tensorValues(t), wrap = document.createElement("div");
  const title = document.createElement("h4");
  title.textContent = `${name}: ${t.dtype} [${t.shape.join(", ")}]`;
  wrap.append(title);
  if (!values) return wrap;
  const cols = t.shape.length ? t.shape[t.shape.length - 1] : 1, table = document.createElement("table");
  table.className = "actions";
  for (let r = 0; r * cols < Math.min(values.length, 64 * cols); r++) {
    const tr = table.insertRow();
    tr.insertCell().textContent = r;
    values.slice(r * cols, (r + 1) * cols).forEach((v) => { tr.insertCell().textContent = v.toFixed(3); });
  }
  wrap.append(table);
  return wrap;
}

async function sampleObservation() {
  const g = await (await api(`/v1/graphs/${encodeURIComponent(model())}`)).json();
  if (!g.example) throw new Error(`model '${model()}' declares no example request`);
  $("policy-input").value = JSON.stringify(g.example, null, 1);
}

async function runPolicy() {
  if (!$("policy-input").value.trim()) await sampleObservation();
  let inputs;
  try { inputs = JSON.parse($("policy-input").value); } catch (err) { throw new Error(`the observation is not JSON: ${err.message}`); }
  const out = await (await api(`/v1/walks/${encodeURIComponent(model())}`, { body: { inputs, stream: false } })).json();
  $("policy-result").replaceChildren(...Object.entries(out.outputs).map(([name, v]) => {
    if (v && typeof v === "object" && "dtype" in v && "shape" in v) return tensorTable(name, v);
    const pre = document.createElement("pre"); pre.textContent = `${name}: ${JSON.stringify(v).slice(0, 400)}`;
    return pre;
  }));
}

// --- walks --------------------------------------------------------------------------------------------------

async function loadWalks() {
  const name = model();
  if (!name) return;
  const g = await (await api(`/v1/graphs/${encodeURIComponent(name)}`)).json();
  if (name !== model()) return;  // another model was chosen meanwhile: its own answer draws (this one came back late)
  $("walks").replaceChildren(...Object.entries(g.walks).map(([name, w]) => {
    const div = document.createElement("div"), h = document.createElement("h3"), p = document.createElement("p");
    const details = document.createElement("details"), summary = document.createElement("summary"), pre = document.createElement("pre");
    div.className = "walk"; h.textContent = `walk ${name}`; p.className = "muted"; p.textContent = w.description;
    summary.textContent = "Mermaid source"; pre.textContent = w.mermaid; details.append(summary, pre);
    div.append(h, p, Walks.draw(w.mermaid), details);
    return div;
  }));
}

// --- video: a job on /v1/videos, polled for its progress, then played --------------------------------------

async function generateVideo() {
  const form = new FormData();
  form.append("model", model());
  form.append("prompt", $("video-prompt").value);
  form.append("size", $("video-size").value);
  form.append("seconds", $("video-seconds").value);
  if ($("video-seed").value !== "") form.append("seed", $("video-seed").value);
  if ($("video-steps").value !== "") form.append("num_steps", $("video-steps").value);
  const image = $("video-image").files[0];
  if (image) form.append("input_reference", image, image.name);
  let job = await (await api("/v1/videos", { form })).json();
  const bar = $("video-progress");
  bar.hidden = false;
  while (job.status === "queued" || job.status === "in_progress") {
    bar.value = job.progress;
    $("video-status").textContent = `${job.status} ${job.progress}%`;
    await new Promise((done) => setTimeout(done, 500));
    job = await (await api(`/v1/videos/${job.id}`)).json();
  }
  bar.value = job.progress;
  if (job.status !== "completed") throw new Error(job.error ? job.error.message : `the job ${job.status}`);
  const blob = await (await api(`/v1/videos/${job.id}/content`)).blob();
  const player = $("video-result");
  if (player.src) URL.revokeObjectURL(player.src);
  player.src = URL.createObjectURL(blob);
  player.hidden = false;
  player.play().catch(() => { /* autoplay may be refused: the controls are there */ });
  $("video-status").textContent = `completed: ${job.size}, ${job.seconds} s (${(blob.size / 1024).toFixed(0)} KiB MP4)`;
}

// --- wiring -------------------------------------------------------------------------------------------------

function showTab(name) {
  document.querySelectorAll("#tabs button").forEach((b) => {
    b.classList.toggle("active", b.dataset.tab === name);
    b.disabled = view.cards.size > 0 && !servingModels(b.dataset.tab).length;  // no model here serves it
  });
  // the model list offers the models that serve this tab; it keeps the chosen one if it can, else the first
  const serving = servingModels(name), keep = serving.includes(model()) ? model() : serving[0];
  fill($("model"), serving, keep);
  const empty = view.cards.size > 0 && !serving.length;
  $("tab-empty").hidden = !empty;
  $("tab-empty").textContent = empty ? `no model served here takes ${TAB_WORDS[name]}` : "";
  document.querySelectorAll(".tab").forEach((s) => s.classList.toggle("active", !empty && s.id === `tab-${name}`));
  pickModel();
}

window.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem("mstar-api-key") || "";
  $("api-key").addEventListener("change", () => { localStorage.setItem("mstar-api-key", $("api-key").value); loadModels(); });
  $("model").addEventListener("change", pickModel);
  document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("speech-go").addEventListener("click", () => busy($("speech-go"), $("speech-status"), speak));
  $("image-go").addEventListener("click", () => busy($("image-go"), $("image-status"), draw));
  $("image-edit").addEventListener("click", () => busy($("image-edit"), $("image-status"), edit));
  $("video-go").addEventListener("click", () => busy($("video-go"), $("video-status"), generateVideo));
  $("chat-go").addEventListener("click", () => busy($("chat-go"), null, chat));
  $("chat-clear").addEventListener("click", () => { view.history = []; $("chat-log").replaceChildren(); });
  $("policy-sample").addEventListener("click", () => busy($("policy-sample"), $("policy-status"), sampleObservation));
  $("policy-go").addEventListener("click", () => busy($("policy-go"), $("policy-status"), runPolicy));
  showTab("speak");
  loadModels();
});
