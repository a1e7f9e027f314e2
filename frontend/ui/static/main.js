// The page: the model selector (base model and its LoRA adapters), the two views.

import { apiFetch, errorText } from "./api.js";
import { Chat } from "./chat.js";
import { ServerView } from "./server_view.js";

async function loadModels(select) {
  const response = await apiFetch("/v1/models");
  if (!response.ok) throw new Error(await errorText(response));
  const { data } = await response.json();
  select.replaceChildren(...data.map((model) => {
    const option = document.createElement("option");
    option.value = model.id;
    option.textContent = model.parent ? `${model.id} (adapter of ${model.parent})` : model.id;
    return option;
  }));
}

function showView(button) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab === button);
    document.getElementById(tab.dataset.view).hidden = tab !== button;
  }
}

const select = document.getElementById("model");
new Chat(select);
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => showView(tab));
}
new ServerView().start();
loadModels(select).catch((err) => {
  document.getElementById("messages").textContent = `Could not list the models: ${err.message}`;
});
