"""MoE benchmark (DESIGN.md 1.4 and 5): all-to-all dispatch efficiency over the fabric,
drops and imbalance against the capacity factor, Belady against LRU offload.

1. ``dispatch``: ``gradbed run configs/moe.toml`` (4 expert hosts on the fabric, real
   Mininet, real TCP, access links shaped both ways) at 10, 100 and 1000 Mbit/s per
   access link, 2 MoE layers of 16 experts (4 per host), top-2, d_model 128, Fashion-MNIST.
   Per step and layer: :func:`agents.core.moe_metrics.dispatch_efficiency`, the token
   payload through the busiest link over the whole dispatch (last host entering the
   counts phase to the last host finishing the tokens phase; the spread of arrivals
   before it is reported beside it). Headline: the median at
   100 Mbit/s over layers and steps after the first (TCP slow start, first-touch
   allocations). Target >= 0.9.
   Beside it, the same windows measured by the links: every access point's HTB class
   counters are read every 2 ms over rtnetlink (``topo.class_sample_ms``,
   ``classes.parquet``), and :func:`agents.core.moe_metrics.dispatch_link_efficiency`
   is the busiest point's bytes over the window / (phase x rate). A link idle before a
   dispatch drains its HTB bucket (``burst`` bytes) on top of rate x time, which puts
   that figure above 1 (``configs/moe.toml`` keeps the bucket to 2 ms at the rate,
   ``topo.access_burst_ms``, so it adds at most 2 ms of line rate to a phase); the bound that allows for it counts a full bucket as
   capacity and takes the bytes between the samples just inside each window (no
   interpolation), ``link_efficiency_burst_allowed_inner_median``: a lower bound on the
   link's utilisation, printed beside the headline (the issue's formula,
   ``efficiency_median`` at 100 Mbit/s). The raw tc figure is ``link_efficiency_median``.
2. ``capacity``: one process, 4 routing groups (as 4 hosts), 40 training steps per
   capacity factor in {0.5, 0.75, 1.0, 1.25, 1.5, 2.0}: drop fraction, load imbalance
   (max/mean tokens per expert) of the kept tokens and of all routed token choices
   (kept + dropped, the demand), and loss over the last 10 steps.
3. ``offload_training``: the 100 Mbit/s run again with the experts offloaded in the
   training loop (``moe.offload_budget_bytes`` = 4 of a host's 8 experts, Belady):
   transfers and bytes per host from its ``moe_offload`` events, the pure policy's count
   for the logged use order beside them, and whether the losses equal the plain run's.
4. ``offload``: expert host 0's recorded use order of its experts in the 100 Mbit/s run
   (forward, then backward reversed; each step's order as it happened), replayed through
   :class:`agents.moe.offload.Offloader` (real tensor copies; CPU here, so the budget is
   counted, not a device's memory) at budgets of 2, 4 and 6 of its 8 experts: transfers
   and bytes moved by Belady and by LRU.

5. ``linerate`` (docs/linerate.md): the dispatch at 1 and 10 Gbit/s with the CPU each
   process used (``/proc``, ``perf stat``) and the load average, and beside it, on the
   same fabric at the same rate, iperf3 with one flow per host (host i to host i+1) and
   gloo's ``all_to_all_single`` of 40 MB per host (``gradbed torchrun``,
   examples/torchrun_ddp/all_to_all.py) measured by the dispatch's own link formula over
   the same 2 ms class samples; gradbed's figure over each peer's is reported beside it.
   Each rate runs twice: the benchmark's model (its figures at the rate's top level) and
   ``WIDE``, a dispatch sized for data-centre rates (``wide``: 11 MB to a host's peers
   per dispatch against the model's 0.65 MB).

Plots go to ``docs/moe/``. Run as root: ``python benchmarks/moe.py [--part ...]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import REPO, emit, failed_run_logs, log, run_child

CONFIG = REPO / "configs" / "moe.toml"
PLOTS = REPO / "docs" / "moe"
RATES_MBPS = (10.0, 100.0, 1000.0)
STEPS = {10.0: 6, 100.0: 12, 1000.0: 12, 10000.0: 12}
MODEL = ["moe.layers=2", "moe.experts=16", "moe.d_model=128", "moe.d_hidden=128",
         "moe.top_k=2", "moe.capacity_factor=1.25", "moe.eval_every=1000"]
# The linerate part's second sizing, a dispatch sized for the rate: 4x wider tokens and
# 4x the images per host (128 x 28 tokens, top-2, 512 float32 each: 14.7 MB a host routes
# per dispatch, 11 MB of it to its 3 peers, 88 ms of a 1 Gbit/s link) where the 100 Mbit/s
# model's 0.65 MB last 5 ms, less than a dispatch's fixed costs (a round of frames and
# wake-ups on every host).
WIDE = ("moe.d_model=512", "moe.d_hidden=512", "workload.batch_size=128")
CLASS_SAMPLE_MS = 2.0  # every access point's HTB class read this often (classes.parquet)
EXPERT_BYTES = 4 * (128 * 128 * 2 + 128 + 128)  # one expert: fc1 and fc2, weights and biases
CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
# The capacity part's one-process training: configs/moe.toml's [workload] batch, lr, momentum.
MOE_BATCH_SIZE, MOE_LR, MOE_MOMENTUM = 32, 0.05, 0.9


def access_burst_ms() -> float | None:
    """The access links' HTB bucket the runs use (``topo.access_burst_ms`` of CONFIG;
    None = gradbed's default)."""
    from agents.core import config as cfgmod

    return cfgmod.load(CONFIG).topo.access_burst_ms or None


def run_fabric(rate_mbps: float, out: Path, extra: tuple[str, ...] = ()) -> Path:
    argv = [sys.executable, "-m", "controller.cli", "run", str(CONFIG), "--no-progress",
            "--out", str(out), "--set", f'run.name="moe{int(rate_mbps)}"',
            "--set", f"net.worker_link_mbps={rate_mbps}",
            "--set", f"run.iterations={STEPS[rate_mbps]}",
            "--set", f"topo.class_sample_ms={CLASS_SAMPLE_MS}"]
    for o in (*MODEL, *extra):
        argv += ["--set", o]
    t0 = time.monotonic()
    res = run_child(argv, cwd=REPO, timeout_s=900)
    if res.returncode != 0:
        raise RuntimeError(f"gradbed run at {rate_mbps} Mbit/s failed:\n"
                           f"{res.stderr[-3000:]}{failed_run_logs(res)}")
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    log(f"{rate_mbps:g} Mbit/s: {run_dir} ({time.monotonic() - t0:.0f} s)")
    return run_dir


def part_dispatch(out: Path) -> dict[str, Any]:
    from agents.core.ethernet import TCP_GOODPUT_FRACTION
    from analysis import moe as amoe
    from topo import qdisc

    res: dict[str, Any] = {}
    for rate in RATES_MBPS:
        run_dir = run_fabric(rate, out)
        rows = amoe.load_events(run_dir)
        disp = [d for d in amoe.dispatch_table(rows, rate) if d["iter"] >= 1]
        route = amoe.route_table(rows)
        eff = [d["efficiency"] for d in disp]
        # Each shaped point is an HTB class with a token bucket of `burst` bytes
        # (topo.access_burst_ms of configs/moe.toml): a link idle before the dispatch may
        # pass that much at line rate, on top of rate x time.
        # payload / (phase x rate x goodput + burst) is the bound that allows for it.
        burst = qdisc.htb_burst_bytes(rate, False, access_burst_ms())
        eff_burst = [d["payload_bytes"] / (d["phase_s"] * rate * 1e6 / 8 * TCP_GOODPUT_FRACTION
                                           + burst) for d in disp]
        util = [d["utilisation"] for d in disp]
        # The same windows measured by the links themselves: the busiest access point's
        # HTB class bytes over the dispatch, from the 2 ms class samples.
        samples = amoe.load_class_samples(run_dir)
        if samples is None:
            raise RuntimeError(f"{run_dir}: no classes.parquet (topo.class_sample_ms)")
        link = amoe.dispatch_link_table(disp, samples, rate, burst)
        link_eff = [d["link_efficiency"] for d in link]
        spacing = samples.sort_values("ts_ns").groupby("point")["ts_ns"].diff().dropna() / 1e6
        res[f"{rate:g}"] = {
            "link_efficiency_median": statistics.median(link_eff),
            "link_efficiency_min": min(link_eff), "link_efficiency_max": max(link_eff),
            "link_efficiency_burst_allowed_median": statistics.median(
                d["link_efficiency_burst_allowed"] for d in link),
            "link_efficiency_burst_allowed_inner_median": statistics.median(
                d["link_efficiency_burst_allowed_inner"] for d in link),
            "link_efficiency_burst_allowed_inner_min": min(
                d["link_efficiency_burst_allowed_inner"] for d in link),
            "link_bytes_median": statistics.median(d["link_bytes"] for d in link),
            "link_data_bytes_median": statistics.median(d["link_data_bytes"] for d in link),
            # Windows whose ends both had a sample within 3 ms on each side (the sampler
            # shares 2 cores with 4 training hosts and sometimes stalls).
            "well_sampled": int(sum(d["sample_gap_ms"] <= 3.0 for d in link)),
            "link_efficiency_well_sampled_median": statistics.median(
                [d["link_efficiency"] for d in link if d["sample_gap_ms"] <= 3.0]
                or [float("nan")]),
            "link_efficiency_burst_allowed_well_sampled_median": statistics.median(
                [d["link_efficiency_burst_allowed"] for d in link if d["sample_gap_ms"] <= 3.0]
                or [float("nan")]),
            "busiest_points": sorted({d["busiest_point"] for d in link}),
            "sample_spacing_ms_median": float(spacing.median()),
            "sample_spacing_ms_p99": float(spacing.quantile(0.99)),
            "sample_gap_at_edges_ms_max": max(d["sample_gap_ms"] for d in link),
            "run_dir": str(run_dir), "samples": len(eff),
            "efficiency_median": statistics.median(eff), "efficiency_min": min(eff),
            "efficiency_max": max(eff), "utilisation_median": statistics.median(util),
            "htb_burst_bytes": burst, "htb_burst_ms": access_burst_ms(),
            "efficiency_burst_allowed_median": statistics.median(eff_burst),
            "efficiency_burst_allowed_min": min(eff_burst),
            "counts_s_median": statistics.median(d["counts_s"] for d in disp),
            "counts_window_s_median": statistics.median(d["counts_window_s"] for d in disp),
            "combine_hosts_in_window_mean": statistics.mean(
                d["combine_hosts_in_window"] for d in disp),
            "tokens_s_median": statistics.median(d["tokens_s"] for d in disp),
            "phase_s_median": statistics.median(d["phase_s"] for d in disp),
            "arrival_spread_s_median": statistics.median(d["arrival_spread_s"] for d in disp),
            "payload_bytes_median": statistics.median(d["payload_bytes"] for d in disp),
            "imbalance_mean": statistics.mean(r["imbalance"] for r in route),
            "drop_fraction_mean": statistics.mean(r["drop_fraction"] for r in route),
            "loss_first_last": [r["ce"] for r in rows if r.get("event") == "moe_step"
                                and r["node"] == "e0"][::max(1, STEPS[rate] - 1)],
        }
        log(f"  efficiency median {res[f'{rate:g}']['efficiency_median']:.3f} (formula), "
            f"{res[f'{rate:g}']['link_efficiency_median']:.3f} (tc class samples)")
        if rate == 100.0:
            amoe.plot_timeline(rows, PLOTS / "timeline_100mbit.png", (2, 4))
            amoe.plot_routing(route, PLOTS / "routing_100mbit.png")
            res["run_100"] = str(run_dir)
            res["trace_e0"] = [r["expert_uses"] for r in sorted(
                (r for r in rows if r.get("event") == "moe_step" and r["node"] == "e0"),
                key=lambda r: r["iter"])]
    return res


def part_linerate(out: Path, rates_mbps: tuple[float, ...] = (1000.0, 10000.0)
                  ) -> dict[str, Any]:
    """The dispatch at data-centre rates beside its peers on the same links (docstring 5):
    the benchmark's model and the :data:`WIDE` sizing, then iperf3 and gloo."""
    from _linerate import gloo_all_to_all_peer, iperf3_peer

    res: dict[str, Any] = {}
    for rate in rates_mbps:
        runs = {"model": _linerate_run(rate, out, ()),
                "wide": _linerate_run(rate, out, (*WIDE, f'run.name="moe{int(rate)}-wide"'))}
        ip = iperf3_peer(CONFIG, [f"net.worker_link_mbps={rate}", *MODEL])
        try:
            gl = gloo_all_to_all_peer(CONFIG, [f"net.worker_link_mbps={rate}"], out)
        except (RuntimeError, OSError, KeyError, ValueError, StopIteration) as e:
            # gradbed's figure and iperf3's stand without it; the miss is said, not hidden.
            log(f"gloo all_to_all at {rate:g} Mbit/s failed: {e}")
            gl = {"efficiency": float("nan"), "link_efficiency": None, "error": str(e)}
        for name, r in runs.items():
            r["gradbed_over_iperf3"] = r["link_efficiency_median"] / ip["busy"]
            r["gradbed_over_gloo"] = r["link_efficiency_median"] / gl["link_efficiency"] \
                if gl.get("link_efficiency") else None
            r["gradbed_over_gloo_payload"] = r["efficiency_median"] / gl["efficiency"]
            log(f"{rate:g} Mbit/s, {name}: dispatch efficiency {r['efficiency_median']:.3f} "
                f"(link {r['link_efficiency_median']:.3f}), iperf3 {ip['busy']:.3f}, gloo "
                f"all_to_all {gl['efficiency']:.3f} (link "
                f"{gl.get('link_efficiency') or float('nan'):.3f})")
        res[f"{rate:g}"] = {**runs["model"], "wide": runs["wide"], "wide_sets": list(WIDE),
                            "iperf3": ip, "gloo_all_to_all": gl}
    return res


def _linerate_run(rate: float, out: Path, extra: tuple[str, ...]) -> dict[str, Any]:
    """One gradbed MoE run at ``rate`` with its CPU per process: the dispatch's payload
    and link efficiency (medians over the steps after the first)."""
    from _linerate import ProcSampler

    from analysis import moe as amoe

    procs = ProcSampler(str(out))
    procs.start()
    run_dir = run_fabric(rate, out, extra)
    cpu = procs.result()
    rows = amoe.load_events(run_dir)
    disp = [d for d in amoe.dispatch_table(rows, rate) if d["iter"] >= 1]
    samples = amoe.load_class_samples(run_dir)
    link = amoe.dispatch_link_table(disp, samples, rate) if samples is not None else []
    r = {"efficiency_median": statistics.median(d["efficiency"] for d in disp),
         "link_efficiency_median": statistics.median(d["link_efficiency"] for d in link)
         if link else float("nan"),
         "phase_s_median": statistics.median(d["phase_s"] for d in disp),
         "payload_bytes_median": statistics.median(d["payload_bytes"] for d in disp),
         "run_dir": str(run_dir), "cpu": cpu}
    log(f"{rate:g} Mbit/s {' '.join(extra) or 'model'}: dispatch efficiency median "
        f"{r['efficiency_median']:.4f} (link {r['link_efficiency_median']:.4f}), phase "
        f"{r['phase_s_median'] * 1e3:.1f} ms, payload {r['payload_bytes_median'] / 1e6:.2f} "
        f"MB; cores {cpu['process_cores']}; load {cpu['loadavg_start']}")
    return r


def part_offload_training(out: Path, plain_run: Path) -> dict[str, Any]:
    """The 100 Mbit/s run again with every host's experts offloaded into a budget of 4
    of its 8 (Belady): per-step transfers and bytes from the ``moe_offload`` events,
    checked against the pure policy replaying the use order the hosts logged, and the
    losses against the run without offload (the same, bit for bit, when the offload
    changes nothing but where the experts' parameters sit)."""
    from agents.moe.offload import simulate
    from analysis import moe as amoe

    budget = 4 * EXPERT_BYTES
    run_dir = run_fabric(100.0, out, (f"moe.offload_budget_bytes={budget}",
                                      'moe.offload_policy="belady"'))
    rows, plain = amoe.load_events(run_dir), amoe.load_events(plain_run)

    def losses(rs: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
        return {(r["node"], int(r["iter"])): r["loss"] for r in rs
                if r.get("event") == "moe_step"}
    same = losses(rows) == losses(plain)
    per_host = {}
    for node in sorted({r["node"] for r in rows if r.get("event") == "moe_offload"}):
        off = sorted((r for r in rows if r.get("event") == "moe_offload" and r["node"] == node),
                     key=lambda r: r["iter"])
        traces = [[u for u in r["expert_uses"]] for r in sorted(
            (r for r in rows if r.get("event") == "moe_step" and r["node"] == node),
            key=lambda r: r["iter"])]
        sizes = dict.fromkeys({u for t in traces for u in t}, EXPERT_BYTES)
        pure = simulate(traces, sizes, budget, "belady", invalidate_each_step=True)
        per_host[node] = {"transfers": sum(r["transfers"] for r in off),
                          "bytes_moved": sum(r["bytes_moved"] for r in off),
                          "hits": sum(r["hits"] for r in off),
                          "peak_device_bytes": max(r["peak_device_bytes"] for r in off),
                          "pure_policy_transfers": pure.transfers,
                          "steps": len(off)}
    step_s = [r["step_s"] for r in rows if r.get("event") == "moe_step" and r["iter"] >= 1]
    plain_s = [r["step_s"] for r in plain if r.get("event") == "moe_step" and r["iter"] >= 1]
    res = {"run_dir": str(run_dir), "budget_bytes": budget, "expert_bytes": EXPERT_BYTES,
           "losses_equal_to_plain_run": same, "hosts": per_host,
           "step_s_median": statistics.median(step_s),
           "plain_step_s_median": statistics.median(plain_s)}
    log(f"offload in training: {res}")
    return res


def part_capacity() -> dict[str, Any]:
    import torch

    from agents.core.moe_config import MoEConfig
    from agents.core.moe_metrics import load_imbalance
    from agents.moe.layer import MoELayer
    from agents.moe.model import build_model, global_batch, load_data, loss_fn

    torch.set_num_threads(1)
    data = load_data("fashion_mnist")
    out: dict[str, Any] = {}
    for cf in CAPACITY_FACTORS:
        cfg = MoEConfig(hosts=4, experts=16, layers=2, top_k=2, capacity_factor=cf,
                        d_model=64, d_hidden=128, dataset="fashion_mnist")
        model = build_model(cfg, data, groups=4, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=MOE_LR, momentum=MOE_MOMENTUM)
        drops, imb, demand, ces = [], [], [], []
        for step in range(40):
            x, y = global_batch(data, step, 4, MOE_BATCH_SIZE)
            opt.zero_grad()
            loss, ce = loss_fn(model, model(x), y, cfg.aux_loss_coef)
            loss.backward()
            opt.step()
            if step >= 30:
                for layer in model.moe:
                    assert isinstance(layer, MoELayer) and layer.stats is not None
                    st = layer.stats
                    drops.append(float(st.dropped.sum()) / (st.tokens * cfg.top_k))
                    imb.append(st.imbalance)
                    demand.append(load_imbalance((st.kept + st.dropped).tolist()))
                ces.append(float(ce.detach()))
        out[f"{cf:g}"] = {"drop_fraction": statistics.mean(drops),
                          "imbalance": statistics.mean(imb),
                          "demand_imbalance": statistics.mean(demand),
                          "ce": statistics.mean(ces)}
        log(f"cf {cf:g}: {out[f'{cf:g}']}")
    return out


def part_offload(trace: list[list[str]]) -> dict[str, Any]:
    """Both the recorded training order (forward, then backward reversed) and its forward
    half alone (inference, or recomputation that replays the forward)."""
    out = {"train": _offload(trace)}
    out["forward_only"] = _offload([t[:len(t) // 2] for t in trace])
    return out


def _offload(trace: list[list[str]]) -> dict[str, Any]:
    import torch

    from agents.moe.offload import Offloader

    names = sorted({u for step in trace for u in step})
    # One expert's parameters (d_model 128, d_hidden 128): fc1 and fc2, weights and biases.
    numel = EXPERT_BYTES // 4
    host = {n: torch.randn(numel) for n in names}
    out: dict[str, Any] = {"experts": len(names), "expert_bytes": EXPERT_BYTES,
                           "steps": len(trace), "uses": sum(len(s) for s in trace)}
    for k in (2, 4, 6):
        budget = k * numel * 4
        row = {}
        for policy in ("belady", "lru"):
            off = Offloader(host, budget, policy)
            for uses in trace:
                off.begin_step()
                for u in uses:
                    off.fetch(u)
            row[policy] = {"transfers": off.stats.transfers, "bytes": off.stats.bytes_moved}
        out[f"budget_{k}_experts"] = row
        log(f"budget {k} experts: {row}")
    return out


def plots(details: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "dispatch" in details:
        d = details["dispatch"]
        rates = [r for r in d if r.replace(".", "").isdigit()]
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([float(r) for r in rates], [d[r]["efficiency_median"] for r in rates], "o-",
                label="payload (formula)")
        ax.plot([float(r) for r in rates],
                [d[r].get("link_efficiency_median", float("nan")) for r in rates], "D-",
                label="tc: busiest HTB class's bytes")
        ax.plot([float(r) for r in rates], [d[r]["utilisation_median"] for r in rates], "s--",
                label="all frame bytes (utilisation)")
        ax.plot([float(r) for r in rates],
                [d[r].get("efficiency_burst_allowed_median", float("nan")) for r in rates],
                "^:", label="payload, HTB burst allowed")
        ax.axhline(0.9, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("access link, Mbit/s")
        ax.set_ylabel("median over hosts, layers, steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "dispatch_efficiency.png", dpi=110)
        plt.close(fig)
    if "capacity" in details:
        c = details["capacity"]
        cfs = [float(k) for k in c]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
        a1.plot(cfs, [v["drop_fraction"] for v in c.values()], "o-")
        a1.set_xlabel("capacity factor")
        a1.set_ylabel("dropped / (tokens x k)")
        a2.plot(cfs, [v["imbalance"] for v in c.values()], "o-", label="kept")
        a2.plot(cfs, [v["demand_imbalance"] for v in c.values()], "s--",
                label="routed (kept + dropped)")
        a2.set_xlabel("capacity factor")
        a2.set_ylabel("max / mean tokens per expert")
        a2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / "capacity.png", dpi=110)
        plt.close(fig)
    if "offload" in details:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3))
        for ax, (name, o) in zip(axes, details["offload"].items(), strict=True):
            keys = [k for k in o if k.startswith("budget_")]
            xs = range(len(keys))
            ax.bar([x - 0.2 for x in xs], [o[k]["belady"]["transfers"] for k in keys], 0.4,
                   label="Belady")
            ax.bar([x + 0.2 for x in xs], [o[k]["lru"]["transfers"] for k in keys], 0.4,
                   label="LRU")
            ax.set_xticks(list(xs), [k.split("_")[1] + " of 8 experts" for k in keys])
            ax.set_ylabel("host-to-device transfers")
            ax.set_title(name.replace("_", " ") + " order")
            ax.legend()
        fig.tight_layout()
        fig.savefig(PLOTS / "offload.png", dpi=110)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--part", choices=("all", "dispatch", "capacity", "offload", "linerate"),
                    default="all")
    ap.add_argument("--rates", default="1000,10000",
                    help="linerate part: access link rates in Mbit/s, comma-separated")
    args = ap.parse_args()
    PLOTS.mkdir(parents=True, exist_ok=True)
    saved = PLOTS / "results.json"
    # A part run updates its own keys and keeps the others' last results.
    details: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    with tempfile.TemporaryDirectory(prefix="gradbed-moe-") as tmp:
        if args.part in ("all", "capacity"):
            details["capacity"] = part_capacity()
        if args.part in ("all", "linerate"):
            details["linerate"] = part_linerate(
                Path(tmp), tuple(float(r) for r in args.rates.split(",")))
        if args.part in ("all", "dispatch", "offload"):
            details["dispatch"] = part_dispatch(Path(tmp))
            trace = details["dispatch"].pop("trace_e0")
            details["offload"] = part_offload(trace)
            details["offload_training"] = part_offload_training(
                Path(tmp), Path(details["dispatch"].pop("run_100")))
    if args.part != "linerate":  # the linerate part draws no plot
        plots(details)
    headline = (details["dispatch"]["100"]["efficiency_median"]
                if "dispatch" in details else float("nan"))
    saved.write_text(json.dumps(details, indent=1, default=float))
    emit("moe", headline, "payload bytes / (phase x rate x TCP goodput fraction), median at "
         "100 Mbit/s (tc lower bound beside it: "
         "dispatch.100.link_efficiency_burst_allowed_inner_median)",
         ">= 0.9 at 100 Mbit/s", details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
