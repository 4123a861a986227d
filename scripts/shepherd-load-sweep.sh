#!/usr/bin/env bash
# Shepherd's own goodput metric in the simulator — requests that meet their SLO per second at an
# offered load (seed 003, §2: "the number of requests that meet their SLO deadlines per unit
# time") — for every scheduler on the 400-GPU scenario, at several offered loads, over seeds.
# This is not the `--max-goodput` figure of the README's other tables (the highest rate at which
# every model keeps ≥ 99% of its requests within SLO, Symphony's definition).
#
#   scripts/shepherd-load-sweep.sh [SEEDS="7 1 2"] [RATES="100000 200000 300000 400000 600000"]
#
# Needs the release binary: cargo build --release -p cascade-benches --bin goodput. Deterministic
# for a seed (the virtual clock; the dispatchers are not charged), so a busy machine only slows it.
set -euo pipefail
seeds=${1:-"7 1 2"}
rates=${2:-"100000 200000 300000 400000 600000"}
scenario=${SCENARIO:-sched/scenarios/scale_400gpus.toml}
bin=${BIN:-target/release/goodput}
[ -x "$bin" ] || { echo "$bin missing: cargo build --release -p cascade-benches --bin goodput" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed for the summary" >&2; exit 1; }
schedulers=(flex/herd:10:40 flex/herd:32:13 flex clockwork clockwork-real nexus symphony)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for rate in $rates; do
  for s in "${schedulers[@]}"; do
    for seed in $seeds; do
      j=$("$bin" --scenario "$scenario" --scheduler "$s" --rate "$rate" --seed "$seed" --json)
      echo "$rate $s $seed $j" >> "$out"
      echo "$rate $s seed $seed: $(echo "$j" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(round(d["goodput_rps"]), "within SLO of", round(d["offered_rps"]))')" >&2
    done
  done
done
python3 - "$out" "${schedulers[@]}" <<'PYEOF'
import json, statistics, sys
rows, order = {}, sys.argv[2:]
for line in open(sys.argv[1]):
    rate, s, _, js = line.split(" ", 3)
    rows.setdefault(int(rate), {}).setdefault(s, []).append(json.loads(js)["goodput_rps"])
print("| offered r/s | " + " | ".join(order) + " | flex/herd:10:40 ÷ clockwork | ÷ clockwork-real | ÷ nexus |")
print("| --- " * (len(order) + 4) + "|")
for rate in sorted(rows):
    med = {s: statistics.median(v) for s, v in rows[rate].items()}
    cells = [f"{med[s]:,.0f}" for s in order]
    h = med["flex/herd:10:40"]
    ratios = [f"{h / med[b]:.2f}" for b in ("clockwork", "clockwork-real", "nexus")]
    print(f"| {rate:,} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
PYEOF
