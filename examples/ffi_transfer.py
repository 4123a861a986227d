#!/usr/bin/env python3
"""A transfer between two processes through Cascade's C ABI, from Python (ctypes only).

    cargo build --release -p cascade-ffi
    python3 examples/ffi_transfer.py [--lib target/release/libcascade_ffi.so]

The script is node 0; it starts itself again as node 1. Node 1 registers a buffer of its own
and SENDs its descriptor; node 0 WRITEs 4 MiB into it (crc-verified at the destination) with
the message "done" right behind the bytes (`cascade_post_notify`: node 1 receives it only after
they landed), and polls both completions; node 1 checks every byte and answers "verified".
"""
import argparse
import ctypes as C
import os
import socket
import subprocess
import sys
import tempfile
import time

OK, IN_PROGRESS, ERR_BUFFER_TOO_SMALL = 0, 1, -2
OP_WRITE, OP_VERIFY, EVENT_WRITE, EVENT_SEND = 1, 1, 1, 3
LEN = 4 << 20


class EndpointConfig(C.Structure):
    _fields_ = [("struct_size", C.c_uint32), ("node", C.c_uint32), ("cluster_toml", C.c_char_p),
                ("secret", C.c_char_p), ("secret_len", C.c_size_t), ("flags", C.c_uint32),
                ("op_timeout_ms", C.c_uint32), ("memory_limit", C.c_uint64)]


class RemoteRegion(C.Structure):
    _fields_ = [("node", C.c_uint32), ("id", C.c_uint32), ("key", C.c_uint64), ("len", C.c_uint64)]


class Op(C.Structure):
    _fields_ = [("struct_size", C.c_uint32), ("kind", C.c_uint32), ("local", C.c_void_p),
                ("local_offset", C.c_uint64), ("remote", RemoteRegion), ("remote_offset", C.c_uint64),
                ("len", C.c_uint64), ("flags", C.c_uint32), ("tag", C.c_uint64)]


class Completion(C.Structure):
    _fields_ = [("tag", C.c_uint64), ("bytes", C.c_uint64), ("status", C.c_int32), ("kind", C.c_uint32),
                ("node", C.c_uint32), ("layer", C.c_uint32)]


def load(path):
    lib = C.CDLL(path)
    lib.cascade_last_error.restype = C.c_char_p
    lib.cascade_version.restype = C.c_char_p
    return lib


def check(lib, rc, what):
    if rc != OK:
        sys.exit(f"{what} failed ({rc}): {lib.cascade_last_error().decode()}")


def recv(lib, ep, limit_s=20.0):
    """The next message: (from, tag, bytes)."""
    buf, needed, frm, tag = C.create_string_buffer(256), C.c_size_t(), C.c_uint32(), C.c_uint64()
    end = time.time() + limit_s
    while time.time() < end:
        rc = lib.cascade_recv(ep, C.byref(frm), C.byref(tag), buf, C.c_size_t(len(buf)), C.byref(needed))
        if rc == OK:
            return frm.value, tag.value, buf.raw[:needed.value]
        if rc != IN_PROGRESS:
            check(lib, rc, "cascade_recv")
        time.sleep(0.001)
    sys.exit("no message arrived")


def send(lib, ep, peer, tag, data):
    check(lib, lib.cascade_send(ep, C.c_uint32(peer), C.c_uint64(tag), data, C.c_size_t(len(data))), "cascade_send")


def endpoint(lib, node, toml, secret):
    cfg = EndpointConfig(C.sizeof(EndpointConfig), node, toml.encode(), secret, len(secret), 0, 10000, 0)
    ep = C.c_void_p()
    check(lib, lib.cascade_endpoint_create(C.byref(cfg), C.byref(ep)), "cascade_endpoint_create")
    for _ in range(200):
        rc = lib.cascade_endpoint_wait_ready(ep, C.c_uint32(100))
        if rc == OK:
            return ep
        if rc != IN_PROGRESS:
            check(lib, rc, "cascade_endpoint_wait_ready")
    sys.exit("the mesh never came up")


def pattern():
    return bytes((i * 31 + 7) & 0xFF for i in range(256)) * (LEN // 256)


def node1(lib, toml, secret):
    ep = endpoint(lib, 1, toml, secret)
    buf = C.create_string_buffer(LEN)  # memory this process owns, lent to the library
    region = C.c_void_p()
    check(lib, lib.cascade_region_register(ep, buf, C.c_uint64(LEN), C.byref(region)), "cascade_region_register")
    desc = RemoteRegion()
    check(lib, lib.cascade_region_descriptor(region, C.byref(desc)), "cascade_region_descriptor")
    send(lib, ep, 0, 1, bytes(desc))
    frm, tag, msg = recv(lib, ep)
    assert (frm, msg) == (0, b"done"), (frm, msg)
    ok = buf.raw[:LEN] == pattern()
    send(lib, ep, 0, 2, b"verified" if ok else b"corrupt")
    time.sleep(0.2)  # let the answer leave before the link closes
    check(lib, lib.cascade_region_deregister(ep, region, C.c_uint32(5000)), "cascade_region_deregister")
    check(lib, lib.cascade_endpoint_destroy(ep), "cascade_endpoint_destroy")
    return 0 if ok else 1


def node0(lib, lib_path, toml, secret):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "cluster.toml"), "w") as f:
            f.write(toml)
        child = subprocess.Popen([sys.executable, __file__, "--lib", lib_path, "--node", "1", "--cluster",
                                  os.path.join(d, "cluster.toml")], env={**os.environ, "CASCADE_SECRET": secret.decode()})
        ep = endpoint(lib, 0, toml, secret)
        src = C.create_string_buffer(pattern(), LEN)
        region = C.c_void_p()
        check(lib, lib.cascade_region_register(ep, src, C.c_uint64(LEN), C.byref(region)), "cascade_region_register")
        frm, tag, raw = recv(lib, ep)
        desc = RemoteRegion.from_buffer_copy(raw)
        print(f"node 1 lent region {desc.id} of {desc.len} bytes")
        op = Op(C.sizeof(Op), OP_WRITE, region, 0, desc, 0, LEN, OP_VERIFY, 77)
        t0 = time.time()
        done = b"done"
        check(lib, lib.cascade_post_notify(ep, C.byref(op), C.c_size_t(1), C.c_uint64(3), done,
                                           C.c_size_t(len(done))), "cascade_post_notify")
        got, c, n = {}, Completion(), C.c_size_t()
        while len(got) < 2:
            if lib.cascade_poll(ep, C.byref(c), C.c_size_t(1), C.byref(n)) == IN_PROGRESS:
                time.sleep(0.0005)
                continue
            check(lib, c.status, f"completion {c.tag}")
            got[c.kind] = (c.tag, c.bytes)
        dt = time.time() - t0
        assert got[EVENT_WRITE][0] == 77 and got[EVENT_SEND][0] == 3, got
        print(f"wrote {got[EVENT_WRITE][1]} bytes into node 1 in {dt * 1e3:.1f} ms (verified at the destination),"
              " \"done\" behind them")
        frm, tag, answer = recv(lib, ep)
        print(f"node 1 says: {answer.decode()}")
        check(lib, lib.cascade_region_deregister(ep, region, C.c_uint32(5000)), "cascade_region_deregister")
        check(lib, lib.cascade_endpoint_destroy(ep), "cascade_endpoint_destroy")
        rc = child.wait(timeout=30)
        return 0 if answer == b"verified" and rc == 0 else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "..", "target", "release", "libcascade_ffi.so")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("CASCADE_LIB", default), help="path of libcascade_ffi.so")
    ap.add_argument("--node", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.path.exists(a.lib):
        sys.exit(f"{a.lib} not found: build it with `cargo build --release -p cascade-ffi` or pass --lib")
    lib = load(a.lib)
    if a.node == 1:
        with open(a.cluster) as f:
            return node1(lib, f.read(), os.environ["CASCADE_SECRET"].encode())
    print(f"cascade {lib.cascade_version().decode()}, ABI {lib.cascade_abi_version()}")
    toml = (f'name = "py-{os.getpid()}"\n[[nodes]]\nid = 0\naddr = "127.0.0.1:{free_port()}"\n'
            f'[[nodes]]\nid = 1\naddr = "127.0.0.1:{free_port()}"\n')
    return node0(lib, a.lib, toml, b"python-example-secret")


if __name__ == "__main__":
    sys.exit(main())
