// The Yoke mesh console: a little JavaScript over the gateway's JSON, no build step.
// The token lives in this tab's sessionStorage and travels only in an Authorization header:
// the forum stream is read with fetch (EventSource cannot send headers), never via a URL.
"use strict";

const TOKEN_KEY = "yoke.token";
const NAME_KEY = "yoke.name";
const MONOLOGUE_POLL_MS = 1000;
const RECONNECT_MS = 1000;
// A draft that got no delta (nor its line) for this long is dropped: its step died unseen.
const DRAFT_STALE_MS = 60000;

const $ = (id) => document.getElementById(id);
const names = new Map();
// Authors who called through the gateway's MCP or A2A door: their lines are marked so.
const doors = new Map();

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function status(text) {
  $("status").textContent = text || "";
}

class Unauthorized extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {}, {
    Authorization: "Bearer " + token(),
  });
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    throw new Unauthorized("the token was refused");
  }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    throw new Error(body.error || response.status + " " + response.statusText);
  }
  return body;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text; // never innerHTML: lines are untrusted
  return node;
}

// Names are given only for the authors of a conversation the token may read: say which.
async function resolveNames(ids, conversationId) {
  const missing = [...new Set(ids)].filter((id) => id && !names.has(id));
  if (!conversationId) return;
  for (let i = 0; i < missing.length; i += 100) {
    const batch = missing.slice(i, i + 100);
    const query = "ids=" + encodeURIComponent(batch.join(",")) + "&conversation=" + encodeURIComponent(conversationId);
    const body = await api("/console/api/names?" + query);
    for (const id of batch) {
      names.set(id, body.names[id] || id.slice(0, 8));
      if (body.doors && body.doors[id]) doors.set(id, body.doors[id]);
    }
  }
}

function nameOf(id) {
  return names.get(id) || id.slice(0, 8);
}

// --- rendering a line --------------------------------------------------------------------

function describe(message) {
  const meta = message.meta || {};
  if (message.type === "notice") return ["notice", "notice"];
  if (meta.instruction === "summary") return ["compaction", "compaction summary"];
  if (meta.instruction) return ["instruction", meta.instruction + " instruction"];
  if (meta.carriedFrom) return ["carried", "carried over"];
  if (message.role === "agent") return ["agent", ""];
  return ["person", ""];
}

function renderLine(message) {
  const [kind, label] = describe(message);
  const item = element("li", "line " + kind);
  item.dataset.seq = String(message.seq);
  item.dataset.messageId = message.id;
  item.dataset.role = message.role;
  const head = element("div", "head");
  head.append(element("span", "seq", "#" + message.seq));
  head.append(element("span", "author", nameOf(message.authorActorId)));
  const door = doors.get(message.authorActorId);
  if (door) head.append(element("span", "tag door", "via " + door.toUpperCase()));
  if (label) head.append(element("span", "tag", label));
  item.append(head);
  for (const part of message.parts || []) {
    if (part.type === "text") {
      item.append(element("div", "text", part.text));
    } else if (part.type === "tool_call") {
      const call = element("div", "tool-call");
      call.dataset.callKey = callKey(message.id, part.callId);
      call.append(element("span", "tag", "tool call"));
      call.append(element("code", "", part.name + " " + JSON.stringify(part.input || {})));
      call.append(element("div", "call-status"));
      item.append(call);
    } else if (part.type === "tool_result") {
      const result = element("div", "tool-result" + (part.isError ? " error" : ""));
      result.append(element("span", "tag", part.isError ? "tool error" : "tool result"));
      result.append(element("code", "", part.name + " → " + part.output));
      item.append(result);
    }
  }
  return item;
}

// --- where each tool call stands (the monologue view) -----------------------------------

const CALL_STATES = {
  running: "running",
  awaiting_approval: "awaiting approval",
  open: "open",
  answered: "answered",
  error: "error",
  timeout: "timed out",
  stopped: "stopped",
  rejected: "rejected",
  failed: "failed",
};

function callKey(lineId, callId) {
  return lineId + " " + callId;
}

function duration(seconds) {
  return seconds < 10 ? seconds.toFixed(2) + " s" : Math.round(seconds) + " s";
}

// The gateway sends, with each page of lines, the calls of those lines, the calls they answer
// and every call still waiting in the store: each is drawn on the call already on the page.
function showToolCalls(list, calls) {
  const shown = new Map();
  for (const node of list.querySelectorAll(".tool-call")) shown.set(node.dataset.callKey, node);
  for (const call of calls) {
    const node = shown.get(callKey(call.callLineId, call.callId));
    if (!node) continue;
    node.dataset.source = call.source || "none";
    node.dataset.state = call.state;
    const parts = [
      element("span", "call-source", call.source || "not in the catalog"),
      element("span", "call-state state-" + call.state, CALL_STATES[call.state] || call.state),
    ];
    if (call.state === "open") {
      parts.push(element("span", "call-duration", "open for " + Math.floor(call.seconds) + " s"));
      if (call.deadline) parts.push(element("span", "call-deadline", "deadline " + new Date(call.deadline).toLocaleString()));
    } else if (call.state !== "running") {
      parts.push(element("span", "call-duration", duration(call.seconds)));
    }
    if (call.approval) parts.push(element("span", "call-approval", decisionText(call.approval)));
    if (call.openCallId) {
      const id = element("code", "call-id", "callId " + call.openCallId);
      id.title = "the call's id as its worker sees it";
      parts.push(id);
    }
    node.querySelector(".call-status").replaceChildren(...parts);
  }
}

async function appendLines(list, messages, lastSeq) {
  await resolveNames(messages.map((m) => m.authorActorId), messages[0]?.conversationId);
  let seq = lastSeq;
  const firstDraft = list.querySelector("li.draft"); // drafts stay below the lines
  for (const message of messages) {
    if (message.seq <= seq) continue; // seen already (events may repeat)
    list.insertBefore(renderLine(message), firstDraft);
    seq = message.seq;
  }
  if (messages.length) list.lastElementChild?.scrollIntoView({ block: "nearest" });
  return seq;
}

// --- drafts: an agent's line drawn as it is written ------------------------------------------

// By the id the line will have: {node, text, next (the index expected), agent, inReplyTo, timer}.
const drafts = new Map();

function dropDraft(messageId) {
  const draft = drafts.get(messageId);
  if (!draft) return;
  clearTimeout(draft.timer);
  draft.node.remove();
  drafts.delete(messageId);
}

// Each delta's text is appended in index order; a skipped index (deltas lost to a reconnect or
// a slow connection, or a stream opened mid-answer) shows as "…". The line replaces the draft.
function showDelta(list, delta) {
  const shown = list.querySelector('li.line[data-message-id="' + CSS.escape(delta.messageId) + '"]');
  if (shown) return; // its line is here already (a late delta)
  let draft = drafts.get(delta.messageId);
  if (draft && delta.index === 0 && draft.next > 0) {
    dropDraft(delta.messageId); // the step started over (a retry): so does its draft
    draft = undefined;
  }
  if (!draft) {
    const node = element("li", "line agent draft");
    node.dataset.draftId = delta.messageId;
    const head = element("div", "head");
    head.append(element("span", "author", nameOf(delta.agentActorId)));
    head.append(element("span", "tag", "writing…"));
    node.append(head, element("div", "text", ""));
    list.append(node);
    draft = { node, text: "", next: 0, agent: delta.agentActorId, inReplyTo: delta.inReplyTo, timer: 0 };
    drafts.set(delta.messageId, draft);
  }
  if (delta.index < draft.next) return; // seen already
  if (delta.index > draft.next) draft.text += "…";
  draft.text += delta.text;
  draft.next = delta.index + 1;
  draft.node.querySelector(".text").textContent = draft.text;
  clearTimeout(draft.timer);
  draft.timer = setTimeout(() => dropDraft(delta.messageId), DRAFT_STALE_MS);
  if (delta.end === "abandoned") dropDraft(delta.messageId);
  else if (delta.end === "posted") draft.node.dataset.state = "posted";
  draft.node.scrollIntoView({ block: "nearest" });
}

// A line ends its own draft, and an agent's line (a notice too) any draft of that agent for
// the same line whose end never came.
function lineArrived(message) {
  dropDraft(message.id);
  const inReplyTo = (message.meta || {}).inReplyTo;
  if (message.role !== "agent" || !inReplyTo) return;
  for (const [id, draft] of drafts) {
    if (draft.agent === message.authorActorId && draft.inReplyTo === inReplyTo) dropDraft(id);
  }
}

// --- approvals: tool calls waiting for a person's decision -----------------------------------

// "approved by Ada", "rejected by Ada: too dear", "expired: nobody decided in time", ...
function decisionText(decided) {
  const who = decided.by ? decided.by.displayName : "someone";
  const why = decided.reason ? ": " + decided.reason : "";
  if (decided.decision === "approve") return "approved by " + who + why;
  if (decided.decision === "reject") return "rejected by " + who + why;
  if (decided.decision === "expired") return "expired: nobody decided in time";
  if (decided.decision === "stopped") return "stopped by " + who;
  return decided.decision;
}

// By callId: {request (tool.approval.requested, or a listed pending approval), decided}.
const approvals = new Map();

function showApproval(base, callId) {
  const entry = approvals.get(callId);
  const list = $("approvals");
  let node = list.querySelector('li.approval[data-call-id="' + CSS.escape(callId) + '"]');
  if (!node) {
    node = element("li", "approval");
    node.dataset.callId = callId;
    list.append(node);
  }
  const request = entry.request || {};
  node.dataset.state = entry.decided ? entry.decided.decision : "pending";
  const head = element("div", "head");
  head.append(element("code", "approval-tool", request.tool || "a tool"));
  if (request.agentActorId) head.append(element("span", "author", nameOf(request.agentActorId)));
  if (!entry.decided && request.deadline) {
    head.append(element("span", "meta", "decide by " + new Date(request.deadline).toLocaleString()));
  }
  const parts = [head];
  if (request.input !== undefined) {
    parts.push(element("pre", "approval-input", JSON.stringify(request.input, null, 2)));
  }
  if (entry.decided) {
    parts.push(element("div", "approval-decision", decisionText(entry.decided)));
  } else if (canApprove) {
    const reason = element("input", "approval-reason");
    reason.placeholder = "reason (for a reject)";
    reason.maxLength = 2000;
    reason.setAttribute("aria-label", "reason");
    const approve = element("button", "approve-button", "Approve");
    const reject = element("button", "reject-button", "Reject");
    for (const [button, decision] of [[approve, "approve"], [reject, "reject"]]) {
      button.type = "button";
      button.onclick = () => decide(base, callId, decision, reason.value.trim(), [approve, reject]);
    }
    const row = element("div", "approval-actions");
    row.append(reason, approve, reject);
    parts.push(row);
  } else {
    parts.push(element("div", "approval-decision", "waiting for a decision"));
  }
  node.replaceChildren(...parts);
  $("approvals-section").hidden = false;
}

async function decide(base, callId, decision, reason, buttons) {
  const body = { decision };
  if (reason) body.reason = reason;
  const who = $("post-name").value.trim() || sessionStorage.getItem(NAME_KEY);
  if (who) body.by = { externalId: who, displayName: who };
  for (const button of buttons) button.disabled = true;
  try {
    await api(base + "/approvals/" + encodeURIComponent(callId), {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    status(""); // the stream's decided event redraws it
  } catch (error) {
    status("Not decided: " + error.message);
    for (const button of buttons) button.disabled = false;
  }
}

// Decisions stay on the page for a while, then the oldest go (a long-open page stays small).
const DECISIONS_SHOWN = 20;

function approvalEvent(base, event) {
  const entry = approvals.get(event.callId) || {};
  if (event.type === "tool.approval.requested") entry.request = entry.request || event;
  else if (event.type === "tool.approval.decided") entry.decided = event;
  else return;
  approvals.set(event.callId, entry);
  showApproval(base, event.callId);
  const decided = [...approvals].filter(([, e]) => e.decided).map(([id]) => id);
  for (const callId of decided.slice(0, Math.max(0, decided.length - DECISIONS_SHOWN))) {
    approvals.delete(callId);
    $("approvals").querySelector('li.approval[data-call-id="' + CSS.escape(callId) + '"]')?.remove();
  }
}

// What waits now (on opening the page and on each reconnect: events missed meanwhile are not
// sent again); a pending one no longer listed was decided unseen and is dropped.
async function loadApprovals(base) {
  if (!canApprove) return;
  const body = await api(base + "/approvals");
  const listed = new Set(body.approvals.map((a) => a.callId));
  await resolveNames(body.approvals.map((a) => a.agentActorId), document.body.dataset.forumId);
  for (const [callId, entry] of approvals) {
    if (!entry.decided && !listed.has(callId)) {
      approvals.delete(callId);
      $("approvals").querySelector('li.approval[data-call-id="' + CSS.escape(callId) + '"]')?.remove();
    }
  }
  for (const approval of body.approvals) {
    const entry = approvals.get(approval.callId) || {};
    entry.request = approval;
    approvals.set(approval.callId, entry);
    showApproval(base, approval.callId);
  }
}

let canApprove = false;

// --- holds: a person who took the forum over -------------------------------------------------

let canTakeOver = false;

// "Held by Ada since 10:02 (the customer asked for a person)", or that its agents answer.
function showHold(hold) {
  const section = $("hold-section");
  section.dataset.held = hold ? "yes" : "no";
  $("hold-status").textContent = hold
    ? "Held by " + hold.holder + " since " + new Date(hold.since).toLocaleString() + (hold.reason ? " (" + hold.reason + ")" : "") + ": its agents say nothing here until it is handed back."
    : "Nobody holds this forum: its agents answer here.";
  $("takeover-button").hidden = Boolean(hold);
  $("takeover-reason").hidden = Boolean(hold);
  $("handback-button").hidden = !hold;
  $("hold-actions").hidden = !canTakeOver;
  section.hidden = false;
}

async function refreshHold(forumId) {
  const info = await api("/console/api/forums/" + encodeURIComponent(forumId));
  showHold(info.hold || null);
}

async function holdAction(base, route, body, buttons) {
  for (const button of buttons) button.disabled = true;
  try {
    await api(base + "/" + route, {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": crypto.randomUUID() },
      body: JSON.stringify(body),
    });
    status("");
    await refreshHold(document.body.dataset.forumId);
  } catch (error) {
    status((route === "takeover" ? "Not taken over: " : "Not handed back: ") + error.message);
  } finally {
    for (const button of buttons) button.disabled = false;
  }
}

function offerHoldActions(base) {
  const buttons = [$("takeover-button"), $("handback-button")];
  const who = () => $("post-name").value.trim() || sessionStorage.getItem(NAME_KEY) || undefined;
  $("takeover-button").onclick = () => {
    const reason = $("takeover-reason").value.trim();
    holdAction(base, "takeover", { as: who(), reason: reason || undefined }, buttons);
  };
  $("handback-button").onclick = () => holdAction(base, "handback", { as: who() }, buttons);
}

// A /takeover or /handback line, or an escalation's event, may change who holds the forum.
function changesHold(message) {
  const text = (message.parts || []).filter((p) => p.type === "text").map((p) => p.text).join("").trim().toLowerCase();
  return message.role === "user" && (text.startsWith("/takeover") || text.startsWith("/handback"));
}

// --- the token ---------------------------------------------------------------------------

function askForToken(reason) {
  status(reason || "");
  const form = $("token-form");
  form.hidden = false;
  form.onsubmit = (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
    form.hidden = true;
    start();
  };
}

async function guarded(run) {
  if (!token()) return askForToken();
  try {
    await run();
  } catch (error) {
    if (error instanceof Unauthorized) return askForToken("That token was refused.");
    status(error.message);
  }
}

// --- pages -------------------------------------------------------------------------------

async function indexPage() {
  $("forums").replaceChildren();
  await moreForums(null);
}

// The forum list a page at a time, newest first (an all-forums token's list may be long).
async function moreForums(before) {
  const body = await api("/console/api/forums" + (before ? "?before=" + encodeURIComponent(before) : ""));
  const list = $("forums");
  const more = $("forums-more");
  more.hidden = body.next === null || body.next === undefined;
  more.onclick = () => moreForums(body.next).catch((error) => status(error.message));
  for (const forum of body.forums) {
    const item = element("li");
    const link = element("a", "forum-link", forum.title || forum.id);
    link.href = "/forums/" + encodeURIComponent(forum.id);
    item.append(link, element("code", "meta", " " + forum.id));
    list.append(item);
  }
  if (!before && !body.forums.length) status("No forums yet (yoke forum create --title T).");
  $("forums-section").hidden = false;
}

async function forumPage() {
  const forumId = document.body.dataset.forumId;
  const base = "/v1/forums/" + encodeURIComponent(forumId);
  const info = await api("/console/api/forums/" + encodeURIComponent(forumId));
  $("forum-title").textContent = info.forum.title || forumId;
  document.title = (info.forum.title || forumId) + " — Yoke mesh console";
  $("forum-view").hidden = false;
  status("");
  canApprove = Boolean(info.canApprove);
  canTakeOver = Boolean(info.canTakeOver);
  showHold(info.hold || null);
  offerHoldActions(base);
  const agentNames = new Map(info.agents.map((a) => [a.agentActorId, a.name]));
  for (const agent of info.agents) names.set(agent.agentActorId, agent.name);
  showAgents(info.agents, Boolean(info.canReadMonologues));
  if (info.canManageMemory) linkMemories(info.agents);
  if (info.agentsCut) $("agents").append(element("li", "meta", "Only the newest " + info.agents.length + " agents are listed."));

  const lines = $("lines");
  const first = Math.max(0, info.head - 100);
  const page = await api(base + "/messages?after=" + first + "&limit=100");
  let lastSeq = await appendLines(lines, page.messages, first);

  $("post-name").value = sessionStorage.getItem(NAME_KEY) || "";
  $("post-form").onsubmit = async (event) => {
    event.preventDefault();
    const who = $("post-name").value.trim();
    const text = $("post-text").value;
    if (!who || !text) return;
    sessionStorage.setItem(NAME_KEY, who);
    $("post-send").disabled = true;
    try {
      await api(base + "/messages", {
        method: "POST",
        headers: { "Content-Type": "application/json", "Idempotency-Key": crypto.randomUUID() },
        body: JSON.stringify({ author: { externalId: who, displayName: who }, text }),
      });
      $("post-text").value = "";
      status("");
    } catch (error) {
      status("Not posted: " + error.message);
    } finally {
      $("post-send").disabled = false;
    }
  };

  const activity = new Map();
  const showActivity = () => {
    const busy = [...activity.entries()].filter(([, state]) => state !== "idle");
    $("activity").textContent = busy
      .map(([id, state]) => (agentNames.get(id) || nameOf(id)) + (state === "tool" ? " is using a tool…" : " is thinking…"))
      .join(" ");
  };

  // The stream, with the token in a header; on any end, again from the last seq seen.
  for (;;) {
    try {
      const opened = () => {
        $("stream-state").textContent = "live";
        loadApprovals(base).catch((error) => status("Approvals: " + error.message));
      };
      await readStream(base + "/stream", lastSeq, opened, async (event, data) => {
        if (event === "message") {
          const message = JSON.parse(data);
          lastSeq = await appendLines(lines, [message], lastSeq);
          lineArrived(message);
          if (message.role === "agent") activity.delete(message.authorActorId);
          showActivity();
          if (changesHold(message)) refreshHold(forumId).catch((error) => status(error.message));
        } else if (event === "delta") {
          showDelta(lines, JSON.parse(data));
        } else if (event === "approval") {
          const approval = JSON.parse(data);
          if (approval.agentActorId) await resolveNames([approval.agentActorId], approval.forumId || document.body.dataset.forumId);
          approvalEvent(base, approval);
        } else if (event.startsWith("escalation.")) {
          refreshHold(forumId).catch((error) => status(error.message));
        } else if (event === "activity") {
          const update = JSON.parse(data);
          activity.set(update.agentActorId, update.state);
          showActivity();
        }
      });
    } catch (error) {
      if (error instanceof Unauthorized) return askForToken("That token was refused.");
    }
    $("stream-state").textContent = "reconnecting…";
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

async function readStream(url, lastSeq, onOpen, onEvent) {
  const response = await fetch(url, {
    headers: { Authorization: "Bearer " + token(), "Last-Event-ID": String(lastSeq) },
  });
  if (response.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    throw new Unauthorized("the token was refused");
  }
  if (!response.ok || !response.body) throw new Error("stream: " + response.status);
  onOpen();
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
      }
      if (data.length) await onEvent(event, data.join("\n"));
    }
  }
}

// --- the monologue panel -------------------------------------------------------------------

let monologueTimer = null;

function showAgents(agents, canReadMonologues) {
  const list = $("agents");
  list.replaceChildren();
  if (!agents.length) list.append(element("li", "meta", "No agent has joined this forum."));
  if (agents.length && !canReadMonologues) {
    // An agent's private working is a right of its own: the gateway answers 403 without it.
    for (const agent of agents) list.append(element("li", null, agent.name + (agent.left ? " (left)" : "")));
    list.append(element("li", "meta", "Monologues are shown to tokens made with yoke token create --can-read-monologues."));
    return;
  }
  for (const agent of agents) {
    const item = element("li");
    const button = element("button", "agent-link", agent.name + (agent.left ? " (left)" : ""));
    button.type = "button";
    button.dataset.agent = agent.agentActorId;
    button.onclick = () => openMonologue(agent, agent.monologueId);
    item.append(button);
    list.append(item);
  }
}

function openMonologue(agent, monologueId) {
  $("monologue").hidden = false;
  $("monologue-title").textContent = agent.name + "'s monologue";
  const select = $("monologue-select");
  select.replaceChildren();
  agent.monologues.forEach((id, index) => {
    const last = index === agent.monologues.length - 1;
    const option = element("option", "", (last ? "active " : "before compaction " + (index + 1) + " ") + id.slice(0, 8));
    option.value = id;
    option.selected = id === monologueId;
    select.append(option);
  });
  select.onchange = () => openMonologue(agent, select.value);
  const list = $("monologue-lines");
  list.replaceChildren();
  list.dataset.monologueId = monologueId;
  if (monologueTimer) clearTimeout(monologueTimer);
  let lastSeq = -1;
  const poll = async () => {
    if (list.dataset.monologueId !== monologueId) return;
    try {
      const after = lastSeq < 0 ? "" : "?after=" + lastSeq;
      const body = await api("/console/api/monologues/" + encodeURIComponent(monologueId) + "/messages" + after);
      if (list.dataset.monologueId !== monologueId) return;
      lastSeq = await appendLines(list, body.messages, Math.max(lastSeq, 0));
      showToolCalls(list, body.toolCalls || []);
      if (lastSeq < 0) lastSeq = 0;
    } catch (error) {
      if (error instanceof Unauthorized) return askForToken("That token was refused.");
      status(error.message);
    }
    monologueTimer = setTimeout(poll, MONOLOGUE_POLL_MS);
  };
  poll();
}

// --- an agent's memories ------------------------------------------------------------------

// Each agent of the forum links to its memories page (for a --can-manage-memory token).
function linkMemories(agents) {
  for (const agent of agents) {
    const item = element("li", "memories-link");
    const link = element("a", "agent-memories", agent.name + "'s memories");
    link.href = "/agents/" + encodeURIComponent(agent.agentActorId) + "/memories";
    item.append(link);
    $("agents").append(item);
  }
}

function showMemory(memory) {
  const item = element("li", "memory");
  item.dataset.memoryId = memory.id;
  const head = element("div", "head");
  head.append(element("span", "scope", memory.scope), element("span", "meta", new Date(memory.createdAt).toLocaleString()));
  const source = memory.source || {};
  if (source.forumId) {
    const forum = element("a", "memory-forum", "forum " + source.forumId.slice(0, 8));
    forum.href = "/forums/" + encodeURIComponent(source.forumId);
    head.append(forum);
  } else {
    head.append(element("span", "meta", "added by an operator"));
  }
  const forget = element("button", "forget", "Forget");
  forget.type = "button";
  forget.onclick = async () => {
    forget.disabled = true;
    try {
      await api("/v1/memories/" + encodeURIComponent(memory.id), { method: "DELETE" });
      item.remove();
    } catch (error) {
      status("Not forgotten: " + error.message);
      forget.disabled = false;
    }
  };
  head.append(forget);
  item.append(head, element("p", "text", memory.text));
  if (memory.line) {
    const said = element("blockquote", "source-line");
    said.append(element("span", "author", (source.authorName || nameOf(memory.line.authorActorId)) + " #" + memory.line.seq + ": "), element("span", "said", memory.line.text));
    item.append(said);
  } else if (source.messageId) {
    item.append(element("p", "meta source-gone", "The line that taught it is no longer there."));
  }
  return item;
}

async function memoriesPage() {
  const agentId = document.body.dataset.agentId;
  const body = await api("/console/api/agents/" + encodeURIComponent(agentId) + "/memories");
  if (body.name) {
    $("memories-title").textContent = body.name + "'s memories";
    document.title = body.name + "'s memories — Yoke mesh console";
  }
  $("memories").replaceChildren(...body.memories.map(showMemory));
  $("memories-note").textContent = body.memories.length ? "" : "It remembers nothing your token's forums taught it.";
  $("memories-section").hidden = false;
}

// --- the inbox: escalations waiting for a person ----------------------------------------------

const INBOX_POLL_MS = 5000;
let inboxTimer = null;

function showEscalation(escalation, mayClaim) {
  const item = element("li", "escalation");
  item.dataset.escalationId = escalation.id;
  item.dataset.urgency = escalation.urgency;
  item.dataset.state = escalation.state;
  const head = element("div", "head");
  const forum = element("a", "escalation-forum", "forum " + escalation.forumId.slice(0, 8));
  forum.href = "/forums/" + encodeURIComponent(escalation.forumId);
  head.append(element("span", "author", nameOf(escalation.agentActorId)), forum);
  head.append(element("span", "tag", escalation.urgency + " urgency"));
  head.append(element("span", "meta", "asked " + new Date(escalation.openedAt).toLocaleString()));
  head.append(element("span", "meta", "until " + new Date(escalation.deadline).toLocaleString()));
  item.append(head, element("div", "escalation-reason", escalation.reason));
  if (mayClaim) {
    const claim = element("button", "claim-button", "Claim");
    claim.type = "button";
    claim.onclick = () => claimEscalation(escalation, claim);
    item.append(claim);
  }
  return item;
}

async function claimEscalation(escalation, button) {
  const who = $("claim-as").value.trim() || sessionStorage.getItem(NAME_KEY);
  if (!who) {
    status("Say who claims it first (claim as).");
    return;
  }
  sessionStorage.setItem(NAME_KEY, who);
  button.disabled = true;
  try {
    await api("/v1/escalations/" + encodeURIComponent(escalation.id) + "/claim", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ as: who }),
    });
    status("Claimed: you hold the forum now.");
    const item = $("escalations").querySelector('li.escalation[data-escalation-id="' + CSS.escape(escalation.id) + '"]');
    if (item) {
      item.dataset.state = "claimed";
      button.replaceWith(element("a", "claimed-link", "claimed: open the forum"));
      item.querySelector("a.claimed-link").href = "/forums/" + encodeURIComponent(escalation.forumId);
    }
  } catch (error) {
    status("Not claimed: " + error.message);
    button.disabled = false;
  }
}

async function inboxPage() {
  const me = await api("/console/api/token");
  const mayClaim = Boolean(me.canTakeOver);
  $("claim-as-row").hidden = !mayClaim;
  $("claim-as").value = sessionStorage.getItem(NAME_KEY) || "";
  $("inbox-section").hidden = false;
  const load = async () => {
    const body = await api("/v1/escalations?state=open");
    for (const escalation of body.escalations) await resolveNames([escalation.agentActorId], escalation.forumId);
    const list = $("escalations");
    // Claimed here a moment ago: kept (with its link) until the page is left.
    const claimed = [...list.querySelectorAll('li.escalation[data-state="claimed"]')];
    list.replaceChildren(...claimed, ...body.escalations.map((e) => showEscalation(e, mayClaim)));
    $("inbox-note").textContent = body.escalations.length ? "" : "Nobody is waiting for a person.";
  };
  const poll = async () => {
    try {
      await load();
    } catch (error) {
      if (error instanceof Unauthorized) return askForToken("That token was refused.");
      status(error.message);
    }
    inboxTimer = setTimeout(poll, INBOX_POLL_MS);
  };
  if (inboxTimer) clearTimeout(inboxTimer);
  await load();
  inboxTimer = setTimeout(poll, INBOX_POLL_MS);
}

// --- dead letters ------------------------------------------------------------------------

function row(cells) {
  const tr = element("tr");
  for (const cell of cells) tr.append(element("td", "", cell === null || cell === undefined ? "" : String(cell)));
  return tr;
}

async function deadLettersPage() {
  const body = await api("/console/api/dead-letters");
  const mesh = $("mesh-letters").tBodies[0];
  mesh.replaceChildren();
  if (body.mesh === null) {
    $("mesh-note").textContent = "Shown to all-forums tokens made with --can-read-monologues only.";
  } else if (typeof body.mesh === "string") {
    $("mesh-note").textContent = body.mesh;
  } else {
    $("mesh-note").textContent = body.mesh.length ? "" : "None.";
    for (const letter of body.mesh) mesh.append(row([letter.messageId, letter.service, letter.attempts, letter.error]));
  }
  const hooks = $("webhook-letters").tBodies[0];
  hooks.replaceChildren();
  for (const letter of body.webhooks) {
    hooks.append(row([letter.createdAt, letter.forumId, "#" + letter.seq + " " + letter.messageId, letter.url, letter.attempts, letter.reason]));
  }
  $("letters-section").hidden = false;
}

// --- start -------------------------------------------------------------------------------

function start() {
  const page = document.body.dataset.page;
  const run = { index: indexPage, forum: forumPage, inbox: inboxPage, "dead-letters": deadLettersPage, memories: memoriesPage }[page];
  if (run) guarded(run);
}

document.addEventListener("DOMContentLoaded", () => {
  $("forget-token").onclick = () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload();
  };
  start();
});
