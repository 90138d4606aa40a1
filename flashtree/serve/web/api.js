// Talking to the server: the API key, authorized fetches, and the server-sent events of a stream.
//
// The page itself is public; the API is not when the server runs with --api-key. So every call
// goes through apiFetch, which sends the stored key as a bearer token and, on a 401, asks for
// the key once (a dialog), stores it in localStorage and retries. Nothing else is stored.

const KEY_STORE = "flashtree.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function forgetApiKey() {
  localStorage.removeItem(KEY_STORE);
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

let pendingAsk = null; // one dialog at a time, however many calls are waiting for the key

function askKey(again) {
  if (pendingAsk) return pendingAsk;
  pendingAsk = new Promise((resolve, reject) => {
    const dialog = document.createElement("dialog");
    dialog.className = "key-dialog";
    dialog.innerHTML = `<form method="dialog">
      <h2>API key</h2>
      <p>This server was started with <code>--api-key</code>. The key is kept in this browser only.</p>
      <p class="error" hidden>That key was refused.</p>
      <input type="password" name="key" autocomplete="off" placeholder="API key" required>
      <div class="row"><button value="cancel" formnovalidate>Cancel</button><button value="ok">Use key</button></div>
    </form>`;
    dialog.querySelector(".error").hidden = !again;
    document.body.appendChild(dialog);
    dialog.addEventListener("close", () => {
      const key = dialog.querySelector("input").value.trim();
      dialog.remove();
      pendingAsk = null;
      if (dialog.returnValue === "ok" && key) {
        localStorage.setItem(KEY_STORE, key);
        resolve(key);
      } else {
        reject(new Error("an API key is needed"));
      }
    });
    dialog.showModal();
  });
  return pendingAsk;
}

// fetch(path) with the key; a 401 asks for the key and tries again.
export async function apiFetch(path, options = {}) {
  let asked = false;
  for (;;) {
    const response = await fetch(path, { ...options, headers: { ...(options.headers || {}), ...authHeaders() } });
    if (response.status !== 401) return response;
    await askKey(asked || Boolean(apiKey()));
    asked = true;
  }
}

// The error message of a failed response: the server's `error.message` when it sent one.
export async function errorText(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message || text;
  } catch {
    return `${response.status} ${response.statusText}: ${text.slice(0, 300)}`;
  }
}

// Yield each `data:` JSON object of a text/event-stream response, until `[DONE]` or its end.
export async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
    if (done) return;
  }
}
