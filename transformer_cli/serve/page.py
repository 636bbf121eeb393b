"""GET /: a page to translate in the browser: a text box, the model's languages, a file to upload
and its translation to download. Everything is in this one page (no script, style or font from
elsewhere): it works offline. It holds no data, so it is served without a key; its requests carry
the key typed into it (kept in the tab's sessionStorage) where the server has keys."""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tfm translate</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
  h1 { font-size: 1.4rem; margin-bottom: 0.2rem; }
  #languages { color: #555; margin-bottom: 1rem; }
  .panes { display: flex; gap: 1rem; }
  textarea { width: 100%; height: 12rem; font: inherit; padding: 0.5rem; box-sizing: border-box; }
  .pane { flex: 1; }
  button { font: inherit; padding: 0.4rem 1rem; margin: 0.5rem 0.5rem 0.5rem 0; }
  #error { color: #a00; min-height: 1.2rem; }
  fieldset { border: 1px solid #ccc; margin-top: 1rem; }
  #key-row { display: none; margin-bottom: 1rem; }
</style>
</head>
<body>
<h1>tfm translate</h1>
<div id="languages">loading the model's languages…</div>
<div id="key-row"><label>API key <input id="key" type="password" size="40" autocomplete="off"></label>
  <button id="use-key" type="button">Use key</button></div>
<div class="panes">
  <div class="pane"><label for="source">Text</label>
    <textarea id="source" placeholder="Text to translate: sentences, paragraphs"></textarea></div>
  <div class="pane"><label for="target">Translation</label>
    <textarea id="target" readonly></textarea></div>
</div>
<label>Target language <select id="tgt-lang"></select></label>
<button id="translate" type="button">Translate</button>
<div id="error" role="alert"></div>
<fieldset><legend>A file (.txt, .html, .xml, .md, .srt, .vtt, .docx)</legend>
  <input id="file" type="file" accept=".txt,.html,.htm,.xml,.xhtml,.md,.markdown,.srt,.vtt,.docx">
  <button id="translate-file" type="button">Translate the file</button>
  <a id="download" href="#" hidden>download the translation</a>
</fieldset>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function headers(extra) {
  const key = sessionStorage.getItem("tfm-key");
  return Object.assign(key ? { "Authorization": "Bearer " + key } : {}, extra || {});
}
async function failed(response) {
  if (response.status === 401) { $("key-row").style.display = "block"; }
  let message = response.status + " " + response.statusText;
  try { message = (await response.json()).error || message; } catch (e) { /* not JSON */ }
  $("error").textContent = message;
}
async function languages() {
  const response = await fetch("/languages", { headers: headers() });
  if (!response.ok) { $("languages").textContent = ""; return failed(response); }
  const found = await response.json();
  const source = found.source.length ? found.source.join(", ") : "any language";
  $("languages").textContent = "Translates from " + source + " into " + (found.target.join(", ") || "its language");
  const select = $("tgt-lang");
  select.innerHTML = "";
  for (const language of found.target) { select.add(new Option(language, language)); }
  select.parentElement.hidden = !found.multilingual;
}
function targetLanguage() {
  const select = $("tgt-lang");
  return select.parentElement.hidden || !select.value ? {} : { tgt_lang: select.value };
}
$("translate").addEventListener("click", async () => {
  $("error").textContent = "";
  $("target").value = "";
  const body = Object.assign({ text: $("source").value, format: "text" }, targetLanguage());
  const response = await fetch("/translate", { method: "POST", body: JSON.stringify(body),
    headers: headers({ "Content-Type": "application/json" }) });
  if (!response.ok) { return failed(response); }
  $("target").value = (await response.json()).translations[0];
});
$("translate-file").addEventListener("click", async () => {
  $("error").textContent = "";
  const file = $("file").files[0];
  if (!file) { $("error").textContent = "choose a file first"; return; }
  const link = $("download");
  link.hidden = true;
  const response = await fetch("/translate/file?name=" + encodeURIComponent(file.name),
    { method: "POST", body: file, headers: headers({ "Content-Type": "application/octet-stream" }) });
  if (!response.ok) { return failed(response); }
  const disposition = response.headers.get("Content-Disposition") || "";
  const named = /filename="([^"]+)"/.exec(disposition);
  link.download = named ? named[1] : "translation";
  link.href = URL.createObjectURL(await response.blob());
  link.textContent = "download " + link.download;
  link.hidden = false;
});
$("use-key").addEventListener("click", () => {
  sessionStorage.setItem("tfm-key", $("key").value.trim());
  $("error").textContent = "";
  languages();
});
languages();
</script>
</body>
</html>
"""
