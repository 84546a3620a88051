// Drawing canvas (mouse, pen and touch), upload, dims slider and the results grid.
(function () {
  "use strict";
  const canvas = document.getElementById("canvas");
  const ctx = canvas.getContext("2d");
  const dims = document.getElementById("dims");
  const dimsValue = document.getElementById("dims-value");
  const kInput = document.getElementById("k");
  const statusEl = document.getElementById("status");
  const results = document.getElementById("results");
  let strokes = [];      // each stroke: list of [x, y] in canvas pixels
  let current = null;
  let uploaded = null;   // a File chosen with the upload button, until the user draws
  let inflight = null;
  const keyForm = document.getElementById("key-form");
  const keyInput = document.getElementById("api-key");
  let apiKey = sessionStorage.getItem("sketchsvd-api-key") || "";
  let onKey = null;      // what to run again once a key is entered

  // Every API call: with the key when there is one; a 401 asks for it (the page and
  // /health are open, everything else needs the key when the service has keys).
  async function api(url, options, retry) {
    const headers = apiKey ? { "X-API-Key": apiKey } : {};
    const resp = await fetch(url, { ...(options || {}), headers });
    if (resp.status === 401) {
      onKey = retry;
      keyForm.hidden = false;
      keyInput.focus();
      throw new Error(apiKey ? "the API key was refused; enter another" : "this service needs an API key");
    }
    return resp;
  }

  keyForm.addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = keyInput.value.trim();
    sessionStorage.setItem("sketchsvd-api-key", apiKey);
    keyForm.hidden = true;
    setStatus("");
    if (onKey) onKey();
  });

  function setStatus(text, isError) {
    statusEl.textContent = text;
    statusEl.className = isError ? "error" : "";
  }

  function redraw() {
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.strokeStyle = "#000";
    ctx.lineWidth = 3;
    ctx.lineCap = "round";
    ctx.lineJoin = "round";
    for (const s of strokes) {
      ctx.beginPath();
      s.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
      if (s.length === 1) ctx.lineTo(s[0][0] + 0.1, s[0][1]);
      ctx.stroke();
    }
  }

  function point(clientX, clientY) {
    const r = canvas.getBoundingClientRect();
    return [(clientX - r.left) * canvas.width / r.width, (clientY - r.top) * canvas.height / r.height];
  }

  function start(x, y) {
    if (uploaded) { uploaded = null; strokes = []; }
    current = [point(x, y)];
    strokes.push(current);
    redraw();
  }
  function move(x, y) {
    if (!current) return;
    current.push(point(x, y));
    redraw();
  }
  function end() {
    if (!current) return;
    current = null;
    search();
  }

  if (window.PointerEvent) {
    // Pointer events cover mouse, pen and touch alike.
    canvas.addEventListener("pointerdown", (e) => {
      canvas.setPointerCapture(e.pointerId);
      start(e.clientX, e.clientY);
      e.preventDefault();
    });
    canvas.addEventListener("pointermove", (e) => { move(e.clientX, e.clientY); e.preventDefault(); });
    canvas.addEventListener("pointerup", end);
    canvas.addEventListener("pointercancel", end);
  } else {
    canvas.addEventListener("mousedown", (e) => start(e.clientX, e.clientY));
    canvas.addEventListener("mousemove", (e) => move(e.clientX, e.clientY));
    window.addEventListener("mouseup", end);
    const t = (f) => (e) => { e.preventDefault(); const p = e.changedTouches[0]; f(p.clientX, p.clientY); };
    canvas.addEventListener("touchstart", t(start), { passive: false });
    canvas.addEventListener("touchmove", t(move), { passive: false });
    canvas.addEventListener("touchend", (e) => { e.preventDefault(); end(); }, { passive: false });
  }

  function sketchBlob() {
    if (uploaded) return Promise.resolve(uploaded);
    return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
  }

  async function search() {
    if (!uploaded && strokes.length === 0) { setStatus("draw something first"); return; }
    if (inflight) inflight.abort();
    inflight = new AbortController();
    const blob = await sketchBlob();
    const form = new FormData();
    form.append("file", blob, uploaded ? uploaded.name : "sketch.png");
    const url = `/retrieve?dims=${dims.value}&k=${kInput.value}`;
    setStatus("searching\u2026");
    const t0 = performance.now();
    try {
      const resp = await api(url, { method: "POST", body: form, signal: inflight.signal }, search);
      const body = await resp.json();
      if (!resp.ok) throw new Error(typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail));
      show(body);
      setStatus(`${body.results.length} photos, d = ${body.dims}, ${Math.round(performance.now() - t0)} ms`);
    } catch (err) {
      if (err.name !== "AbortError") setStatus(`error: ${err.message}`, true);
    }
  }

  function show(body) {
    results.replaceChildren(...body.results.map((h) => {
      const fig = document.createElement("figure");
      fig.className = "hit";
      const img = document.createElement("img");
      img.src = h.url;
      // a photo without a class folder is named by its file
      const label = h.class ?? h.path.split("/").pop();
      img.alt = label;
      img.loading = "lazy";
      const cap = document.createElement("figcaption");
      const cls = document.createElement("span");
      cls.textContent = label;
      cls.title = h.path;
      const score = document.createElement("span");
      score.textContent = h.score.toFixed(3);
      cap.append(cls, score);
      fig.append(img, cap);
      return fig;
    }));
  }

  document.getElementById("search").addEventListener("click", search);
  document.getElementById("clear").addEventListener("click", () => {
    strokes = []; uploaded = null; redraw(); results.replaceChildren(); setStatus("");
  });
  document.getElementById("undo").addEventListener("click", () => { strokes.pop(); redraw(); });
  document.getElementById("upload").addEventListener("change", (e) => {
    const file = e.target.files[0];
    if (!file) return;
    uploaded = file;
    strokes = [];
    const img = new Image();
    img.onload = () => {
      redraw();
      ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      URL.revokeObjectURL(img.src);
    };
    img.src = URL.createObjectURL(file);
    search();
  });
  dims.addEventListener("input", () => { dimsValue.textContent = dims.value; });
  dims.addEventListener("change", () => { if (uploaded || strokes.length) search(); });
  kInput.addEventListener("change", () => { if (uploaded || strokes.length) search(); });

  function loadInfo() {
    api("/info", {}, loadInfo).then((r) => r.json()).then(showInfo)
      .catch((err) => setStatus(`cannot load /info: ${err.message}`, true));
  }

  function showInfo(info) {
    dims.max = info.available_dims.max;
    dims.value = info.available_dims.max;
    dimsValue.textContent = dims.value;
    kInput.max = info.limits.max_k;
    kInput.value = Math.min(info.limits.default_k, info.limits.max_k);
    document.getElementById("model-info").textContent =
      `${info.model} \u00b7 ${info.backbone} \u00b7 ${info.modes} modes` +
      (info.raw_dims ? ` + ${info.raw_dims} raw dims` : "") +
      ` \u00b7 ${info.gallery_size} photos` +
      (info.classes ? ` in ${info.classes} classes` : "");
    document.body.dataset.ready = "1";
  }

  loadInfo();
  redraw();
})();
