#!/usr/bin/env bash
# Shepherd's Figure 10 (seed 003, §7.1 "Scheduler scalability") on real threads: N emulated
# workers, the offered load growing with N at a fixed rate per worker low enough that the GPUs
# themselves keep up, so that whatever is dropped is dropped by a dispatcher that cannot keep
# up. For each N: clockwork (one centralised dispatcher), clockwork-real (Clockwork's own
# controller: per-GPU strategy queues), flex as one group (one dispatcher for every worker) and FLEX + HERD with the paper's group-worker limit of 12 (⌈N/12⌉ groups, a
# dispatcher thread each). Prints one line per run and a table of the medians.
#
#   scripts/shepherd-fig10.sh [PER_WORKER_RPS=500] [RUNS=3] [N ...]
#
# Needs the release binary: cargo build --release -p cascade-benches --bin sched-throughput.
# The machine should be otherwise quiet: this measures dispatcher threads on the wall clock.
set -euo pipefail
per=${1:-500}
runs=${2:-3}
shift $(( $# < 2 ? $# : 2 ))
ns=("$@")
[ ${#ns[@]} -gt 0 ] || ns=(100 400 800 1200 1600 2000 2400 3000)
bin=${BIN:-target/release/sched-throughput}
[ -x "$bin" ] || { echo "$bin missing: cargo build --release -p cascade-benches --bin sched-throughput" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed for the summary" >&2; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for n in "${ns[@]}"; do
  rate=$((n * per))
  groups=$(( (n + 11) / 12 ))
  for s in clockwork clockwork-real flex "flex/herd:$groups:12"; do
    for r in $(seq "$runs"); do
      j=$("$bin" --models 64 --gpus "$n" --rate "$rate" --seconds 3 --scheduler "$s" --json)
      echo "$n $s $r $j" | tee -a "$out" | cut -c1-160 >&2
    done
  done
done
python3 - "$out" "$per" <<'PYEOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    n, s, _, js = line.split(" ", 3)
    j = json.loads(js)
    kind = "flex/herd" if s.startswith("flex/herd") else s
    rows.setdefault(int(n), {}).setdefault(kind, []).append(j["within_slo"] / 3.0)
print(f"offered {sys.argv[2]} r/s per worker; requests within SLO per offered second, median (min-max)")
print("| workers | offered | clockwork | clockwork-real | flex, one group | FLEX + HERD (groups of 12) | FLEX + HERD / clockwork | / clockwork-real |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for n in sorted(rows):
    cell = lambda k: f"{statistics.median(rows[n][k]):,.0f} ({min(rows[n][k]):,.0f}-{max(rows[n][k]):,.0f})"
    ratio = lambda k: statistics.median(rows[n]["flex/herd"]) / statistics.median(rows[n][k])
    print(f"| {n} | {n * int(sys.argv[2]):,} | {cell('clockwork')} | {cell('clockwork-real')} | {cell('flex')} | {cell('flex/herd')} "
          f"| {ratio('clockwork'):.2f} | {ratio('clockwork-real'):.2f} |")
PYEOF
