#!/usr/bin/env bash
# A newer Triton for FLA's GDN and GDN2 on the GPU machine, small enough to travel in the
# device tool's carry (64 MiB in all, working tree included).
#
#   bash benchmarks/slim_triton.sh [VERSION]        # default 3.7.1; writes .whl/triton-VERSION-slim.tar.xz
#
# Why: FLA 0.6.0 refuses the backward of its gated kernels (GDN, GDN2) on Hopper under Triton
# 3.4.0 – 3.7.0 ("produces incorrect results"), and the GPU machine has Triton 3.6 (torch 2.11's).
# Triton 3.7.1's wheel is 198 MB (688 MB unpacked), 440 MB of it libtriton.so with debug
# information. Stripped of that and of what FLA's kernels never load — the AMD backend, CUPTI
# (the profiler's), the Blackwell ptxas, cuobjdump, nvdisasm, libproton, the instrumentation and
# FileCheck tools — and of ptxas (3.7.1's is byte-identical to 3.6.0's, CUDA 12.8.93: gpu_run.sh
# links the machine's in, after checking its version against ptxas.version), it packs to ~37 MB
# with xz. benchmarks/gpu_run.sh unpacks it to
# /tmp/triton-new and puts it first on PYTHONPATH for the processes that run GDN or GDN2 only,
# so FLA's DeltaNet and KDA keep the Triton (and the autotune cache) of earlier runs. JAX does
# not import this package (Pallas lowers through jaxlib's own Triton).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ver="${1:-3.7.1}"
out=".whl/triton-$ver-slim.tar.xz"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
py="${PYTHON:-python3}"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$tmp" "triton==$ver"
mkdir "$tmp/x"
(cd "$tmp/x" && unzip -q ../triton-"$ver"-*.whl)
t="$tmp/x/triton"
strip --strip-unneeded "$t/_C/libtriton.so"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/_C/libproton.so" \
  "$t/backends/nvidia/bin/ptxas-blackwell" "$t/backends/nvidia/bin/cuobjdump" \
  "$t/backends/nvidia/bin/nvdisasm" "$t/instrumentation" "$t/FileCheck"
"$t/backends/nvidia/bin/ptxas" --version | tail -1 > "$t/backends/nvidia/bin/ptxas.version"
rm "$t/backends/nvidia/bin/ptxas"
# what is left must still hold the pieces a CUDA compile needs
for f in _C/libtriton.so backends/nvidia/bin/ptxas.version backends/nvidia/lib/libdevice.10.bc \
         backends/nvidia/include/cuda.h backends/nvidia/driver.c; do
  [ -e "$t/$f" ] || { echo "slim_triton: $f is missing from triton $ver's wheel" >&2; exit 1; }
done
sed -i "/^amd = /d" "$tmp/x/triton-$ver.dist-info/entry_points.txt"  # the AMD backend is gone
mkdir -p .whl
(cd "$tmp/x" && tar -cf - triton "triton-$ver.dist-info" | xz -9 -T0 > "$OLDPWD/$out")
ls -la "$out"
echo "carry .whl as usual; gpu_run.sh uses it for GDN/GDN2 processes (BENCH_SPLIT items gdn*)"
