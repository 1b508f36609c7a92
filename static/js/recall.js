// Recall's only script: refresh the live regions of a page, count down lease
// expiries, and close the phone's menu. Pages work without it; with it, the regions marked data-live-url are
// fetched again every few seconds (2 s, 5 s or off; kept in localStorage), only
// while the tab is visible, and no longer once the server answers 286 (nothing
// will change) or marks a region data-live-final.
(() => {
  "use strict";
  const KEY = "recall.refresh";
  const control = document.querySelector("[data-refresh-control]");
  const select = document.getElementById("refresh-interval");
  const status = document.querySelector("[data-refresh-status]");
  let timer = null;
  let busy = false;

  const interval = () => {
    const value = localStorage.getItem(KEY) || "2";
    return value === "off" ? 0 : Number(value) || 2;
  };
  const regions = () => [...document.querySelectorAll("[data-live-url]:not([data-live-final])")];
  const say = (text) => { if (status) status.textContent = text; };

  function schedule() {
    clearTimeout(timer);
    const seconds = interval();
    if (!regions().length) return say(document.querySelector("[data-live-url]") ? "up to date" : "");
    if (!seconds) return say("paused");
    if (document.visibilityState !== "visible") return say("paused while hidden");
    say("live");
    timer = setTimeout(tick, seconds * 1000);
  }

  async function tick() {
    if (busy || document.visibilityState !== "visible") return schedule();
    busy = true;
    try {
      for (const region of regions()) await refresh(region);
    } finally {
      busy = false;
      schedule();
    }
  }

  async function refresh(region) {
    // Items ticked for a re-run would be lost with the region: keep it until sent.
    if (region.querySelector("input[type=checkbox]:checked")) return say("paused: items ticked");
    let response;
    try {
      response = await fetch(region.dataset.liveUrl, {
        credentials: "same-origin",
        headers: { "X-Requested-With": "recall-refresh" },
      });
    } catch {
      return say("offline: retrying");
    }
    if (response.headers.get("X-Recall-Fragment") !== "1") {
      // Logged out, or no longer allowed: stop rather than paint a login page.
      region.dataset.liveFinal = "1";
      return say(response.redirected ? "session ended: reload" : `stopped (${response.status})`);
    }
    const template = document.createElement("template");
    template.innerHTML = (await response.text()).trim();
    const fresh = template.content.firstElementChild;
    if (!fresh) return;
    if (response.status === 286) fresh.dataset.liveFinal = "1";
    region.replaceWith(fresh);
    bind(fresh);
  }

  function countdowns() {
    const now = Date.now();
    for (const el of document.querySelectorAll("time[data-countdown]")) {
      const at = Date.parse(el.getAttribute("datetime"));
      if (Number.isNaN(at)) continue;
      const s = Math.round((at - now) / 1000);
      const a = Math.abs(s);
      const text = a < 60 ? `${a} s` : a < 3600 ? `${Math.floor(a / 60)} min ${a % 60} s` : `${Math.floor(a / 3600)} h ${Math.floor((a % 3600) / 60)} min`;
      el.textContent = s >= 0 ? `in ${text}` : `${text} ago`;
    }
  }

  function bind(root) {
    // Confirmation for destructive forms (without JavaScript they submit directly).
    for (const form of root.querySelectorAll("form[data-confirm]")) {
      form.addEventListener("submit", (event) => {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    }
  }

  if (control && select) {
    control.hidden = false;
    select.value = localStorage.getItem(KEY) || "2";
    select.addEventListener("change", () => {
      localStorage.setItem(KEY, select.value);
      schedule();
    });
  }
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") tick();
    else { clearTimeout(timer); say("paused while hidden"); }
  });
  // The phone's Menu (a details element, which works without this): closed
  // by Escape or a tap elsewhere, as a menu is expected to be.
  const menu = document.querySelector("header.site details.menu");
  if (menu) {
    document.addEventListener("click", (event) => {
      if (menu.open && !menu.contains(event.target)) menu.open = false;
    });
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && menu.open) {
        menu.open = false;
        menu.querySelector("summary").focus();
      }
    });
  }
  bind(document);
  countdowns();
  setInterval(countdowns, 1000);
  schedule();
})();
