// The chat page (docs/chat-page.md): conversations in localStorage, answers streamed
// from this server's own POST v1/chat/completions, figures measured in the browser.
// Every URL is relative, so the page also works behind a reverse proxy's path prefix.
'use strict';

(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = 'ds4mlx.chat.conversations';
  const SETTINGS = 'ds4mlx.chat.settings';
  const API_KEY = 'ds4mlx.chat.apiKey';
  const SAVE_EVERY_MS = 1000; // while streaming, so a reload keeps most of an answer

  const state = {
    convs: [],
    current: null, // id of the open conversation
    settings: { thinking: 'high', temperature: '', maxTokens: '', system: '', tools: '' },
    attachments: [], // data: URLs waiting to be sent
    busy: null, // {controller, msg}
    vision: false,
    editing: null, // index of the user message being edited
  };

  // --- storage ---------------------------------------------------------------------------
  function readJSON(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }

  function load() {
    const d = readJSON(STORE, {});
    state.convs = Array.isArray(d.conversations) ? d.conversations : [];
    state.current = state.convs.some((c) => c.id === d.current) ? d.current : null;
    Object.assign(state.settings, readJSON(SETTINGS, {}));
  }

  let lastSave = 0;
  function save() {
    lastSave = Date.now();
    try {
      localStorage.setItem(STORE, JSON.stringify({ version: 1, current: state.current, conversations: state.convs }));
      localStorage.setItem(SETTINGS, JSON.stringify(state.settings));
    } catch (e) {
      setStatus('Not saved: the browser storage is full (' + e.name + '). Export and delete old chats.');
    }
  }

  function apiKey() {
    return localStorage.getItem(API_KEY) || '';
  }

  function headers() {
    const h = { 'Content-Type': 'application/json' };
    const key = apiKey();
    if (key) h.Authorization = 'Bearer ' + key;
    return h;
  }

  // --- conversations -----------------------------------------------------------------------
  function conv() {
    return state.convs.find((c) => c.id === state.current) || null;
  }

  function newConv() {
    const c = { id: 'c' + Date.now().toString(36) + Math.random().toString(36).slice(2, 7), title: 'New chat', created: Date.now(), messages: [] };
    state.convs.unshift(c);
    state.current = c.id;
    return c;
  }

  function titleOf(text) {
    const t = text.replace(/\s+/g, ' ').trim();
    return t ? (t.length > 48 ? t.slice(0, 47) + '…' : t) : 'Image';
  }

  // Tool calls of the last assistant message that no tool message answers yet.
  function pendingCalls(c) {
    if (!c) return [];
    let k = c.messages.length - 1;
    const answered = new Set();
    while (k >= 0 && c.messages[k].role === 'tool') answered.add(c.messages[k--].tool_call_id);
    const last = c.messages[k];
    if (!last || last.role !== 'assistant' || !last.tool_calls) return [];
    return last.tool_calls.filter((t) => !answered.has(t.id));
  }

  // --- the request -----------------------------------------------------------------------
  function requestBody(c) {
    const s = state.settings;
    const messages = [];
    if (s.system.trim()) messages.push({ role: 'system', content: s.system });
    for (const m of c.messages) {
      if (m.role === 'user') {
        if (m.images && m.images.length) {
          const parts = m.images.map((url) => ({ type: 'image_url', image_url: { url } }));
          if (m.content) parts.push({ type: 'text', text: m.content });
          messages.push({ role: 'user', content: parts });
        } else messages.push({ role: 'user', content: m.content });
      } else if (m.role === 'assistant') {
        const calls = m.tool_calls || [];
        if (!m.content && !calls.length) continue; // a failed or empty answer is not history
        const a = { role: 'assistant', content: m.content || '' };
        if (m.reasoning) a.reasoning_content = m.reasoning;
        if (calls.length) {
          a.tool_calls = calls.map((t) => ({ id: t.id, type: 'function', function: { name: t.name, arguments: t.arguments } }));
        }
        messages.push(a);
      } else if (m.role === 'tool') {
        messages.push({ role: 'tool', tool_call_id: m.tool_call_id, content: m.content });
      }
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if (s.thinking === 'off') body.think = false;
    else {
      body.think = true;
      body.reasoning_effort = s.thinking;
    }
    if (s.temperature !== '') body.temperature = Number(s.temperature);
    if (s.maxTokens !== '') body.max_tokens = Number(s.maxTokens);
    if (s.tools.trim()) body.tools = JSON.parse(s.tools); // checked when the field changes
    return body;
  }

  async function errorText(res) {
    const raw = await res.text();
    try {
      const doc = JSON.parse(raw);
      return (doc.error && doc.error.message) || raw;
    } catch (e) {
      return raw || res.statusText;
    }
  }

  // --- streaming -------------------------------------------------------------------------
  async function generate() {
    const c = conv();
    if (!c || state.busy) return;
    let body;
    try {
      body = requestBody(c);
    } catch (e) {
      setStatus('The tools field is not valid JSON: ' + e.message);
      return;
    }
    const msg = { role: 'assistant', content: '', reasoning: '', tool_calls: [], finish: null, figures: {} };
    c.messages.push(msg);
    const controller = new AbortController();
    state.busy = { controller, msg };
    renderMessages();
    $('messages').scrollTop = $('messages').scrollHeight; // the new question and its answer
    updateComposer();
    setStatus('Sending…');
    const f = msg.figures;
    const t0 = performance.now();
    let tStart = null;
    try {
      const res = await fetch('v1/chat/completions', {
        method: 'POST',
        headers: headers(),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) {
        if (res.status === 401) askForKey();
        throw new Error(res.status + ': ' + (await errorText(res)));
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      let done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buf += decoder.decode(chunk.value, { stream: true });
        let cut;
        while (!done && (cut = buf.indexOf('\n\n')) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          done = onBlock(block);
        }
        updateLive();
      }
      if (!msg.finish && !msg.error) msg.error = 'The stream ended without a finish reason.';
    } catch (e) {
      if (e.name === 'AbortError') msg.finish = 'stopped';
      else msg.error = e.message;
    }
    if (tStart !== null && f.decode_s === undefined) f.decode_s = (performance.now() - tStart) / 1000;
    state.busy = null;
    save();
    renderMessages();
    updateComposer();
    setStatus(msg.error ? 'Failed: ' + msg.error : msg.finish === 'stopped' ? 'Stopped.' : 'Done.');
    refreshStats();

    // One SSE block: comments (`: queued N`, `: prefill`), `event: error`, data chunks.
    // Returns true at `[DONE]`.
    function onBlock(block) {
      let event = 'message';
      const data = [];
      for (const line of block.split('\n')) {
        if (line.startsWith(':')) {
          const note = line.slice(1).trim();
          setStatus(note.startsWith('queued') ? 'Queued (' + note.slice(6).trim() + ' ahead)…' : 'Reading the prompt…');
        } else if (line.startsWith('event:')) event = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (!data.length) return false;
      const text = data.join('\n');
      if (text === '[DONE]') return true;
      const doc = JSON.parse(text);
      if (event === 'error' || doc.error) {
        msg.error = (doc.error && doc.error.message) || text;
        return true;
      }
      if (doc.usage) {
        const u = doc.usage;
        f.prompt = u.prompt_tokens;
        f.cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
        f.completion = u.completion_tokens;
        f.reasoning = (u.completion_tokens_details && u.completion_tokens_details.reasoning_tokens) || 0;
      }
      const choice = doc.choices && doc.choices[0];
      if (!choice) return false;
      const d = choice.delta || {};
      const now = performance.now();
      if (d.role && tStart === null) {
        tStart = now; // the prompt is in the session: decoding starts
        f.prefill_s = (now - t0) / 1000;
        setStatus('Generating…');
      }
      if (d.reasoning_content) msg.reasoning += d.reasoning_content;
      if (d.content) msg.content += d.content;
      for (const t of d.tool_calls || []) {
        if (t.id) msg.tool_calls[t.index] = { id: t.id, name: (t.function && t.function.name) || '', arguments: '' };
        const call = msg.tool_calls[t.index];
        if (call && t.function && t.function.arguments) call.arguments += t.function.arguments;
      }
      if (d.reasoning_content || d.content || d.tool_calls) f.chunks = (f.chunks || 0) + 1;
      if (choice.finish_reason) {
        msg.finish = choice.finish_reason;
        if (tStart !== null) f.decode_s = (now - tStart) / 1000;
      }
      return false;
    }

    function updateLive() {
      const el = document.querySelector('[data-live="1"]');
      if (el) followingTheEnd(() => fillAssistant(el, msg, tStart));
      if (Date.now() - lastSave > SAVE_EVERY_MS) save();
    }
  }

  function stop() {
    if (state.busy) state.busy.controller.abort();
  }

  // --- figures ---------------------------------------------------------------------------
  function figuresText(msg, tStart) {
    const f = msg.figures || {};
    const out = [];
    const fmt = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));
    if (f.prompt !== undefined) {
      const fresh = f.prompt - f.cached;
      out.push('prompt ' + f.prompt + ' tokens (' + f.cached + ' cached, ' + fresh + ' new)');
      if (f.prefill_s > 0) out.push('prefill ' + fmt(fresh / f.prefill_s) + ' t/s');
    } else if (f.prefill_s !== undefined) out.push('first token after ' + f.prefill_s.toFixed(2) + ' s');
    if (f.completion !== undefined) {
      out.push(f.completion + ' tokens' + (f.reasoning ? ' (' + f.reasoning + ' thinking)' : ''));
      if (f.decode_s > 0) out.push('decode ' + fmt(f.completion / f.decode_s) + ' t/s');
    } else if (f.chunks) {
      const secs = f.decode_s !== undefined ? f.decode_s : tStart != null ? (performance.now() - tStart) / 1000 : 0;
      out.push('~' + f.chunks + ' tokens');
      if (secs > 0) out.push('decode ~' + fmt(f.chunks / secs) + ' t/s');
    }
    if (msg.finish) out.push('finish: ' + msg.finish);
    return out.join(' · ');
  }

  // --- rendering -------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v;
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? '' : v);
    }
    for (const ch of children) if (ch !== null && ch !== undefined) e.append(ch);
    return e;
  }

  function fillAssistant(art, msg, tStart) {
    const live = state.busy && state.busy.msg === msg;
    const reasoning = art.querySelector('.reasoning');
    reasoning.hidden = !msg.reasoning;
    if (msg.reasoning) {
      art.querySelector('.reasoning summary').textContent =
        live && !msg.content && !msg.tool_calls.length ? 'Thinking… (' + msg.reasoning.length + ' characters)' : 'Thoughts';
      art.querySelector('.reasoning-body').textContent = msg.reasoning;
    }
    art.querySelector('.content').innerHTML = window.ds4md.render(msg.content);
    const calls = art.querySelector('.tool-calls');
    calls.replaceChildren(
      ...(msg.tool_calls || []).filter(Boolean).map((t) =>
        el('div', { class: 'tool-call', role: 'group', 'aria-label': 'Tool call ' + t.name },
          el('div', { class: 'tool-name' }, 'Tool call: ' + t.name),
          el('div', { class: 'call-id' }, 'id ' + t.id),
          el('pre', {}, el('code', {}, prettyJSON(t.arguments)))),
      ),
    );
    const err = art.querySelector('.error');
    err.hidden = !msg.error;
    err.textContent = msg.error || '';
    art.querySelector('.figures').textContent = figuresText(msg, tStart);
  }

  function prettyJSON(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (e) {
      return text;
    }
  }

  function renderMessage(c, m, k) {
    const last = k === c.messages.length - 1;
    const busy = !!state.busy;
    if (m.role === 'user') {
      if (state.editing === k) {
        const box = el('textarea', { id: 'edit-text', 'aria-label': 'Edit message' });
        box.value = m.content;
        return el('article', { class: 'msg user', 'aria-label': 'Your message (editing)' },
          el('div', { class: 'edit-box' }, box),
          el('div', { class: 'actions' },
            el('button', { type: 'button', class: 'primary', onclick: () => resendEdit(k, box.value) }, 'Save and send'),
            el('button', { type: 'button', onclick: () => { state.editing = null; renderMessages(); } }, 'Cancel')));
      }
      return el('article', { class: 'msg user', 'aria-label': 'Your message' },
        el('div', { class: 'who' }, 'You'),
        m.images && m.images.length ? el('div', { class: 'images' }, ...m.images.map((u, i) => el('img', { src: u, alt: 'Attached image ' + (i + 1) }))) : null,
        el('div', { class: 'plain' }, m.content),
        el('div', { class: 'actions' },
          el('button', { type: 'button', disabled: busy, onclick: () => startEdit(k) }, 'Edit')));
    }
    if (m.role === 'tool') {
      return el('article', { class: 'msg tool', 'aria-label': 'Tool result' },
        el('div', { class: 'who' }, 'Tool result for ' + (m.name || m.tool_call_id)),
        el('div', { class: 'plain' }, m.content));
    }
    const live = state.busy && state.busy.msg === m;
    const art = el('article', { class: 'msg assistant', 'aria-label': 'Answer', 'data-live': live ? '1' : null },
      el('div', { class: 'who' }, 'Assistant'),
      el('details', { class: 'reasoning', open: !!m.reasoningOpen, ontoggle: (ev) => { m.reasoningOpen = ev.target.open; } },
        el('summary', {}, 'Thoughts'), el('div', { class: 'reasoning-body' })),
      el('div', { class: 'content markdown' }),
      el('div', { class: 'tool-calls' }),
      el('div', { class: 'error', role: 'alert' }),
      el('p', { class: 'figures' }),
      el('div', { class: 'actions' },
        el('button', { type: 'button', onclick: () => copyText(m.content) }, 'Copy'),
        last && !busy ? el('button', { type: 'button', onclick: regenerate }, 'Regenerate') : null));
    fillAssistant(art, m, null);
    return art;
  }

  // Run `change`; if the conversation was scrolled to its end, keep it there.
  function followingTheEnd(change) {
    const box = $('messages');
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    change();
    if (atEnd) box.scrollTop = box.scrollHeight;
  }

  function renderMessages() {
    const box = $('messages');
    const c = conv();
    followingTheEnd(() => {
      if (!c || !c.messages.length) {
        box.replaceChildren(el('p', { class: 'empty' }, 'Ask anything. Answers stream from this server.'));
      } else {
        box.replaceChildren(...c.messages.map((m, k) => renderMessage(c, m, k)));
      }
    });
    renderList();
  }

  function renderList() {
    $('conv-list').replaceChildren(
      ...state.convs.map((c) =>
        el('li', {},
          el('button', { type: 'button', class: 'open-conv', 'aria-current': c.id === state.current ? 'true' : 'false', title: c.title, onclick: () => openConv(c.id) }, c.title),
          el('button', { type: 'button', class: 'delete-conv', 'aria-label': 'Delete chat ' + c.title, onclick: () => deleteConv(c.id) }, '✕')),
      ),
    );
  }

  function updateComposer() {
    const busy = !!state.busy;
    $('send').disabled = busy;
    $('stop').hidden = !busy;
    $('attach-label').hidden = !state.vision;
    const pending = pendingCalls(conv());
    const reply = $('tool-reply');
    reply.hidden = !pending.length || busy;
    if (pending.length) reply.textContent = 'Your next message is sent as the result of tool call ' + pending[0].name + ' (' + pending[0].id + ').';
    $('attachments').replaceChildren(
      ...state.attachments.map((u, i) =>
        el('figure', {},
          el('img', { src: u, alt: 'Image ' + (i + 1) + ' to send' }),
          el('button', { type: 'button', 'aria-label': 'Remove image ' + (i + 1), onclick: () => { state.attachments.splice(i, 1); updateComposer(); } }, '✕'))),
    );
  }

  // --- actions ---------------------------------------------------------------------------
  function send() {
    if (state.busy) return;
    const text = $('prompt').value;
    if (!text.trim() && !state.attachments.length) return;
    const c = conv() || newConv();
    const pending = pendingCalls(c);
    if (pending.length) {
      c.messages.push({ role: 'tool', tool_call_id: pending[0].id, name: pending[0].name, content: text });
    } else {
      c.messages.push({ role: 'user', content: text, images: state.attachments.slice() });
      if (c.title === 'New chat') c.title = titleOf(text);
    }
    state.attachments = [];
    $('prompt').value = '';
    save();
    if (pendingCalls(c).length) {
      renderMessages();
      updateComposer();
      return; // more calls to answer before the model goes on
    }
    generate();
  }

  function regenerate() {
    const c = conv();
    if (!c || state.busy) return;
    if (c.messages.length && c.messages[c.messages.length - 1].role === 'assistant') c.messages.pop();
    generate();
  }

  function startEdit(k) {
    state.editing = k;
    renderMessages();
    const box = $('edit-text');
    box.focus();
  }

  function resendEdit(k, text) {
    const c = conv();
    state.editing = null;
    c.messages = c.messages.slice(0, k + 1);
    c.messages[k].content = text;
    if (k === 0) c.title = titleOf(text);
    save();
    generate();
  }

  function openConv(id) {
    if (state.busy) stop();
    state.current = id;
    state.editing = null;
    save();
    renderMessages();
    $('messages').scrollTop = $('messages').scrollHeight;
    updateComposer();
    if (window.matchMedia('(max-width: 760px)').matches) setPanel('sidebar', false);
    $('prompt').focus();
  }

  function deleteConv(id) {
    const c = state.convs.find((x) => x.id === id);
    if (!c || !window.confirm('Delete the chat "' + c.title + '"?')) return;
    if (state.busy && id === state.current) stop();
    state.convs = state.convs.filter((x) => x.id !== id);
    if (state.current === id) state.current = state.convs.length ? state.convs[0].id : null;
    save();
    renderMessages();
    updateComposer();
  }

  function exportAll() {
    const doc = { exported: new Date().toISOString(), source: location.origin, conversations: state.convs };
    const url = URL.createObjectURL(new Blob([JSON.stringify(doc, null, 2)], { type: 'application/json' }));
    const a = el('a', { href: url, download: 'ds4mlx-chats-' + new Date().toISOString().slice(0, 10) + '.json' });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  }

  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(() => setStatus('Copied.'), () => setStatus('Copy failed.'));
    } else setStatus('Copying needs https or localhost; select the text instead.');
  }

  function setStatus(text) {
    $('status').textContent = text;
  }

  function setPanel(name, open) {
    document.body.classList.toggle(name + '-open', open);
    $('toggle-' + name).setAttribute('aria-expanded', String(open));
  }

  function askForKey() {
    setPanel('settings', true);
    setStatus('This server needs an API key: enter it in Settings.');
    $('api-key').focus();
  }

  function addImages(files) {
    for (const file of files) {
      if (!file.type.startsWith('image/')) continue;
      const reader = new FileReader();
      reader.onload = () => {
        state.attachments.push(reader.result);
        updateComposer();
      };
      reader.readAsDataURL(file);
    }
  }

  // --- the server ------------------------------------------------------------------------
  async function getJSON(path) {
    const res = await fetch(path, { headers: headers() });
    if (res.status === 401) askForKey();
    if (!res.ok) throw new Error(res.status + ': ' + (await errorText(res)));
    return res.json();
  }

  async function refreshModel() {
    const info = $('server-info');
    try {
      const doc = await getJSON('v1/models');
      const m = doc.data[0];
      info.replaceChildren(el('strong', {}, m.name || m.id), el('span', { class: 'model-id' }, ' · ' + m.id), ' · ctx ' + m.context_length.toLocaleString('en-US'));
    } catch (e) {
      info.textContent = 'server: ' + e.message;
    }
  }

  async function refreshStats() {
    try {
      const s = await getJSON('v1/ds4mlx/stats');
      state.vision = !!s.vision;
      const e = s.engine || {};
      $('stats-summary').textContent = 'Stats: ' + (e.jobs || 0) + ' jobs · live ' + (s.live_tokens || 0) + ' tokens';
      $('stats-body').textContent = JSON.stringify(s, null, 2);
    } catch (e) {
      $('stats-summary').textContent = 'Stats: unavailable';
      $('stats-body').textContent = e.message;
    }
    updateComposer();
  }

  // --- wiring ----------------------------------------------------------------------------
  function bindSettings() {
    const s = state.settings;
    const fields = { thinking: 'thinking', temperature: 'temperature', 'max-tokens': 'maxTokens', system: 'system', tools: 'tools' };
    for (const [id, key] of Object.entries(fields)) {
      const input = $(id);
      input.value = s[key];
      input.addEventListener('change', () => {
        s[key] = input.value;
        if (key === 'tools' && s.tools.trim()) {
          try {
            if (!Array.isArray(JSON.parse(s.tools))) throw new Error('not an array');
            input.removeAttribute('aria-invalid');
          } catch (e) {
            input.setAttribute('aria-invalid', 'true');
            setStatus('Tools: ' + e.message);
          }
        }
        save();
      });
    }
    const key = $('api-key');
    key.value = apiKey();
    key.addEventListener('change', () => {
      if (key.value) localStorage.setItem(API_KEY, key.value);
      else localStorage.removeItem(API_KEY);
      refreshModel();
      refreshStats();
    });
  }

  function init() {
    load();
    bindSettings();
    const wide = window.matchMedia('(min-width: 761px)').matches;
    setPanel('sidebar', wide);
    setPanel('settings', false);
    $('toggle-sidebar').addEventListener('click', () => setPanel('sidebar', !document.body.classList.contains('sidebar-open')));
    $('toggle-settings').addEventListener('click', () => setPanel('settings', !document.body.classList.contains('settings-open')));
    $('new-chat').addEventListener('click', () => {
      if (state.busy) stop();
      newConv();
      save();
      openConv(state.current);
    });
    $('export').addEventListener('click', exportAll);
    $('settings-form').addEventListener('submit', (ev) => ev.preventDefault());
    $('stats-panel').addEventListener('toggle', () => {
      if ($('stats-panel').open) refreshStats();
    });
    $('composer').addEventListener('submit', (ev) => {
      ev.preventDefault();
      send();
    });
    $('stop').addEventListener('click', stop);
    $('prompt').addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        send();
      }
    });
    document.addEventListener('keydown', (ev) => {
      if (ev.key !== 'Escape') return;
      if (state.busy) stop();
      else if (window.matchMedia('(max-width: 760px)').matches) {
        setPanel('sidebar', false); // the panels cover the conversation at phone width
        setPanel('settings', false);
      }
    });
    $('attach').addEventListener('change', (ev) => {
      addImages(ev.target.files);
      ev.target.value = '';
    });
    $('messages').addEventListener('click', (ev) => {
      const b = ev.target.closest('.copy-code');
      if (b) copyText(b.closest('.code').querySelector('code').textContent);
    });
    renderMessages();
    updateComposer();
    refreshModel();
    refreshStats();
    $('prompt').focus();
  }

  init();
})();
