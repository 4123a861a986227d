#!/usr/bin/env python3
"""Independent reference for Cascade's llama layers: greedy generation with SmolLM2-135M-Instruct.

Everything here is separate from the Rust path: the weights are dequantized by the `gguf` Python
package (not candle), kept in GGUF's own layout (Q/K rows permuted for interleaved RoPE, which is
applied here on adjacent pairs; the Rust side un-permutes and rotates halves), the prompt is
tokenized by a small byte-level BPE written below from the GGUF metadata (not the `tokenizers`
crate), and the forward pass is plain numpy in float32.

Rerun (numpy, regex and gguf from PyPI; the model from `scripts/fetch-smollm2.sh`):
    python3 exec/testdata/smollm2_reference.py target/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        > exec/testdata/smollm2_reference.json

Output: one record per prompt with its token ids, the 32 greedy tokens, and for every step the
runner-up token and the margin between the two largest logits (a step whose margin is below 0.3 is a near-tie that float
and quantized arithmetic may break differently).
"""
import json
import sys

import numpy as np
import regex
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
]
STEPS = 32


def field(r, key):
    return r.fields[key].contents()


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Bpe:
    """GPT-2 byte-level BPE with SmolLM's pre-tokenizer (each digit alone, then GPT-2's regex)."""

    PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, r):
        self.tokens = field(r, "tokenizer.ggml.tokens")
        types = field(r, "tokenizer.ggml.token_type")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(field(r, "tokenizer.ggml.merges"))}
        self.special = sorted((t for t, ty in zip(self.tokens, types) if ty == 3), key=len, reverse=True)
        self.b2u = bytes_to_unicode()
        self.u2b = {v: k for k, v in self.b2u.items()}

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.ids[p] for p in parts]

    def encode(self, text):
        out = []
        pieces = regex.split("(" + "|".join(map(regex.escape, self.special)) + ")", text)
        for piece in pieces:
            if piece in self.ids and piece in self.special:
                out.append(self.ids[piece])
                continue
            for chunk in regex.split(r"(\p{N})", piece):
                for word in self.PAT.findall(chunk):
                    out += self.bpe("".join(self.b2u[b] for b in word.encode("utf-8")))
        return out

    def decode(self, ids):
        text = "".join(self.tokens[i] for i in ids)
        return bytes(self.u2b[c] for c in text if c in self.u2b).decode("utf-8", errors="replace")


class Llama:
    def __init__(self, r):
        self.layers = int(field(r, "llama.block_count"))
        self.heads = int(field(r, "llama.attention.head_count"))
        self.kv_heads = int(field(r, "llama.attention.head_count_kv"))
        self.width = int(field(r, "llama.embedding_length"))
        self.eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
        self.base = float(field(r, "llama.rope.freq_base"))
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(d) for d in reversed(t.shape))) for t in r.tensors}
        self.head_dim = self.width // self.heads

    def norm(self, x, g):
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)) * g

    def rope(self, x, pos):
        # Interleaved: rotate adjacent pairs (2i, 2i+1), as llama.cpp does on GGUF's permuted rows.
        d = self.head_dim
        inv = self.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = np.outer(pos, inv)  # [T, d/2]
        cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def forward(self, ids, cache):
        start = cache["len"]
        pos = np.arange(start, start + len(ids))
        x = self.w["token_embd.weight"][ids]
        for l in range(self.layers):
            p = f"blk.{l}."
            h = self.norm(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(len(ids), self.heads, self.head_dim)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(len(ids), self.kv_heads, self.head_dim)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(len(ids), self.kv_heads, self.head_dim)
            q, k = self.rope(q, pos), self.rope(k, pos)
            ks, vs = cache.setdefault(l, ([], []))
            ks.append(k)
            vs.append(v)
            K, V = np.concatenate(ks), np.concatenate(vs)  # [S, kv, d]
            group = self.heads // self.kv_heads
            att = np.empty((len(ids), self.heads, self.head_dim), dtype=np.float32)
            for hd in range(self.heads):
                s = (q[:, hd, :] @ K[:, hd // group, :].T) / np.sqrt(self.head_dim)  # [T, S]
                causal = np.arange(K.shape[0])[None, :] > pos[:, None]
                s = np.where(causal, -np.inf, s)
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                att[:, hd, :] = (s / s.sum(axis=-1, keepdims=True)) @ V[:, hd // group, :]
            x = x + att.reshape(len(ids), -1) @ self.w[p + "attn_output.weight"].T
            h = self.norm(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * up) @ self.w[p + "ffn_down.weight"].T
        cache["len"] = start + len(ids)
        x = self.norm(x[-1], self.w["output_norm.weight"])
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        return head @ x


def main():
    r = GGUFReader(sys.argv[1])
    tok, model = Bpe(r), Llama(r)
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    out = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        cache = {"len": 0}
        logits = model.forward(np.array(ids), cache)
        tokens, seconds, margins = [], [], []
        for _ in range(STEPS):
            top = np.argsort(logits)[::-1][:2]
            tokens.append(int(top[0]))
            seconds.append(int(top[1]))
            margins.append(round(float(logits[top[0]] - logits[top[1]]), 4))
            if tokens[-1] == eos:
                break
            logits = model.forward(np.array([tokens[-1]]), cache)
        out.append({"prompt": prompt, "prompt_tokens": ids, "tokens": tokens, "seconds": seconds, "margins": margins, "text": tok.decode(tokens)})
        print(json.dumps(out[-1]), file=sys.stderr)
    json.dump({"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "steps": STEPS, "prompts": out}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
