#!/usr/bin/env python3
# Rewrites a GGUF's Q4_1 matrices as another of GGUF's 32-weight block types (Q4_0, Q5_0, Q5_1,
# Q8_0), the rest unchanged: inputs for checking `cascade model import --dtype quantized` on
# each block type (README, *Quantized models*). Not a model anyone ships: its weights are the Q4_1
# ones requantized. Needs numpy and the `gguf` package (pip install gguf).
# Usage: scripts/requant-gguf.py SRC.gguf DST.gguf Q4_0|Q5_0|Q5_1|Q8_0
import sys, numpy as np, gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T, quants
src, dst, to = sys.argv[1], sys.argv[2], T[sys.argv[3]]
r = GGUFReader(src)
arch = r.fields['general.architecture']
w = GGUFWriter(dst, arch=bytes(arch.parts[arch.data[0]]).decode())
for f in r.fields.values():
    if f.name.startswith('GGUF.') or f.name == 'general.architecture':
        continue
    vt = f.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        it = f.types[1]
        if it == gguf.GGUFValueType.STRING:
            val = [bytes(f.parts[i]).decode('utf-8', errors='surrogateescape') for i in f.data]
        else:
            val = [f.parts[i].tolist()[0] for i in f.data]
        w.add_key_value(f.name, val, vt, sub_type=it)
    elif vt == gguf.GGUFValueType.STRING:
        w.add_key_value(f.name, bytes(f.parts[f.data[0]]).decode('utf-8', errors='surrogateescape'), vt)
    else:
        w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], vt)
for t in r.tensors:
    if t.tensor_type == T.Q4_1:
        x = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        q = quants.quantize(x, to)
        w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=to)
    else:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
