/* The report's interactive per-host timeline: a Gantt chart drawn on a uPlot chart
 * (analysis/vendor/uplot). Each <div class="gb-timeline" data-src="ID"> is filled from the JSON
 * in <script type="application/json" id="ID">: rows (host and lane, top to bottom),
 * cats and colors (one per category), labels, and spans [row, cat, label, start_s, end_s].
 *
 * Wheel: zoom about the pointer. Drag: zoom to the selection. Shift+wheel or the arrow
 * buttons: pan. Double-click: the whole run. The visible range is kept in the container's
 * data-x-min / data-x-max (seconds), which the report's browser test reads. */
(function () {
  "use strict";
  var ROW_PX = 26;

  function fmt(s) {
    var a = Math.abs(s);
    return a >= 1 ? s.toFixed(3) + " s" : a >= 1e-3 ? (s * 1e3).toFixed(2) + " ms"
      : (s * 1e6).toFixed(1) + " µs";
  }

  function drawSpans(d) {
    return function (u) {
      var ctx = u.ctx, xmin = u.scales.x.min, xmax = u.scales.x.max;
      var h = Math.max(1, Math.abs(u.valToPos(0.38, "y", true) - u.valToPos(0, "y", true)));
      ctx.save();
      ctx.beginPath();
      ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
      ctx.clip();
      for (var i = 0; i < d.spans.length; i++) {
        var s = d.spans[i];
        if (s[4] < xmin || s[3] > xmax) continue;
        var x0 = u.valToPos(s[3], "x", true), x1 = u.valToPos(s[4], "x", true);
        var yc = u.valToPos(d.rows.length - 1 - s[0], "y", true);
        ctx.fillStyle = d.colors[s[1]];
        ctx.fillRect(x0, yc - h, Math.max(1, x1 - x0), 2 * h);
      }
      ctx.restore();
    };
  }

  function spanAt(d, u, left, top) {
    if (left < 0) return null;
    var t = u.posToVal(left, "x"), row = d.rows.length - 1 - Math.round(u.posToVal(top, "y"));
    for (var i = 0; i < d.spans.length; i++) {
      var s = d.spans[i];
      if (s[0] === row && s[3] <= t && t <= s[4]) return s;
    }
    return null;
  }

  function legend(el, d) {
    var box = document.createElement("div");
    box.className = "gb-legend";
    d.cats.forEach(function (c, i) {
      var item = document.createElement("span");
      var sw = document.createElement("i");
      sw.style.background = d.colors[i];
      item.appendChild(sw);
      item.appendChild(document.createTextNode(c));
      box.appendChild(item);
    });
    el.appendChild(box);
  }

  function build(el) {
    var d = JSON.parse(document.getElementById(el.getAttribute("data-src")).textContent);
    var t0 = d.t_min, t1 = d.t_max > d.t_min ? d.t_max : d.t_min + 1;
    var info = document.createElement("div");
    info.className = "gb-info";
    info.textContent = "wheel: zoom · drag: zoom to selection · shift+wheel: pan · " +
      "double-click: whole run";
    el.appendChild(info);
    var plotBox = document.createElement("div");
    el.appendChild(plotBox);
    legend(el, d);
    function mark(u) {
      el.setAttribute("data-x-min", String(u.scales.x.min));
      el.setAttribute("data-x-max", String(u.scales.x.max));
    }
    var opts = {
      width: Math.max(300, el.clientWidth), height: 60 + ROW_PX * d.rows.length,
      legend: {show: false},
      cursor: {y: false, drag: {x: true, y: false}},
      scales: {x: {time: false, range: function (u, lo, hi) { return [lo, hi]; }},
               y: {range: [-0.5, d.rows.length - 0.5]}},
      axes: [{label: "time since run start (s)", size: 40},
             {size: d.label_px, gap: 4, splits: function () {
               return d.rows.map(function (_, i) { return i; });
             }, values: function (u, splits) {
               return splits.map(function (v) { return d.rows[d.rows.length - 1 - v] || ""; });
             }, grid: {show: false}}],
      series: [{}, {show: false}],
      hooks: {
        draw: [drawSpans(d)],
        setScale: [function (u, key) { if (key === "x") mark(u); }],
        setCursor: [function (u) {
          var s = spanAt(d, u, u.cursor.left, u.cursor.top);
          info.textContent = s ? d.rows[s[0]] + ": " + d.labels[s[2]] + " (" + d.cats[s[1]] +
            "), " + fmt(s[4] - s[3]) + " from " + fmt(s[3]) : info.textContent;
        }]
      }
    };
    var u = new uPlot(opts, [[t0, t1], [null, null]], plotBox);
    u.over.addEventListener("wheel", function (e) {
      e.preventDefault();
      var lo = u.scales.x.min, hi = u.scales.x.max, span = hi - lo;
      if (e.shiftKey) {
        var shift = span * 0.1 * Math.sign(e.deltaY || e.deltaX);
        u.setScale("x", {min: lo + shift, max: hi + shift});
        return;
      }
      var rect = u.over.getBoundingClientRect();
      var frac = Math.min(1, Math.max(0, (e.clientX - rect.left) / rect.width));
      var at = lo + frac * span, k = e.deltaY < 0 ? 0.75 : 1 / 0.75;
      var nspan = Math.min(t1 - t0, Math.max(1e-6, span * k));
      var nlo = Math.max(t0, Math.min(at - frac * nspan, t1 - nspan));
      u.setScale("x", {min: nlo, max: nlo + nspan});
    }, {passive: false});
    u.over.addEventListener("dblclick", function () { u.setScale("x", {min: t0, max: t1}); });
    window.addEventListener("resize", function () {
      u.setSize({width: Math.max(300, el.clientWidth), height: u.height});
    });
    mark(u);
    (window.gradbedTimelines = window.gradbedTimelines || []).push(u);
  }

  function init() {
    var els = document.querySelectorAll(".gb-timeline");
    for (var i = 0; i < els.length; i++) build(els[i]);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
