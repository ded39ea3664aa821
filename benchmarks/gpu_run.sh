#!/usr/bin/env bash
# The benchmark on the lent GPU machine (no network), in one call of the device tool:
#
#   run(command="bash benchmarks/gpu_run.sh --quick", carry=[".whl"], timeout_s=540)
#
# Before it, here: the peers' wheels in ./.whl/ (git-ignored; benchmarks/README.md).
# It installs the peers' wheels, restores FLA's Triton autotune cache from
# benchmarks/fla-autotune-cache.tgz (or a carried .tcache/), runs `python -m benchmarks.run "$@"`
# under a hard timeout with results and the full log in $OUT, and packs every
# *.autotune.json into $OUT/fla-autotune.tgz: unpack it here and refresh the cache with
# `bash benchmarks/update_autotune_cache.sh <files_at>/fla-autotune.tgz`.
# Env: BENCH_TIMEOUT (s, default 480) bounds the Python run; BENCH_SPLIT and BENCH_STEM run
# several processes side by side (below), at most BENCH_PARALLEL at once (default: one per
# 20 GiB of GPU memory). BENCH_WALL (s, optional): the whole split's budget — each process's
# timeout is cut to what is left of it (minus 20 s to pack the parts), and an item with under
# 60 s left is skipped, so that the parts come back packed before the device call's own limit
# kills everything (run h100-19, call c: four processes in two waves, killed unpacked).
# A carried .whl/triton-*-slim.tar.xz (benchmarks/slim_triton.sh: Triton 3.7.1, which FLA needs
# for GDN/GDN2's backward on Hopper) is unpacked to /tmp/triton-new and put first on PYTHONPATH
# of the BENCH_SPLIT processes whose ops name gdn (BENCH_NEW_TRITON=all: every process; =none:
# none). JAX never imports it; FLA's DeltaNet/KDA keep the machine's Triton and autotune cache.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/bench-out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PWD:/tmp/site" || { echo "wheel install failed"; exit 1; }
else
  echo "no .whl/: peers will be skipped"; export PYTHONPATH="$PWD"
fi
[ -d .tcache ] || tar xzf benchmarks/fla-autotune-cache.tgz
new_triton=""
slim=$(ls .whl/triton-*-slim.tar.xz 2>/dev/null | tail -1)
wants=${BENCH_NEW_TRITON:-gdn}  # unpack only when some process will use it (~10 s)
[ "$wants" = gdn ] && [[ "${BENCH_SPLIT:-}" != *gdn* ]] && wants=none
if [ -n "$slim" ] && [ "$wants" != none ]; then
  mkdir -p /tmp/triton-new && tar -xJf "$slim" -C /tmp/triton-new \
    && new_triton=/tmp/triton-new && echo "newer Triton for FLA: $slim" \
    || echo "warning: could not unpack $slim; every process keeps the machine's Triton"
  # the slim package has no ptxas (slim_triton.sh): the machine's Triton's, checked by version
  bin=/tmp/triton-new/triton/backends/nvidia/bin
  own=$(python3 -c "import os, triton; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/ptxas
  if [ -n "$new_triton" ] && [ -x "$own" ]; then
    ln -sf "$own" "$bin/ptxas"
    [ "$("$own" --version | tail -1)" = "$(cat "$bin/ptxas.version")" ] \
      || echo "warning: the machine's ptxas ($("$own" --version | tail -1)) is not the one" \
              "Triton $slim came with ($(cat "$bin/ptxas.version"))"
  elif [ -n "$new_triton" ]; then
    echo "warning: no ptxas at $own; GDN/GDN2 processes keep the machine's Triton"; new_triton=""
  fi
fi
export TRITON_CACHE_DIR="$PWD/.tcache" FLA_DISABLE_BACKEND_DISPATCH=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia-smi.txt"
ROOT="$PWD"
if [ -d .bench_snapshot ]; then  # the committed code (benchmarks/snapshot.sh), not the work tree
  echo "code snapshot: $(cat .bench_snapshot/COMMIT)"
  export PYTHONPATH="$ROOT/.bench_snapshot:${PYTHONPATH#"$ROOT:"}"
  cd .bench_snapshot
fi
if [ -n "${BENCH_SPLIT:-}" ]; then
  # Side by side: one process per item of BENCH_SPLIT ("OPS[@SHAPES] ...", e.g.
  # "kda@2x4096x16x128,8x1024x8x64 deltanet"), each writing $OUT/$BENCH_STEM-pI.*, merged into
  # $OUT/$BENCH_STEM.*. They compile on their own cores and take turns on the GPU through one
  # lock file (benchmarks.run --gpu-lock), so no timing shares the GPU with another process.
  # $OUT ends with $BENCH_STEM.{json,md,png}, parts.tgz (every part and log), fla-autotune.tgz.
  stem="${BENCH_STEM:?BENCH_SPLIT needs BENCH_STEM}"
  n_items=$(wc -w <<< "$BENCH_SPLIT")
  # At most BENCH_PARALLEL processes at once (default: one per 20 GiB of GPU memory — 6 on an
  # H200, 3 on an H100), the rest start as earlier ones end: each keeps what its allocators
  # grew to, and too many side by side ran out of GPU memory — run h200-6 (eleven, FLA's
  # set-ups), h200-18a (eight, FLA's CUDA-graph fwd+bwd at the two largest DeltaNet shapes),
  # h100-19a (seven on an H100: most FLA rows, our largest GDN shape).
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  parallel=${BENCH_PARALLEL:-$(( ${mem_mib:-81920} / 20480 ))}
  (( parallel < 1 )) && parallel=1
  echo "$n_items processes, at most $parallel at once (GPU memory ${mem_mib:-?} MiB)"
  lock="$(mktemp /tmp/rewy-gpu-lock.XXXXXX)"
  # The parts and their logs live outside $OUT and travel as one tarball, $OUT/parts.tgz,
  # re-packed every 30 s and whenever a process ends: the device tool returns at most 8 files
  # and nothing once it kills the call at its limit (run h100-20, call c: six loose logs came
  # back, no part), so what finished — and the logs so far — must already be in one file.
  parts_dir="$(mktemp -d /tmp/rewy-bench-parts.XXXXXX)"
  pack() {
    (cd "$parts_dir" && ls bench-p*.log >/dev/null 2>&1 \
      && tar czf "$OUT/parts.tgz.tmp" bench-p*.log $(ls "$stem"-p*.* 2>/dev/null) \
      && mv -f "$OUT/parts.tgz.tmp" "$OUT/parts.tgz")
  }
  ( while sleep 30; do pack; done ) &
  packer=$!
  i=0
  for item in $BENCH_SPLIT; do
    part=(--ops "${item%%@*}")
    [[ "$item" == *@* ]] && part+=(--shapes "${item#*@}")
    env_new=()  # TRITON_BACKENDS_IN_TREE: its own backends, not the machine's Triton's entry points
    if [ -n "$new_triton" ] && { [ "${BENCH_NEW_TRITON:-gdn}" = all ] || [[ "${item%%@*}" == *gdn* ]]; }; then
      env_new=(env PYTHONPATH="$new_triton:$PYTHONPATH" TRITON_BACKENDS_IN_TREE=1)
    fi
    # a later wave's processes start when earlier ones end; BENCH_TIMEOUT bounds each one, so
    # size the device call's limit for the waves (items ÷ parallel, rounded up)
    # (the packer is one of the jobs)
    while (( $(jobs -rp | wc -l) >= parallel + 1 )); do wait -n; pack; done
    limit=${BENCH_TIMEOUT:-480}
    if [ -n "${BENCH_WALL:-}" ]; then
      left=$(( BENCH_WALL - 20 - SECONDS ))
      if (( left < 60 )); then
        echo "skipped (BENCH_WALL: ${left}s left): $item" | tee "$parts_dir/bench-p$i.log"
        echo 1 > "$parts_dir/rc-p$i"; i=$((i + 1)); continue
      fi
      (( left < limit )) && limit=$left
    fi
    ( timeout -k 10 "$limit" ${env_new[@]+"${env_new[@]}"} python3 -m benchmarks.run \
        --out-dir "$parts_dir" --gpu-lock "$lock" --stem "$stem-p$i" "${part[@]}" "$@" \
        > "$parts_dir/bench-p$i.log" 2>&1; echo $? > "$parts_dir/rc-p$i" ) &
    i=$((i + 1))
  done
  while (( $(jobs -rp | wc -l) > 1 )); do wait -n; pack; done
  kill "$packer" 2>/dev/null; wait "$packer" 2>/dev/null
  rc=0
  for f in "$parts_dir"/rc-p*; do [ -f "$f" ] && r=$(cat "$f") && (( r != 0 )) && rc=$r; done
  parts=("$parts_dir/$stem"-p*.json)
  python3 -m benchmarks.merge "${parts[@]}" --out-dir "$OUT" --stem "$stem" >/dev/null \
    || { echo "merge failed"; rc=1; }
  grep -h "accuracy\|error\|Error" "$parts_dir"/bench-p*.log | cut -c1-400
  pack; rm -rf "$parts_dir"
  [ -f "$OUT/$stem.md" ] && sed -n "/^## Headline/,/^## All rows/p" "$OUT/$stem.md"
else
  if [ -n "$new_triton" ] && [ "${BENCH_NEW_TRITON:-gdn}" = all ]; then
    export PYTHONPATH="$new_triton:$PYTHONPATH" TRITON_BACKENDS_IN_TREE=1
  fi
  timeout -k 10 "${BENCH_TIMEOUT:-480}" python3 -m benchmarks.run --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
  rc=$?
fi
cd "$ROOT"
find .tcache -name '*.autotune.json' -print0 | tar czf "$OUT/fla-autotune.tgz" --null -T -
echo "benchmark exit code: $rc"
exit $rc
