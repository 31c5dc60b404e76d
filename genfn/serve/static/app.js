// The chat page of `genfn serve`: plain DOM, no framework, no build step.
// Talks to the server's OpenAI-compatible API (/v1/models, /v1/chat/completions with stream: true)
// and polls /v1/engine for the live engine panel.
"use strict";

(() => {
  const ENGINE_POLL_MS = 1000;
  const ENGINE_TIMEOUT_MS = 3000;
  const MODEL_RETRY_MS = 2000;
  const SETTINGS_KEY = "genfn.chat.settings";

  const $ = (id) => document.getElementById(id);
  const ui = {
    modelName: $("model-name"),
    conversation: $("conversation"),
    messages: $("messages"),
    emptyNote: $("empty-note"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    settings: $("settings"),
    system: $("system"),
    newChat: $("new-chat"),
    template: $("message-template"),
    engineStatus: $("engine-status"),
    engineTps: $("engine-tps"),
    engineRunning: $("engine-running"),
    engineWaiting: $("engine-waiting"),
    engineFinished: $("engine-finished"),
    engineKv: $("engine-kv"),
    engineKvMeter: $("engine-kv-meter"),
  };

  // The numeric sampling settings, in the request's field names. Blank means "the server's default".
  const NUMERIC_SETTINGS = [
    { key: "temperature", label: "Temperature", integer: false },
    { key: "top_p", label: "Top p", integer: false },
    // OpenAI has no top_k; genfn takes it as an extra field, and 0 means "no top-k filter" (sent, so
    // that the server's default top-k does not apply instead).
    { key: "top_k", label: "Top k", integer: true },
    { key: "max_tokens", label: "Max tokens", integer: true },
    { key: "seed", label: "Seed", integer: true },
  ];

  const chat = {
    model: null,
    history: [], // {role, content} turns sent back to the server with every request
    controller: null, // the AbortController of the reply being streamed, if any
  };

  // ---- small helpers ------------------------------------------------------------------------------

  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.textContent = "";
    ui.error.hidden = true;
  }

  function scrollToEnd() {
    ui.conversation.scrollTop = ui.conversation.scrollHeight;
  }

  function addMessage(role, text) {
    ui.emptyNote.hidden = true;
    const li = ui.template.content.firstElementChild.cloneNode(true);
    li.dataset.role = role;
    li.classList.add(`message-${role}`);
    li.querySelector(".message-role").textContent = role;
    const content = li.querySelector(".message-content");
    content.textContent = text;
    ui.messages.append(li);
    scrollToEnd();
    return { li, content, meta: li.querySelector(".message-meta") };
  }

  function setStreaming(streaming) {
    ui.send.disabled = streaming;
    ui.stop.disabled = !streaming;
    // A busy live region is read once it settles, not once per streamed token.
    ui.conversation.setAttribute("aria-busy", String(streaming));
  }

  function formatNumber(value, digits = 0) {
    return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "–";
  }

  // ---- settings -----------------------------------------------------------------------------------

  // Returns {fields} to merge into the request, or {error} naming the setting and its allowed values.
  function readSettings() {
    const fields = {};
    for (const { key, label, integer, omitWhenZero } of NUMERIC_SETTINGS) {
      const input = $(key);
      const raw = input.value.trim();
      if (input.validity.badInput) return { error: `${label} must be a number.` };
      if (raw === "") continue;
      const value = Number(raw);
      const min = input.min === "" ? null : Number(input.min);
      const max = input.max === "" ? null : Number(input.max);
      if (!Number.isFinite(value)) return { error: `${label} must be a number.` };
      if (integer && !Number.isInteger(value)) return { error: `${label} must be a whole number.` };
      if ((min !== null && value < min) || (max !== null && value > max)) {
        const range = max === null ? `at least ${min}` : `between ${min} and ${max}`;
        return { error: `${label} must be ${range}; got ${raw}.` };
      }
      if (omitWhenZero && value === 0) continue;
      fields[key] = value;
    }
    return { fields };
  }

  function saveSettings() {
    const saved = { system: ui.system.value };
    for (const { key } of NUMERIC_SETTINGS) saved[key] = $(key).value;
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(saved));
    } catch {
      // Storage may be disabled (private windows); the settings then last for this page only.
    }
  }

  function restoreSettings() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "null");
    } catch {
      return;
    }
    if (!saved || typeof saved !== "object") return;
    if (typeof saved.system === "string") ui.system.value = saved.system;
    for (const { key } of NUMERIC_SETTINGS) {
      if (typeof saved[key] === "string") {
        $(key).value = saved[key];
        chosenSettings.add(key);
      }
    }
  }

  // The server's sampling defaults (the model's generation config, else its chat defaults) fill the
  // settings this browser has not chosen, so the page, the API and `genfn chat` sample alike.
  const chosenSettings = new Set();

  function applyServerDefaults(defaults) {
    if (!defaults || typeof defaults !== "object") return;
    for (const key of ["temperature", "top_p", "top_k"]) {
      const value = defaults[key];
      if (typeof value === "number" && Number.isFinite(value) && !chosenSettings.has(key)) $(key).value = String(value);
    }
  }

  // ---- the server's answers -----------------------------------------------------------------------

  // The readable message of a failed response: OpenAI's {"error": {"message"}} when the body has it.
  async function responseError(response) {
    const text = await response.text().catch(() => "");
    let message = text.trim();
    try {
      const body = JSON.parse(text);
      if (body && body.error) message = body.error.message || JSON.stringify(body.error);
      else if (body && body.detail) message = String(body.detail);
    } catch {
      // not JSON: the text itself is the best message there is
    }
    return `The server answered ${response.status} ${response.statusText}${message ? `: ${message}` : "."}`;
  }

  // One server-sent event from its raw lines: {type, data}; comment lines (":") are keep-alives.
  function parseEvent(raw) {
    let type = "message";
    const data = [];
    for (const line of raw.split(/\r?\n/)) {
      if (line === "" || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon === -1 ? line : line.slice(0, colon);
      let value = colon === -1 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") type = value;
      else if (field === "data") data.push(value);
    }
    return data.length ? { type, data: data.join("\n") } : null;
  }

  // The events of an SSE body as they arrive, read with a ReadableStream reader.
  async function* serverSentEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
        let boundary;
        while ((boundary = buffer.search(/\r?\n\r?\n/)) !== -1) {
          const raw = buffer.slice(0, boundary);
          buffer = buffer.slice(boundary).replace(/^\r?\n\r?\n/, "");
          const event = parseEvent(raw);
          if (event) yield event;
        }
        if (done) break;
      }
      const rest = parseEvent(buffer);
      if (rest) yield rest;
    } finally {
      reader.releaseLock();
    }
  }

  function describeEnd(reply, started, firstTokenAt, usage, finishReason) {
    const parts = [];
    const tokens = usage && typeof usage.completion_tokens === "number" ? usage.completion_tokens : null;
    if (tokens !== null) parts.push(`${tokens} tokens`);
    const seconds = (performance.now() - started) / 1000;
    parts.push(`${seconds.toFixed(1)} s`);
    if (firstTokenAt !== null) parts.push(`first token ${((firstTokenAt - started) / 1000).toFixed(2)} s`);
    if (tokens !== null && firstTokenAt !== null && tokens > 1) {
      const streamSeconds = (performance.now() - firstTokenAt) / 1000;
      if (streamSeconds > 0) parts.push(`${((tokens - 1) / streamSeconds).toFixed(1)} tok/s`);
    }
    if (finishReason === "length") parts.push("stopped at the token limit");
    reply.meta.textContent = parts.join(" · ");
  }

  // ---- sending a message --------------------------------------------------------------------------

  async function send() {
    if (chat.controller) return;
    const text = ui.prompt.value.trim();
    if (!text) {
      ui.prompt.focus();
      return;
    }
    const settings = readSettings();
    if (settings.error) {
      showError(settings.error);
      return;
    }
    clearError();

    const userTurn = { role: "user", content: text };
    chat.history.push(userTurn);
    const userMessage = addMessage("user", text);
    ui.prompt.value = "";

    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...chat.history);

    const reply = addMessage("assistant", "");
    reply.li.dataset.state = "streaming";
    reply.li.dataset.chunks = "0";
    reply.meta.textContent = "waiting for the first token…";

    const controller = new AbortController();
    chat.controller = controller;
    setStreaming(true);

    const started = performance.now();
    let firstTokenAt = null;
    let usage = null;
    let finishReason = null;
    let replyText = "";
    let chunks = 0;
    try {
      const request = { messages, stream: true, stream_options: { include_usage: true }, ...settings.fields };
      if (chat.model) request.model = chat.model;
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(request),
        signal: controller.signal,
      });
      if (!response.ok) throw new Error(await responseError(response));
      if (!response.body) throw new Error("This browser cannot read a streamed response.");

      for await (const event of serverSentEvents(response.body)) {
        if (event.data === "[DONE]") break;
        let payload;
        try {
          payload = JSON.parse(event.data);
        } catch {
          throw new Error(`The server sent an event the page cannot read: ${event.data.slice(0, 200)}`);
        }
        if (event.type === "error" || (payload && payload.error)) {
          const error = payload && payload.error ? payload.error : payload;
          throw new Error(`The server failed while writing the reply: ${error.message || JSON.stringify(error)}`);
        }
        const choice = payload.choices && payload.choices[0];
        const delta = choice && choice.delta && choice.delta.content;
        if (delta) {
          if (firstTokenAt === null) {
            firstTokenAt = performance.now();
            reply.meta.textContent = "";
          }
          replyText += delta;
          reply.content.textContent = replyText;
          chunks += 1;
          reply.li.dataset.chunks = String(chunks);
          scrollToEnd();
        }
        if (choice && choice.finish_reason) finishReason = choice.finish_reason;
        if (payload.usage) usage = payload.usage;
      }
      reply.li.dataset.state = "done";
      describeEnd(reply, started, firstTokenAt, usage, finishReason);
    } catch (error) {
      if (error.name === "AbortError") {
        reply.li.dataset.state = "stopped";
        reply.meta.textContent = "stopped";
      } else {
        const message = error instanceof TypeError
          ? `Could not reach the server (${error.message}).`
          : error.message;
        reply.li.dataset.state = "error";
        reply.li.classList.add("message-error");
        reply.meta.textContent = message;
        showError(message);
      }
    } finally {
      chat.controller = null;
      setStreaming(false);
      if (replyText) {
        chat.history.push({ role: "assistant", content: replyText });
      } else {
        // Nothing came back: take the turn out of the history (templates want user and assistant
        // turns to alternate) and give its text back for another try.
        chat.history.splice(chat.history.indexOf(userTurn), 1);
        userMessage.li.classList.add("message-unsent");
        if (!reply.content.textContent) reply.content.textContent = "(no reply)";
        if (!ui.prompt.value) ui.prompt.value = text;
      }
      ui.prompt.focus();
    }
  }

  function stop() {
    if (chat.controller) chat.controller.abort();
  }

  function newChat() {
    stop();
    chat.history = [];
    ui.messages.replaceChildren();
    ui.emptyNote.hidden = false;
    clearError();
    ui.prompt.focus();
  }

  // ---- the model and the engine panel -------------------------------------------------------------

  async function loadModel() {
    try {
      const response = await fetch("/v1/models", { cache: "no-store" });
      if (!response.ok) throw new Error(await responseError(response));
      const body = await response.json();
      const first = body && Array.isArray(body.data) ? body.data[0] : null;
      chat.model = first ? first.id : null;
      if (first) applyServerDefaults(first.sampling_defaults);
      ui.modelName.textContent = chat.model || "no model loaded";
      if (chat.model) document.title = `${chat.model} · genfn chat`;
    } catch {
      ui.modelName.textContent = "server unreachable, retrying…";
      setTimeout(loadModel, MODEL_RETRY_MS);
    }
  }

  function renderEngine(engine) {
    ui.engineTps.textContent = formatNumber(engine.tokens_per_second, 1);
    ui.engineRunning.textContent = formatNumber(engine.running);
    ui.engineWaiting.textContent = formatNumber(engine.waiting);
    ui.engineFinished.textContent = formatNumber(engine.requests_finished);
    const used = engine.kv_blocks_used;
    const total = engine.kv_blocks_total;
    ui.engineKv.textContent = `${formatNumber(used)} / ${formatNumber(total)}`;
    const known = typeof used === "number" && typeof total === "number" && total > 0;
    ui.engineKvMeter.max = known ? total : 1;
    ui.engineKvMeter.value = known ? used : 0;
    if (engine.model && !chat.model) {
      chat.model = engine.model;
      ui.modelName.textContent = engine.model;
    }
  }

  function setEngineStatus(state, text) {
    ui.engineStatus.dataset.state = state;
    ui.engineStatus.textContent = text;
    ui.engineStatus.title = "";
  }

  // Polls one request at a time: the next starts a second after the last one ended, so a slow
  // server is never flooded.
  async function pollEngine() {
    try {
      const response = await fetch("/v1/engine", {
        cache: "no-store",
        signal: AbortSignal.timeout(ENGINE_TIMEOUT_MS),
      });
      if (response.ok) {
        renderEngine(await response.json());
        setEngineStatus("live", "live");
      } else {
        // The server runs but has no numbers for the panel (a manager without metrics, say).
        setEngineStatus("unavailable", `unavailable (${response.status})`);
        ui.engineStatus.title = await responseError(response);
      }
    } catch {
      setEngineStatus("offline", "offline");
    } finally {
      setTimeout(pollEngine, ENGINE_POLL_MS);
    }
  }

  // ---- wiring -------------------------------------------------------------------------------------

  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && chat.controller) stop();
  });
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  ui.settings.addEventListener("input", (event) => {
    // A setting the user typed is theirs: server defaults that arrive later must not overwrite it.
    if (event.target && event.target.id) chosenSettings.add(event.target.id);
    saveSettings();
  });
  ui.settings.addEventListener("submit", (event) => event.preventDefault());

  restoreSettings();
  setStreaming(false);
  loadModel();
  pollEngine();
})();
