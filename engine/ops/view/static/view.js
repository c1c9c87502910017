// rollout view: link timeline spans to their samples, show a span's sample on hover, and keep
// a live page current: poll its stamp and, when it changes, swap in the page's new <main>.
"use strict";
(function () {
  var tip = document.createElement("div");
  tip.id = "tip";
  document.addEventListener("DOMContentLoaded", function () { document.body.appendChild(tip); });

  function rolloutPath() {
    var m = location.pathname.match(/^\/r\/[^/]+/);
    return m ? m[0] : null;
  }
  document.addEventListener("click", function (ev) {
    var span = ev.target.closest && ev.target.closest("rect[data-s]");
    var base = rolloutPath();
    if (span && base) {
      location.href = base + "/s/" + encodeURIComponent(span.getAttribute("data-s"));
    }
  });
  document.addEventListener("mouseover", function (ev) {
    var span = ev.target.closest && ev.target.closest("rect[data-s]");
    if (!span) { tip.style.display = "none"; return; }
    tip.textContent = span.getAttribute("data-s") + " attempt " + span.getAttribute("data-a") +
      " (" + span.getAttribute("class") + ")";
    tip.style.left = (ev.clientX + 12) + "px";
    tip.style.top = (ev.clientY + 12) + "px";
    tip.style.display = "block";
  });

  function poll() {
    var main = document.querySelector("main[data-live]");
    if (!main) { return; }
    fetch(main.getAttribute("data-live"), { cache: "no-store" })
      .then(function (r) { return r.json(); })
      .then(function (body) {
        if (body.stamp === main.getAttribute("data-stamp")) { return null; }
        return fetch(location.href, { cache: "no-store" }).then(function (r) { return r.text(); });
      })
      .then(function (text) {
        if (!text) { return; }
        var fresh = new DOMParser().parseFromString(text, "text/html").querySelector("main");
        if (fresh) {
          main.replaceWith(fresh);
          document.body.setAttribute("data-updates",
            String(Number(document.body.getAttribute("data-updates") || "0") + 1));
        }
      })
      .catch(function () { /* the server is gone or busy: try again at the next tick */ })
      .then(function () { setTimeout(poll, 1000); });
  }
  setTimeout(poll, 1000);
})();
