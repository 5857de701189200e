"""``gradbed report`` renders in a real browser: headless Chromium shows a non-blank page,
every embedded image decodes, at 1400 px every table fits its box, and a wheel event on the
interactive timeline narrows its visible time range. Runs on a real short run (``mininet``)
and on a synthetic sweep."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from analysis.cli import report_main
from analysis.report import regime, write_report
from tests.support import real_run
from tests.support.make_fake_run import fake_tcp_samples, make_fake_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Appended to a copy of the page (never to the report itself): once everything has loaded,
# write how many <img> decoded into the root element's data-imgcheck, which --dump-dom
# then shows.
CHECK_SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.documentElement.setAttribute('data-imgcheck', ok + '/' + imgs.length);
});
</script>"""

# The layout probe: once loaded, count the tables wider than their box (scrollWidth over the
# box's clientWidth), read the first timeline's visible range, send it a wheel event (zoom
# in about its middle), and after the chart has redrawn write both ranges into the root
# element's data-layout. The two probes can share a page, so one Chromium start does both.
LAYOUT_SCRIPT = """<script>
window.addEventListener('load', function () {
  setTimeout(function () {
    var tables = document.querySelectorAll('table'), wide = [];
    tables.forEach(function (t) {
      if (t.scrollWidth > t.parentElement.clientWidth)
        wide.push(t.scrollWidth + '>' + t.parentElement.clientWidth);
    });
    var el = document.querySelector('.gb-timeline');
    function range() { return +el.getAttribute('data-x-max') - +el.getAttribute('data-x-min'); }
    var before = range(), over = el.querySelector('.u-over'), r = over.getBoundingClientRect();
    over.dispatchEvent(new WheelEvent('wheel', {deltaY: -120, clientX: r.left + r.width / 2,
      clientY: r.top + r.height / 2, bubbles: true, cancelable: true}));
    setTimeout(function () {
      document.documentElement.setAttribute('data-layout', tables.length + ' ' + wide.length +
        ' ' + before + ' ' + range() + ' ' + wide.join(','));
    }, 100);
  }, 100);
});
</script>"""

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium not installed")


def _chromium(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    profile = tmp / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def probe(page: Path, tmp: Path, scripts: str, shot: Path | None = None) -> dict[str, str]:
    """The data-* attributes of the root element in Chromium's DOM dump of a copy of
    ``page`` with ``scripts`` appended, in a 1400 px wide window; ``shot``: the same
    Chromium start also writes a 1400x2000 screenshot there (after the probe's scripts ran:
    they only set attributes and zoom the timeline, so the page is as blank or not as the
    report itself). One start instead of two: each costs seconds."""
    copy = tmp / f"probe-{page.parent.name}.html"
    copy.write_text(page.read_text(encoding="utf-8").replace("</body>", scripts + "</body>"),
                    encoding="utf-8")
    extra = [f"--screenshot={shot}"] if shot else []
    proc = _chromium(["--dump-dom", *extra, "--window-size=1400,2000",
                      "--virtual-time-budget=10000", copy.as_uri()], tmp)
    root = re.search(r"<html[^>]*>", proc.stdout)
    attrs = dict(re.findall(r'(data-[a-z]+)="([^"]*)"', root.group(0) if root else ""))
    assert attrs, (f"no probe result in Chromium's DOM dump:\n{proc.stdout[:500]}\n"
                   f"{proc.stderr[-2000:]}")
    assert shot is None or shot.exists(), f"Chromium wrote no screenshot:\n{proc.stderr[-2000:]}"
    return attrs


def _images(attrs: dict[str, str]) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", attrs.get("data-imgcheck", ""))
    assert m, f"no image count in {attrs}"
    return int(m.group(1)), int(m.group(2))


def _layout(attrs: dict[str, str]) -> tuple[int, int, float, float]:
    m = re.fullmatch(r"(\d+) (\d+) (\S+) (\S+) ?(.*)", attrs.get("data-layout", ""))
    assert m, f"no layout in {attrs}"
    return int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))


def images_loaded(page: Path, tmp: Path) -> tuple[int, int]:
    """(decoded, total) <img> elements of ``page`` as Chromium sees them."""
    return _images(probe(page, tmp, CHECK_SCRIPT))


def layout(page: Path, tmp: Path) -> tuple[int, int, float, float]:
    """(tables, tables wider than their box, visible seconds of the timeline before and
    after one wheel event) of ``page`` in a 1400 px wide Chromium window."""
    return _layout(probe(page, tmp, LAYOUT_SCRIPT))


def _check_layout(values: tuple[int, int, float, float]) -> None:
    tables, wide, before, after = values
    assert tables >= 3 and wide == 0
    assert 0 < after < 0.9 * before, (before, after)


def screenshot_std(shot: Path) -> float:
    """Pixel standard deviation of a screenshot (0 for a blank page)."""
    return float(np.asarray(imread(shot))[..., :3].std())


def _check_page(page: Path, tmp: Path, min_images: int, with_layout: bool = False) -> None:
    """Every image decodes, the page is not blank and, ``with_layout``, its tables fit and
    its timeline zooms (the probes and the screenshot share one Chromium start)."""
    html = page.read_text(encoding="utf-8")
    n_img = html.count("<img ")
    assert n_img >= min_images
    assert "src=\"http" not in html and "src='http" not in html  # self-contained
    shot = tmp / f"shot-{page.parent.name}.png"
    attrs = probe(page, tmp, CHECK_SCRIPT + (LAYOUT_SCRIPT if with_layout else ""), shot)
    assert _images(attrs) == (n_img, n_img)
    if with_layout:
        _check_layout(_layout(attrs))
    assert screenshot_std(shot) > 0.05


@pytest.fixture(scope="session")
def real_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_run.real_run(tmp_path_factory.mktemp("real"))


@pytest.mark.mininet
def test_report_of_a_real_run_renders_in_chromium(real_run_dir: Path, tmp_path: Path) -> None:
    assert report_main([str(real_run_dir), "--out", str(tmp_path / "rep")]) == 0
    page = tmp_path / "rep" / "index.html"
    _check_page(page, tmp_path, min_images=5, with_layout=True)


def test_report_of_a_synthetic_sweep_renders_in_chromium(tmp_path: Path) -> None:
    runs = [make_fake_run(tmp_path / "sweep" / "topk-100", compressor="topk", seed=1),
            make_fake_run(tmp_path / "sweep" / "dense-50", compressor="none", rate_mbps=50.0,
                          adaptive=False, seed=2)]
    page = write_report(runs, tmp_path / "rep")
    html = page.read_text(encoding="utf-8")
    assert "topk-100" in html and "dense-50" in html and "compress.name" in html
    assert not list(page.parent.glob("*.tmp"))  # atomic write leaves no temporary behind
    _check_page(page, tmp_path, min_images=10, with_layout=True)
    html_text = page.read_text(encoding="utf-8")
    assert "uPlot" in html_text and "<script src" not in html_text  # inlined, not fetched


def test_a_wide_overview_wraps_to_the_page_and_the_checks_can_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not transposed (as for a sweep of many runs), the overview's many columns wrap. The
    probe can fail: with cells that may not wrap the table runs off the page, and without
    its wheel handler the timeline's range stays put."""
    from analysis import report

    monkeypatch.setattr(report, "TRANSPOSE_MAX_RUNS", 1)
    runs = [make_fake_run(tmp_path / "sweep" / f"run-{i}", seed=i, iterations=5,
                          rate_mbps=50.0 * (i + 1), keep=0.05 * (i + 1)) for i in range(2)]
    page = write_report(runs, tmp_path / "rep")
    html_text = page.read_text(encoding="utf-8")
    assert html_text.count("<th>") > 20  # one column per number
    _check_layout(layout(page, tmp_path))
    broken = tmp_path / "broken" / "index.html"
    broken.parent.mkdir()
    broken.write_text(html_text.replace("overflow-wrap: anywhere;", "white-space: nowrap;")
                      .replace(".table-box { overflow-x: auto;", ".table-box {")
                      .replace('u.over.addEventListener("wheel"', 'u.over.addEventListener("x"'),
                      encoding="utf-8")
    tables, wide, before, after = layout(broken, tmp_path)
    assert wide > 0 and after == before > 0


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A short synthetic run of two workers and its report page, written once: the image
    check reads a broken copy of the page, the torchrun test a copy of the run."""
    tmp = tmp_path_factory.mktemp("small")
    run = make_fake_run(tmp / "run", workers=2, iterations=4)
    return run, write_report([run], tmp / "rep")


def test_image_check_detects_a_broken_image(small_run: tuple[Path, Path], tmp_path: Path
                                            ) -> None:
    """The image check itself can fail: a corrupt data URI is reported as not decoded."""
    html = small_run[1].read_text(encoding="utf-8")
    broken = tmp_path / "broken" / "index.html"
    broken.parent.mkdir()
    broken.write_text(html.replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAA",
                                   1), encoding="utf-8")
    ok, total = images_loaded(broken, tmp_path)
    assert total == html.count("<img ") and ok == total - 1


def test_report_default_out_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    run = make_fake_run(tmp_path / "run", iterations=4, jsonl_only=True)  # interrupted run
    assert report_main([str(run)]) == 0
    assert (run / "report" / "index.html").exists()
    assert capsys.readouterr().out.strip() == str(run / "report" / "index.html")
    assert report_main([str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_report_of_a_run_killed_before_its_first_iteration(tmp_path: Path) -> None:
    run = make_fake_run(tmp_path / "run", iterations=0, jsonl_only=True)
    page = write_report([run], tmp_path / "rep")
    html = page.read_text(encoding="utf-8")
    assert html.count("<img ") >= 4 and "Run run" in html


def test_a_torchrun_runs_connections_get_a_plot_and_its_hosts_a_table(
        small_run: tuple[Path, Path], tmp_path: Path) -> None:
    """tcp.parquet (a ``gradbed torchrun`` run's sock_diag samples) adds one plot of the
    connections between hosts, and summary.json's torchrun section a table of each host's
    ranks, exit codes and bytes and one of each shaping point's busy fraction; a run
    without them (``small_run``, of which this is a copy) has none."""
    without = small_run[1].read_text(encoding="utf-8")
    run = Path(shutil.copytree(small_run[0], tmp_path / "run"))
    base = int(pd.read_parquet(next((run / "events").glob("*.parquet")))["ts_ns"].min())
    fake_tcp_samples(base).to_parquet(run / "tcp.parquet", index=False)
    summary = json.loads((run / "summary.json").read_text())
    summary["torchrun"] = fake_torchrun_section()
    summary["agent_limited"], summary["agent_limited_why"] = True, TORCHRUN_LIMITED_WHY
    (run / "summary.json").write_text(json.dumps(summary))
    page = write_report([run], tmp_path / "with")
    html = page.read_text(encoding="utf-8")
    # The regime names the script's ranks, not gradbed's agents, as what the times measure.
    assert "<b>Agent-limited run.</b> agent-limited: the gbh0.up link" in html
    assert "describe the script&#x27;s ranks (its compute and gloo) on this machine" in html
    caption = "TCP connections between hosts (tcp.parquet"
    assert caption in html and caption not in without
    assert html.count("<img ") == without.count("<img ") + 1
    heading = "Hosts of the torchrun run: ranks, exit codes and bytes"
    assert heading in html and heading not in without
    hosts = first_table(html.split(heading)[1])
    assert [h["host"] for h in hosts] == ["gbh0", "gbh1"]
    assert [h["exit_codes"] for h in hosts] == ["0:0, 1:0", "2:3, 3:running"]
    assert [int(h["payload_sent_bytes"]) for h in hosts] == [6_000_123, 40]
    assert [int(h["interface_tx_bytes"]) for h in hosts] == [6_300_000, 9_000]
    points = first_table(html.split("Shaping points: busy fraction")[1])
    assert points == [{"point": "gbh1.up", "busy_utilization": "0.8123"}]
    _check_page(page, tmp_path, min_images=without.count("<img ") + 1)


#: A torchrun run's agent_limited_why (controller.summary.torchrun_agent_limited's words).
TORCHRUN_LIMITED_WHY = (
    "agent-limited: the gbh0.up link was busy 0.04 of the transfer windows (< 0.9) with no "
    "queue at the shaper (median backlog 0 B): data waited in the ranks, not in the "
    "network, so the times measure the script and gloo on this machine; the windows: the "
    "ranks' DDP buckets (gradbed.ddp.instrument)")


@pytest.mark.parametrize(("config", "who"), [
    ({"topo": {"shape": "star"}}, "gradbed&#x27;s agents (the workers and the PS)"),
    ({"pipeline": {"stages": 2}, "topo": {"role": "stage"}}, "gradbed&#x27;s pipeline stages"),
    ({"topo": {"role": "expert"}}, "gradbed&#x27;s MoE expert hosts"),
])
def test_the_regime_says_whose_time_an_agent_limited_run_measures(config: dict, who: str
                                                                  ) -> None:
    """The report's regime sentence for a PS, a pipeline and an MoE run: the summary's
    reason, then who held the data; a network-limited run gets the reason only, and a
    summary without one (an older run) nothing."""
    why = "agent-limited: the links (gbh0.up, gbh1.up) were busy 0.01 of the transfer windows"
    limited = regime({"agent_limited": True, "agent_limited_why": why}, config)
    assert limited.startswith('<p class="warning"><b>Agent-limited run.</b> agent-limited:')
    assert f"describe {who} on this machine, not the emulated network" in limited
    calm = regime({"agent_limited": False, "agent_limited_why": "network-limited: busy 0.97"},
                  config)
    assert calm == '<p class="meta">Regime: network-limited: busy 0.97.</p>'
    assert regime({"agent_limited": None}, config) == ""


def first_table(page: str) -> list[dict[str, str]]:
    """The rows of the first <table> in ``page``, as {header: cell text}."""
    table = page[page.index("<table"):page.index("</table>")]

    def cells(row: str) -> list[str]:
        return [re.sub(r"<[^>]+>", "", c).strip()
                for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]

    rows = [cells(r) for r in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)]
    return [dict(zip(rows[0], r, strict=True)) for r in rows[1:]]


def fake_torchrun_section() -> dict:
    """summary.json's torchrun section of a 2-host run, 2 ranks per host (as
    ``controller.torchrun.experiment`` writes it)."""
    hosts = {"gbh0": {"ip": "10.0.0.10", "node_rank": 0, "ranks": [0, 1]},
             "gbh1": {"ip": "10.0.0.11", "node_rank": 1, "ranks": [2, 3]}}
    per = {"payload_sent_bytes": [6_000_123, 40], "payload_received_bytes": [6_000_000, 70],
           "store_sent_bytes": [1_000, 40], "local_bytes": [0, 123_456],
           "connections": [3, 1], "interface_rx_bytes": [6_200_000, 8_000],
           "interface_tx_bytes": [6_300_000, 9_000], "interface_over_payload": [1.05, 225.0],
           "allreduce_equivalent_bytes": [4_000_082, 27]}
    return {"hosts": hosts, "exit_codes": {"0": 0, "1": 0, "2": 3, "3": None},
            "bytes": {k: dict(zip(hosts, v, strict=True)) for k, v in per.items()},
            "points_busy_utilization": {"gbh1.up": 0.8123}}
