"""Turns a pytest-benchmark JSON (``make bench`` writes bench/results/latest.json) into
bench/results/summary.md (the tables docs/benchmarks.md shows) and bench/results/overview.png."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _by_name(data: dict) -> dict[str, dict]:
    return {b["name"]: b for b in data["benchmarks"]}


def _median_ns(b: dict) -> float:
    return b["stats"]["median"] * 1e9


def build(data: dict) -> tuple[str, dict]:
    b = _by_name(data)
    lines: list[str] = []
    plot: dict = {}

    lines += [
        (
            "### Fast path: 2 gloo ranks, blocks of 10 calls alternated with raw torch.distributed over "
            "the same gloo connections (goal <= 1.02)"
        ),
        "",
        "| call | raw torch | fastdist | ratio of medians | added |",
        "|---|---|---|---|---|",
    ]
    for op in ("barrier", "all_reduce_1", "all_reduce_1mb", "all_gather_1", "all_gather_1mb"):
        x = b.get(f"test_collective_overhead[{op}]", {}).get("extra_info")
        if x:
            lines.append(
                f"| {op} | {x['raw_median_us']:.1f} us | {x['fastdist_median_us']:.1f} us | "
                f"{x['ratio_of_medians']:.3f} | {x['added_us']:+.1f} us |"
            )
            plot.setdefault("overhead", {})[op] = x["ratio_of_medians"]
    watched = [
        (op, b.get(f"test_watched_group_overhead[{op}]", {}).get("extra_info"))
        for op in ("all_reduce_1", "all_reduce_1mb", "ddp_step")
    ]
    if any(x for _, x in watched):
        lines += [
            "",
            (
                "### Watched groups: torch's own calls on a watched group against the same calls over its "
                "gloo connections without the wrapper; DDP: against a plain gloo group "
                "(goals: DDP <= 1.02, 1 element <= 1.02, 1 MB <= 1.01)"
            ),
            "",
            "| call | raw | watched | ratio of medians | added |",
            "|---|---|---|---|---|",
        ]
        label = {
            "all_reduce_1": "dist.all_reduce, 1 element",
            "all_reduce_1mb": "dist.all_reduce, 1 MB",
            "ddp_step": "DDP step, 1M params",
        }
        for op, x in watched:
            if x:
                lines.append(
                    f"| {label[op]} | {x['raw_median_us']:.1f} us | {x['fastdist_median_us']:.1f} us | "
                    f"{x['ratio_of_medians']:.3f} | {x['added_us']:+.1f} us |"
                )
    m = b.get("test_metrics_cost", {}).get("extra_info")
    if m:
        lines += [
            "",
            (
                f"Metrics (issue 28): the DDP step while Prometheus scrapes this rank every second, "
                f"{m['fastdist_median_us']:.1f} us against {m['raw_median_us']:.1f} us unscraped: ratio "
                f"{m['ratio_of_medians']:.3f} (goal <= 1.01; {m['scrapes']} scrapes of "
                f"{m['scrape_ms']:.2f} ms)."
            ),
        ]
    w = b.get("test_wait_on_a_completed_future", {}).get("extra_info")
    f = b.get("test_fail_after_enter_exit", {}).get("extra_info")
    if w:
        lines += [
            "",
            (
                f"fastdist.wait(fut, timeout=10) on a completed Future: {w['fastdist_us']:.2f} us against "
                f"fut.wait() {w['raw_us']:.2f} us (added {w['added_us']:+.2f} us; goal <= 1.2 us)."
            ),
        ]
    if f:
        empty = f.get("empty_us", 0.0)
        note = f"the call around it less the same call around an empty context manager, {empty:.2f} us"
        lines += ["", f"fail_after enter + exit: {f['enter_exit_us']:.2f} us (goal <= 1 us; {note})."]
    c = b.get("test_all_reduce_call_cost_in_process", {}).get("extra_info")
    if c:
        lines += [
            "",
            (
                "fastdist.all_reduce(t, timeout=30) against dist.all_reduce(t), 1 element, on one watched "
                "group of one rank, in process (the Python layer's own cost, without peer noise): "
                f"{c['fastdist_us']:.2f} us against {c['dist_us']:.2f} us, "
                f"added {c['added_us']:+.2f} us per call (ratio {c['ratio']:.3f})."
            ),
        ]
        if "history_ratio" in c:
            lines += [
                "",
                (
                    "The op history ring (fastdist.history), dist.all_reduce on that group: "
                    f"{c['history_on_us']:.2f} us with it, {c['history_off_us']:.2f} us without "
                    f"(ratio {c['history_ratio']:.3f}; goal <= 1.01)."
                ),
            ]
    prop = [(k, b[k]["extra_info"]) for k in sorted(b) if k.startswith("test_propagation_latency")]
    if prop:
        lines += [
            "",
            "### Fault propagation: rank 0 times out, the others wait in the same op (60 s deadline)",
            "",
            (
                "| ranks | median after rank 0's deadline | p99 | CPU of a rank in the failing call "
                "(median) | in a healthy barrier that waited 0.5 s |"
            ),
            "|---|---|---|---|---|",
        ]
        for k, x in prop:
            lines.append(
                f"| {k.split('[')[1].rstrip(']')} | {x['median_ms']:.1f} ms | {x['p99_ms']:.1f} ms | "
                f"{x['cpu_ms']:.2f} ms | {x['idle_cpu_ms']:.2f} ms |"
            )
        trip = b.get("test_store_round_trip_to_an_idle_thread", {}).get("extra_info")
        if trip:
            lines += [
                "",
                (
                    "Its anchor, a store round trip through a thread of another process that waits in a "
                    f"queue pop: {trip['back to back ms']:.3f} ms back to back, "
                    f"{trip['after 0.3 s idle ms']:.3f} ms after it idled 0.3 s."
                ),
            ]
    scale = [b[k]["extra_info"] for k in sorted(b) if k.startswith("test_report_scale")]
    if scale:
        lines += [
            "",
            "### The report and the recovery agreement at scale: simulated ranks (256 a process), a TCPStore",
            "",
            (
                "| ranks | report: ops per rank (median, max) | posted in the window | ring reached all | "
                "first / last rank has the report | agreement, all in: ops; last rank done after the last "
                "arrival | agreement, one gone: ops; last done after the deadline |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        for x in scale:
            lines.append(
                f"| {x['ranks']} | {x['report_ops_per_rank_median']:.0f}, {x['report_ops_per_rank_max']} | "
                f"{x['answered_in_window']} of {x['ranks'] - 1} ({x['window_ms']:.0f} ms) | "
                f"{x['ring_reached_all_ms']:.0f} ms | {x['first_holds_report_ms']:.0f} / "
                f"{x['last_holds_report_ms']:.0f} ms | {x['agree_ops_per_rank_median']:.0f}, "
                f"{x['agree_ops_per_rank_max']}; {x['agreement_after_last_arrival_ms']:.0f} ms | "
                f"{x['shrink_ops_per_rank_median']:.0f}, {x['shrink_ops_per_rank_max']}; "
                f"{x['shrink_after_deadline_ms']:.0f} ms |"
            )
    x = b.get("test_checks_cost", {}).get("extra_info")
    if x:
        lines += [
            "",
            (
                f"FASTDIST_CHECK=1 on a 1-element all_reduce: {x['unchecked_median_us']:.0f} us -> "
                f"{x['checked_median_us']:.0f} us (x{x['ratio']:.1f})."
            ),
        ]

    timers = [
        ("fastdist engine", "test_fastdist_engine"),
        ("asyncio call_later (loop thread)", "test_asyncio_call_later_on_a_loop_thread"),
        ("torchft context_timeout", "test_torchft_context_timeout"),
        ("torchft future_timeout", "test_torchft_future_timeout"),
        ("threading.Timer", "test_threading_timer"),
    ]
    have = [(label, _median_ns(b[name])) for label, name in timers if name in b]
    if have:
        ours = dict(have).get("fastdist engine")
        lines += [
            "",
            "### One deadline, register + cancel (goal: >= 20x cheaper than torchft)",
            "",
            "| timer | median | vs fastdist |",
            "|---|---|---|",
        ]
        for label, ns in have:
            lines.append(
                f"| {label} | {ns / 1000:.2f} us | {ns / ours:.0f}x |"
                if ours
                else f"| {label} | {ns / 1000:.2f} us | |"
            )
        plot["timers"] = have

    x = b.get("test_detection_latency", {}).get("extra_info")
    if x:
        lines += [
            "",
            (
                "### Detection: deadline -> error in the caller, 50 hangs "
                "(goal: median <= 20 ms without the report)"
            ),
            "",
            "| | median | p99 |",
            "|---|---|---|",
        ]
        for mode in ("without_report", "with_report"):
            lines.append(
                f"| {mode.replace('_', ' ')} | {x[mode]['median_ms']:.1f} ms | {x[mode]['p99_ms']:.1f} ms |"
            )
        plot["detection"] = x

    rec = [(b[k]["extra_info"]) for k in sorted(b) if k.startswith("test_recovery_vs_restart")]
    if rec:
        lines += [
            "",
            "### Recovery: timeout -> working group, against a restart (goal >= 5x)",
            "",
            "| ranks | recovery | restart | speedup |",
            "|---|---|---|---|",
        ]
        for x in sorted(rec, key=lambda r: r["world_size"]):
            lines.append(
                f"| {x['world_size']} | {x['recovery_s'] * 1000:.0f} ms | {x['restart_s'] * 1000:.0f} ms | "
                f"{x['speedup']:.0f}x |"
            )
        plot["recovery"] = rec

    death = b.get("test_death_to_training_again", {}).get("extra_info")
    if death:
        lines += [
            "",
            (
                "### A dead worker: SIGKILL in its backward to the next step done on every rank "
                "(goal: a spare >= 10x faster than torchrun's restart)"
            ),
            "",
            "| ranks | a spare | a new process | torchrun --max-restarts 1 + DCP | restart / spare |",
            "|---|---|---|---|---|",
        ]
        for world in sorted({int(k.rsplit("-", 1)[1]) for k in death}):
            row = {
                m: death.get(f"{m}-{world}", {}).get("death_to_training_s")
                for m in ("spare", "replacement", "torchrun-restart")
            }
            if None in row.values():
                continue
            restart = row["torchrun-restart"]
            lines.append(
                f"| {world} | {row['spare']:.2f} s | {row['replacement']:.2f} s | {restart:.2f} s | "
                f"{restart / row['spare']:.1f}x |"
            )
        steps = [
            f"{k}: {x['step_after_ms'] / x['step_before_ms']:.2f} ({x['undisturbed_ratio']:.2f})"
            for k, x in sorted(death.items())
            if not k.startswith("torchrun")
        ]
        lines.append(
            "\nRank 0's median step after the join against before it (goal <= 1.02; in brackets, its "
            "anchor: the same ratio between the two halves of the stretch before the fault, steps 41-60 "
            f"and 61-80, which differ by nothing but the machine's noise): {', '.join(steps)}."
        )
    hand = b.get("test_state_hand_over_throughput", {}).get("extra_info")
    if hand:
        lines.append(
            f"\nState hand-over to a joiner, {hand['bytes'] / 2**30:.2f} GiB of model and momentum: "
            f"{hand['fastdist_gbps']:.2f} GB/s against a raw gloo broadcast's "
            f"{hand['broadcast_gbps']:.2f} GB/s (ratio {hand['ratio']:.2f}; goal >= 0.8)."
        )

    scale = [b[k] for k in sorted(b) if k.startswith("test_register_cancel_with_pending")]
    if scale:
        lines += [
            "",
            "### Scale (goals: flat cost, <= 256 bytes per pending deadline, 0 idle wake-ups)",
            "",
            "| pending | register + cancel | bytes per pending (RSS) |",
            "|---|---|---|",
        ]
        for s in sorted(scale, key=lambda s: s["extra_info"]["pending"]):
            n = s["extra_info"]["pending"]
            mem = (
                f"{s['extra_info']['bytes_per_pending']:.0f}" if n >= 100_000 else "(below page granularity)"
            )
            lines.append(f"| {n:,} | {_median_ns(s):.0f} ns | {mem} |")
    idle = b.get("test_idle_wakeups_per_second", {}).get("extra_info")
    if idle:
        lines.append(
            f"\nIdle timer wake-ups: {idle['idle_wakeups_per_second']:.2f}/s with {idle['pending']} "
            "deadlines pending."
        )
    machine = data.get("machine_info", {})
    lines += [
        "",
        (
            f"Measured on {machine.get('cpu', {}).get('brand_raw', 'this machine')} "
            f"({machine.get('cpu', {}).get('count', '?')} cores), "
            f"Python {machine.get('python_version', '?')}; `make bench`."
        ),
    ]
    return "\n".join(lines) + "\n", plot


def draw(plot: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if "overhead" in plot:
        ax = axes[0]
        names, ratios = zip(*plot["overhead"].items())
        ax.bar(names, ratios, color="#4c72b0")
        ax.axhline(1.05, color="#c44e52", linestyle="--", label="goal 1.05")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylim(min(0.8, min(ratios) - 0.05), max(1.3, max(ratios) + 0.05))
        ax.set_title("fastdist / raw torch, median (2 gloo ranks)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    if "timers" in plot:
        ax = axes[1]
        labels, ns = zip(*plot["timers"])
        ax.barh(labels, [v / 1000 for v in ns], color=["#55a868"] + ["#8172b2"] * (len(ns) - 1))
        ax.set_xscale("log")
        ax.set_xlabel("us per register + cancel (log)")
        ax.set_title("one deadline")
    if "recovery" in plot:
        ax = axes[2]
        rec = sorted(plot["recovery"], key=lambda r: r["world_size"])
        xs = [r["world_size"] for r in rec]
        ax.bar([x - 0.2 for x in xs], [r["recovery_s"] * 1000 for r in rec], 0.4, label="fastdist.recover()")
        ax.bar([x + 0.2 for x in xs], [r["restart_s"] * 1000 for r in rec], 0.4, label="restart the ranks")
        ax.set_xticks(xs)
        ax.set_xlabel("ranks")
        ax.set_ylabel("ms from timeout to a working group")
        ax.set_title("recovery vs restart")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else HERE / "results" / "latest.json"
    data = json.loads(src.read_text())
    text, plot = build(data)
    out = src.parent
    (out / "summary.md").write_text(text)
    draw(plot, out / "overview.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
