"""The page served at ``/``: a prompt box, a threshold slider, the streamed answer with each forward
pass's accepted tokens shaded together (darker = more tokens in that forward), and the live server
figures (tau, queue, batch, tokens/s, tokens per forward) polled from ``/stats``.

One self-contained HTML document (no external assets: the server may run where nothing else is
reachable).  It streams from ``/v1/chat/completions`` (or ``/v1/completions``) with ``fetch`` and reads the
server-sent events itself, since ``EventSource`` cannot POST.

The threshold shown is the one served: the slider's value is sent with the request (it starts at 0.90,
clamped to the server's bounds once they are known, and the label follows the clamping); ticking
"server tau" disables the slider and makes it show the server's live tau, which is what a request
without a threshold gets.  When the server wants an API key (``/stats`` says so), a key box appears and
the key is sent as ``Authorization: Bearer``.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>MARS server</title>
<style>
  :root { --fg:#1d232b; --muted:#5b6570; --line:#d5dbe1; --accent:#2f6fb2; }
  body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--fg); margin: 0; background: #f6f7f9; }
  header { background: #1f2a36; color: #fff; padding: 10px 20px; display: flex; gap: 24px; align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  #live { display: flex; gap: 18px; flex-wrap: wrap; font-variant-numeric: tabular-nums; }
  #live span b { color: #9fd0ff; font-weight: 600; }
  main { max-width: 980px; margin: 18px auto; padding: 0 16px; }
  .card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 16px; margin-bottom: 14px; }
  textarea { width: 100%; box-sizing: border-box; min-height: 84px; font: inherit; padding: 8px; border: 1px solid var(--line); border-radius: 6px; }
  .row { display: flex; gap: 18px; align-items: center; flex-wrap: wrap; margin-top: 10px; }
  label { color: var(--muted); }
  input[type=range] { width: 220px; vertical-align: middle; }
  input[type=number] { width: 70px; }
  button { font: inherit; padding: 6px 16px; border-radius: 6px; border: 1px solid var(--accent); background: var(--accent); color: #fff; cursor: pointer; }
  button.secondary { background: #fff; color: var(--accent); }
  button:disabled { opacity: .5; cursor: default; }
  #output { white-space: pre-wrap; min-height: 120px; font: 15px/1.7 ui-monospace, "DejaVu Sans Mono", monospace; }
  .fwd { border-radius: 3px; padding: 1px 0; }
  .fwd.a { background: rgba(47,111,178,var(--alpha)); }
  .fwd.b { background: rgba(214,120,38,var(--alpha)); }
  #req { color: var(--muted); font-variant-numeric: tabular-nums; margin-top: 8px; }
  #error { color: #b3261e; }
  .legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border-radius: 3px; }
</style>
</head>
<body>
<header>
  <h1>MARS server <small id="model" style="font-weight:400;color:#c9d3dd"></small></h1>
  <div id="live">
    <span>tau <b id="live-tau">-</b> <small id="live-policy"></small></span>
    <span>queue <b id="live-queue">-</b></span>
    <span>batch <b id="live-running">-</b></span>
    <span>tokens/s <b id="live-tps">-</b></span>
    <span>tokens/forward <b id="live-tpf">-</b></span>
  </div>
</header>
<main>
  <div class="card">
    <textarea id="prompt" placeholder="Ask something...">Write a haiku about the sea.</textarea>
    <div class="row">
      <label title="leave tau to the server's policy (the slider then shows the server's live tau)">
        <input type="checkbox" id="use-server"> server tau</label>
      <label>threshold <input type="range" id="threshold" min="0.5" max="1" step="0.01" value="0.9">
        <b id="threshold-value">0.90</b></label>
      <label>max tokens <input type="number" id="max-tokens" value="96" min="1"></label>
      <label><input type="checkbox" id="verify"> verify (lossless)</label>
      <label><select id="mode"><option value="chat">chat</option><option value="completion">completion</option></select></label>
      <label id="api-key-box" hidden>API key <input type="password" id="api-key" size="14" autocomplete="off"></label>
      <button id="send">Send</button>
      <button id="stop" class="secondary" disabled>Stop</button>
    </div>
  </div>
  <div class="card">
    <div class="legend" style="color:var(--muted);font-size:13px;margin-bottom:8px">
      Each shaded run is one forward pass's accepted tokens (colours alternate; darker = more tokens in that forward).
    </div>
    <div id="output"></div>
    <div id="req"></div>
    <div id="error"></div>
  </div>
</main>
<script>
const $ = (id) => document.getElementById(id);
let controller = null;

function fmt(x, d) { return (x === null || x === undefined) ? "-" : Number(x).toFixed(d); }

async function poll() {
  try {
    const r = await fetch("/stats");
    const s = await r.json();
    $("model").textContent = s.model || "";
    $("live-tau").textContent = fmt(s.tau, 3);
    $("live-policy").textContent = s.policy ? "(" + s.policy + ")" : "";
    $("live-queue").textContent = s.queued;
    $("live-running").textContent = s.running + "/" + s.max_batch;
    $("live-tps").textContent = fmt(s.tokens_per_second, 1);
    $("live-tpf").textContent = fmt(s.tokens_per_forward, 2);
    $("api-key-box").hidden = !s.api_key_required;
    const slider = $("threshold");
    if (!slider.dataset.bounded && s.tau_min !== undefined) {
      slider.min = s.tau_min; slider.max = s.tau_max; slider.dataset.bounded = "1";  // the browser clamps value
    }
    serverTau = s.tau;
    showThreshold();
  } catch (e) { /* server restarting: keep polling */ }
}

// What the label shows is what a request is served: the slider's value, or with "server tau" the live tau.
// (verify is served at the exact reference threshold whatever the slider says).
let serverTau = null;
function showThreshold() {
  const slider = $("threshold"), useServer = $("use-server").checked, verify = $("verify").checked;
  const known = serverTau !== null && serverTau !== undefined;
  slider.disabled = useServer || verify;
  if (useServer && known) slider.value = serverTau;
  $("threshold-value").textContent = verify ? "exact (verify)"
    : useServer ? (known ? Number(serverTau).toFixed(2) : "server") : Number(slider.value).toFixed(2);
}
setInterval(poll, 1000); poll();

for (const id of ["use-server", "verify"]) $(id).addEventListener("change", showThreshold);
$("threshold").addEventListener("input", showThreshold);

let pieces = 0;
function addPiece(text, tokens, forward) {
  if (!text) return;  // a forward whose tokens are all special (no text)
  const span = document.createElement("span");
  span.className = "fwd " + (pieces++ % 2 ? "b" : "a");  // neighbours always differ
  span.dataset.forward = forward;
  span.style.setProperty("--alpha", Math.min(0.12 + 0.14 * Math.max(tokens - 1, 0), 0.6).toFixed(2));
  span.title = "forward " + forward + ": " + tokens + " token" + (tokens === 1 ? "" : "s");
  span.dataset.tokens = tokens;
  span.textContent = text;
  $("output").appendChild(span);
}

function showStats(m) {
  if (!m) return;
  $("req").textContent = "served at tau " + fmt(m.threshold, 3) + " | " + m.completion_tokens + " tokens in " +
    m.forwards + " forwards = " + fmt(m.tokens_per_forward, 2) + " tokens/forward | TTFT " +
    fmt(m.ttft_seconds, 2) + " s | latency " + fmt(m.latency_seconds, 2) + " s";
}

async function send() {
  $("output").textContent = ""; $("req").textContent = ""; $("error").textContent = ""; pieces = 0;
  delete $("output").dataset.done;
  const chat = $("mode").value === "chat";
  const body = { model: $("model").textContent || undefined, stream: true,
                 max_tokens: parseInt($("max-tokens").value, 10) };
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  if (!$("use-server").checked) body.threshold = parseFloat($("threshold").value);
  if ($("verify").checked) { body.verify = true; delete body.threshold; }
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const headers = { "Content-Type": "application/json" };
  if ($("api-key").value) headers["Authorization"] = "Bearer " + $("api-key").value;
  try {
    const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers, body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) { const e = await r.json(); throw new Error(r.status + ": " + e.error.message); }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf = (buf + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(msg.error.message);
          const c = msg.choices[0];
          if (!c) continue;
          const text = chat ? (c.delta.content || "") : (c.text || "");
          addPiece(text, msg.mars.tokens, msg.mars.forward);
          if (c.finish_reason) { showStats(msg.mars); $("output").dataset.done = c.finish_reason; }
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("error").textContent = String(e.message || e);
  } finally {
    $("send").disabled = false; $("stop").disabled = true; controller = null;
  }
}
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
</script>
</body>
</html>
"""
