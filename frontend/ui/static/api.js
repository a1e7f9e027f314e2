// Requests to this server's API: the key (when the server asks for one) is asked once and kept
// in this tab's sessionStorage, sent as a Bearer token.

const KEY = "deepinfer-api-key";

function headers(extra) {
  const out = { ...extra };
  const key = sessionStorage.getItem(KEY);
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

// One dialog for every request that met a 401 meanwhile (the chat and the server view's
// /metrics poll): each waits for the same key.
let asking = null;

function askForKey() {
  const dialog = document.getElementById("api-key-dialog");
  const input = document.getElementById("api-key-input");
  asking ??= new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      sessionStorage.setItem(KEY, input.value.trim());
      input.value = "";
      asking = null;
      resolve();
    }, { once: true });
    dialog.showModal();
    input.focus();
  });
  return asking;
}

// fetch() with the key; a 401 asks for a key and tries again (until one works).
export async function apiFetch(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers(options.headers) });
    if (response.status !== 401) return response;
    await askForKey();
  }
}

// The error message of a failed API response (OpenAI's shape), or its status.
export async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// Server-sent events of a streaming response: yields each `data:` payload parsed.
export async function* sseEvents(response) {
  const reader = response.body.getReader();
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
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
