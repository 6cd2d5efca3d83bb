// Small progressive enhancements; every page works without this file.
"use strict";
document.addEventListener("change", (event) => {
  const target = event.target;
  // A select marked data-autosubmit submits its form (the tenant switcher).
  if (target instanceof HTMLSelectElement && target.hasAttribute("data-autosubmit")) {
    target.form.requestSubmit();
  }
  // A "select all" checkbox toggles every checkbox named by its data-select-all.
  if (target instanceof HTMLInputElement && target.dataset.selectAll) {
    document.querySelectorAll(`input[type=checkbox][name="${target.dataset.selectAll}"]`)
      .forEach((box) => { box.checked = target.checked; });
  }
});
document.documentElement.classList.add("js");

// Menu (narrow screens, where there is no sidebar): shows or hides the navigation and the
// account links; the page's CSS folds them only once this file has run.
document.addEventListener("click", (event) => {
  const button = event.target instanceof Element ? event.target.closest("[data-menu-toggle]") : null;
  if (!button) return;
  const open = button.getAttribute("aria-expanded") !== "true";
  button.setAttribute("aria-expanded", String(open));
  document.body.classList.toggle("menu-open", open);
});

// --- Configuration pages ----------------------------------------------------------
// An editor form marked data-dirty-guard: once one of its content fields changes, every button
// marked data-needs-saved is disabled and every data-unsaved-note shown, because the attachment
// and binding forms reload the page (Send test stays: it saves the edits first). Fields marked data-not-content (the sample variables, the
// test address) change nothing that is saved.
(() => {
  const markDirty = () => {
    document.querySelectorAll("[data-needs-saved]").forEach((button) => { button.disabled = true; });
    document.querySelectorAll("[data-unsaved-note]").forEach((note) => { note.hidden = false; });
  };
  document.addEventListener("input", (event) => {
    const field = event.target;
    if (!(field instanceof Element) || field.hasAttribute("data-not-content")) return;
    const form = field.closest("form[data-dirty-guard]");
    if (form) {
      form.dataset.dirty = "1";
      markDirty();
    }
  });
  // A fragment swapped in brings its buttons back enabled: not the ones that need saved content.
  document.addEventListener("htmx:afterSwap", () => {
    if (document.querySelector("form[data-dirty-guard][data-dirty]")) markDirty();
  });
})();

// A button marked data-copy copies the value of the field it names (a new API key).
document.addEventListener("click", (event) => {
  const button = event.target instanceof Element ? event.target.closest("[data-copy]") : null;
  const field = button ? document.getElementById(button.dataset.copy) : null;
  if (!field) return;
  field.select();
  if (navigator.clipboard) {
    navigator.clipboard.writeText(field.value).then(() => { button.textContent = "Copied"; });
  }
});

// A form that came back with errors: move focus to its summary (its links lead to the fields).
document.addEventListener("DOMContentLoaded", () => {
  const summary = document.querySelector("[data-focus-on-load]");
  if (summary instanceof HTMLElement) summary.focus();
});
