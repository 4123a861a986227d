#!/usr/bin/env python3
"""dLoRA Figure 10/14 sweep: every policy over zipf_s ∈ {1.0, 1.5} × skewness ∈ {4, 8, 16, 32}.

Usage (after `cargo build --release -p cascade-benches`):
  scripts/lora-fig10.py table --rate 3              # the README's table (the scenario's seed)
  scripts/lora-fig10.py summary --seeds 2,3 --rates 3,4,5 [--set 'credit0 = 4.0' ...]

`table` prints one Markdown row per setting: top adapter's share, dLoRA's average latency (s per
token), each baseline's with its ratio to dLoRA's, dLoRA's p90, mode switches and longest wait.
`summary` reports, per rate and overall, how often dLoRA has the lowest average latency and the
geometric mean of (best baseline ÷ dLoRA); `--set` lines are added to the scenario's [batch]
table (to compare batcher settings on seeds other than the one the README reports).
"""
import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIM = os.path.join(ROOT, "target", "release", "lora-sim")
SCENARIO = os.path.join(ROOT, "sched", "scenarios", "lora_1gpu.toml")
BASELINES = ["merged-only", "unmerged-only", "slora"]


def run(scenario, rate, zipf, skew):
    cmd = [SIM, "--scenario", scenario, "--policy", "all", "--skewness", str(skew), "--zipf", str(zipf),
           "--rate", str(rate), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {d["policy"]: d for d in map(json.loads, out.splitlines())}


def scenario_file(seed, sets):
    text = open(SCENARIO).read()
    if seed is not None:
        text = re.sub(r"^seed = \d+", f"seed = {seed}", text, flags=re.M)
    if sets:
        text = text.replace("[batch]\n", "[batch]\n" + "\n".join(sets) + "\n", 1)
    f = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    f.write(text)
    f.close()
    return f.name


def grid():
    return itertools.product([1.0, 1.5], [4, 8, 16, 32])


def table(args):
    path = scenario_file(None, args.set)
    for zipf, skew in grid():
        r = run(path, args.rate, zipf, skew)
        d = r["dlora"]
        lat = d["avg_latency_s"]
        cells = [f"{r[p]['avg_latency_s']:.4f} ({r[p]['avg_latency_s'] / lat:.2f}×)" for p in BASELINES]
        print(f"| {zipf} | {skew} | {d['top_adapter_share'] * 100:.0f}% | {lat:.4f} | " + " | ".join(cells)
              + f" | {d['p90_latency_s']:.3f} | {d['mode_switches']} | {d['max_wait_iterations']} |", flush=True)
    os.unlink(path)


def summary(args):
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        path = scenario_file(seed, args.set)
        for rate in [float(x) for x in args.rates.split(",")]:
            for zipf, skew in grid():
                r = run(path, rate, zipf, skew)
                best = min(r[p]["avg_latency_s"] for p in BASELINES)
                rows.append((rate, best / r["dlora"]["avg_latency_s"], r["dlora"]["max_wait_iterations"]))
        os.unlink(path)

    def line(name, sub):
        gm = math.exp(sum(math.log(x[1]) for x in sub) / len(sub))
        wins = sum(x[1] > 1 for x in sub)
        print(f"{name}: dlora lowest in {wins}/{len(sub)}, geo-mean best baseline ÷ dlora {gm:.3f}, "
              f"worst {min(x[1] for x in sub):.3f}, longest wait {max(x[2] for x in sub)} iterations")

    for rate in sorted({x[0] for x in rows}):
        line(f"rate {rate}", [x for x in rows if x[0] == rate])
    line("all", rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--rate", type=float, default=3.0)
    t.add_argument("--set", action="append", default=[])
    s = sub.add_parser("summary")
    s.add_argument("--seeds", default="2,3")
    s.add_argument("--rates", default="3,4,5")
    s.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    if not os.path.exists(SIM):
        sys.exit(f"{SIM} is missing: cargo build --release -p cascade-benches")
    (table if args.cmd == "table" else summary)(args)


if __name__ == "__main__":
    main()
