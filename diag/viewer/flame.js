// Interactive parts of a merged flame graph: hover details, click to zoom, search.
// Search takes a regular expression over frame labels, or `rank:5` / `rank:0-3/9` to light up
// every frame that those ranks reach. `?s=TERM` (or `#s=TERM`) searches on load and `?z=REGEX`
// zooms into the first frame whose label matches. A folded cell (`⋯ N frames`, frames that all
// its ranks share) opens into its frames on a click; `?x=REGEX` opens those holding a match.
"use strict";
(function () {
  var svg = document.documentElement;
  var NS = "http://www.w3.org/2000/svg";
  var META = JSON.parse(document.getElementById("flame-meta").textContent);
  var RANKS = META.ranks; // folded rank sets, indexed by a frame's data-r
  var frames = [];
  var details, matchedText, unzoomBtn, searchBtn;
  var parsedRanks = {};
  var searching = null;

  function byId(id) { return document.getElementById(id); }

  function label(g) {
    var t = g.querySelector("title");
    return t ? t.textContent.split("\n")[0] : "";
  }

  function labels(g) {
    // a folded cell answers for every frame it stands for
    var i = g.getAttribute("data-fold");
    if (i === null) return [label(g)];
    return META.folds[+i].map(function (f) { return f[1]; });
  }

  function cellText(g) {
    return g.getAttribute("data-s") || (g.querySelector("text") || {}).textContent || "";
  }

  function fitText(g, w) {
    var t = g.querySelector("text");
    if (!t) {
      t = document.createElementNS(NS, "text");
      g.appendChild(t);
    }
    var full = g._full;
    var n = Math.floor((w - 6) / META.charWidth);
    if (n < 3) { t.textContent = ""; return; }
    t.textContent = full.length <= n ? full : full.substring(0, n - 2) + "..";
  }

  function parseRanks(text) {
    // "0-5/7|..." -> [[0,5],[7,7]]; an abbreviated tail "...(+N)" is skipped.
    var out = [];
    text.split("|")[0].split(/[\/,\s]+/).forEach(function (part) {
      var m = /^(\d+)(?:-(\d+))?$/.exec(part);
      if (m) out.push([+m[1], m[2] === undefined ? +m[1] : +m[2]]);
    });
    return out;
  }

  function rankSet(i) {
    if (!(i in parsedRanks)) parsedRanks[i] = parseRanks(RANKS[i]);
    return parsedRanks[i];
  }

  function intersects(a, b) {
    var i = 0, j = 0;
    while (i < a.length && j < b.length) {
      if (a[i][1] < b[j][0]) i++;
      else if (b[j][1] < a[i][0]) j++;
      else return true;
    }
    return false;
  }

  function showDetails(g) {
    var title = g.querySelector("title").textContent.split("\n");
    details.textContent = title[0] + "  |  " + (title[1] || "");
  }

  function zoom(g) {
    var zx = g._x, zw = g._w, zy = g._y;
    var ratio = (META.width - 2 * META.pad) / zw;
    svg.classList.add("zoomed");
    unzoomBtn.classList.remove("hide");
    frames.forEach(function (e) {
      var r = e.querySelector("rect"), t = e.querySelector("text");
      var x, w;
      if (e._y > zy) {
        // below the clicked frame: keep its ancestors, spread over the whole width
        if (e._x <= zx + 1e-6 && e._x + e._w >= zx + zw - 1e-6) {
          e.classList.add("parent");
          e.classList.remove("hide");
          x = META.pad; w = META.width - 2 * META.pad;
        } else { e.classList.add("hide"); return; }
      } else if (e._x >= zx - 1e-6 && e._x + e._w <= zx + zw + 1e-6) {
        e.classList.remove("hide", "parent");
        x = META.pad + (e._x - zx) * ratio; w = e._w * ratio;
      } else { e.classList.add("hide"); return; }
      r.setAttribute("x", x.toFixed(2));
      r.setAttribute("width", w.toFixed(2));
      if (t) t.setAttribute("x", (x + 3).toFixed(2));
      fitText(e, w);
    });
  }

  function unzoom() {
    svg.classList.remove("zoomed");
    unzoomBtn.classList.add("hide");
    frames.forEach(function (e) {
      var r = e.querySelector("rect"), t = e.querySelector("text");
      e.classList.remove("hide", "parent");
      r.setAttribute("x", e._x.toFixed(2));
      r.setAttribute("width", e._w.toFixed(2));
      if (t) t.setAttribute("x", (e._x + 3).toFixed(2));
      fitText(e, e._w);
    });
  }

  function clearSearch() {
    frames.forEach(function (e) { e.classList.remove("match"); });
    matchedText.textContent = "";
    searchBtn.classList.remove("active");
    searching = null;
  }

  function search(term) {
    clearSearch();
    if (!term) return;
    var test;
    var m = /^\s*(?:rank|r)\s*[:=]\s*([\d\-\/, ]+)\s*$/i.exec(term);
    if (m) {
      var want = parseRanks(m[1]).sort(function (a, b) { return a[0] - b[0]; });
      test = function (e) { return intersects(rankSet(+e.getAttribute("data-r")), want); };
    } else {
      var re;
      try { re = new RegExp(term); } catch (err) { matchedText.textContent = "bad regex"; return; }
      test = function (e) { return labels(e).some(function (l) { return re.test(l); }); };
    }
    var spans = [];
    frames.forEach(function (e) {
      if (e.classList.contains("k-root")) return;
      if (test(e)) { e.classList.add("match"); spans.push([e._x, e._x + e._w]); }
    });
    searchBtn.classList.add("active");
    searching = term;
    if (m) {
      matchedText.textContent = spans.length ? "rank " + m[1].trim() + ": " + spans.length + " frames" : "No match";
      return;
    }
    spans.sort(function (a, b) { return a[0] - b[0]; });
    var covered = 0, end = -1;
    spans.forEach(function (s) {
      if (s[1] <= end) return;
      covered += s[1] - Math.max(s[0], end);
      end = s[1];
    });
    var pct = 100 * covered / (META.width - 2 * META.pad);
    matchedText.textContent = spans.length ? "Matched: " + pct.toFixed(1) + "% of the width" : "No match";
  }

  function moveY(e, dy) {
    e._y += dy;
    var r = e.querySelector("rect"), t = e.querySelector("text");
    r.setAttribute("y", e._y);
    if (t) t.setAttribute("y", +t.getAttribute("y") + dy);
  }

  function expand(g) {
    // A folded cell opens in place into its frames: the frames above it (its callees) stay
    // where they are, everything else moves down by the rows it gains.
    var fold = META.folds[+g.getAttribute("data-fold")];
    var fh = META.frameHeight, dy = (fold.length - 1) * fh, eps = 0.01;
    unzoom();
    frames.forEach(function (e) {
      var above = e._y < g._y - eps && e._x >= g._x - eps && e._x + e._w <= g._x + g._w + eps;
      if (e !== g && !above) moveY(e, dy);
    });
    ["details", "matched"].forEach(function (id) {
      var t = byId(id);
      t.setAttribute("y", +t.getAttribute("y") + dy);
    });
    var h = +svg.getAttribute("height") + dy;
    svg.setAttribute("height", h);
    svg.setAttribute("viewBox", "0 0 " + META.width + " " + h);
    document.querySelector("rect.bg").setAttribute("height", h);
    var tip = g.querySelector("title").textContent.split("\n").slice(1).join("\n");
    var at = frames.indexOf(g), made = [];
    fold.forEach(function (f, j) {
      var e = document.createElementNS(NS, "g");
      e.setAttribute("class", g.getAttribute("class").replace(/\bfold\b/, "").replace(/k-\w+/, "k-" + f[3]) + " unfolded");
      e.setAttribute("data-r", g.getAttribute("data-r"));
      var title = document.createElementNS(NS, "title");
      title.textContent = f[1] + "\n" + tip;
      var r = document.createElementNS(NS, "rect");
      var y = g._y + dy - j * fh;
      r.setAttribute("x", g._x.toFixed(2));
      r.setAttribute("y", y);
      r.setAttribute("width", g._w.toFixed(2));
      r.setAttribute("height", fh - 1);
      r.setAttribute("fill", f[2]);
      r.setAttribute("rx", "2");
      var t = document.createElementNS(NS, "text");
      t.setAttribute("x", (g._x + 3).toFixed(2));
      t.setAttribute("y", y + fh - 4.5);
      e.appendChild(title); e.appendChild(r); e.appendChild(t);
      e._x = g._x; e._w = g._w; e._y = y; e._full = f[0];
      fitText(e, e._w);
      g.parentNode.insertBefore(e, g);
      made.push(e);
    });
    g.parentNode.removeChild(g);
    frames.splice.apply(frames, [at, 1].concat(made));
    if (searching !== null) search(searching);
    return made;
  }

  function param(name) {
    var q = new RegExp("[?#&]" + name + "=([^&#]*)").exec(window.location.href);
    return q ? decodeURIComponent(q[1].replace(/\+/g, " ")) : null;
  }

  function init() {
    details = byId("details");
    matchedText = byId("matched");
    unzoomBtn = byId("unzoom");
    searchBtn = byId("search");
    var all = byId("frames").querySelectorAll("g.f");
    for (var i = 0; i < all.length; i++) {
      var g = all[i], r = g.querySelector("rect");
      g._x = +r.getAttribute("x");
      g._w = +r.getAttribute("width");
      g._y = +r.getAttribute("y");
      g._full = cellText(g);
      frames.push(g);
    }
    var holder = byId("frames");
    holder.addEventListener("mouseover", function (ev) {
      var g = ev.target.closest("g.f");
      if (g) showDetails(g);
    });
    holder.addEventListener("mouseout", function () { details.textContent = META.hint; });
    holder.addEventListener("click", function (ev) {
      var g = ev.target.closest("g.f");
      if (!g) return;
      if (g.classList.contains("k-root")) unzoom();
      else if (g.hasAttribute("data-fold")) expand(g);
      else zoom(g);
    });
    unzoomBtn.addEventListener("click", unzoom);
    searchBtn.addEventListener("click", function () {
      if (searching !== null) { clearSearch(); return; }
      var term = window.prompt("Search: a regular expression over frame labels, or rank:N", "");
      if (term) search(term);
    });
    window.addEventListener("keydown", function (ev) {
      if ((ev.ctrlKey || ev.metaKey) && ev.key === "f") {
        ev.preventDefault();
        var term = window.prompt("Search: a regular expression over frame labels, or rank:N", searching || "");
        if (term !== null) search(term);
      } else if (ev.key === "Escape") { clearSearch(); unzoom(); }
    });
    details.textContent = META.hint;
    var s = param("s");
    if (s) search(s);
    var x = param("x");
    if (x) {
      // expand the folded cells whose frames match
      var xre = new RegExp(x);
      frames.slice().forEach(function (e) {
        if (e.hasAttribute("data-fold") && labels(e).some(function (l) { return xre.test(l); })) expand(e);
      });
    }
    var z = param("z");
    if (z) {
      var re = new RegExp(z);
      for (var k = 0; k < frames.length; k++) {
        if (!frames[k].classList.contains("k-root") && re.test(label(frames[k]))) { zoom(frames[k]); break; }
      }
    }
    svg.setAttribute("data-ready", "1");
  }

  if (document.readyState === "loading") window.addEventListener("load", init); else init();
})();
