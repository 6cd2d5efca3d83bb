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
