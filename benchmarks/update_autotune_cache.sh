#!/usr/bin/env bash
# Fold the autotune results a GPU run brought back into benchmarks/fla-autotune-cache.tgz.
#   bash benchmarks/update_autotune_cache.sh /path/to/fla-autotune.tgz
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tmp="$(mktemp -d)"
tar xzf benchmarks/fla-autotune-cache.tgz -C "$tmp"
tar xzf "$1" -C "$tmp"
(cd "$tmp" && find .tcache -name '*.autotune.json' | sort > list && tar czf cache.tgz -T list)
mv "$tmp/cache.tgz" benchmarks/fla-autotune-cache.tgz
echo "$(wc -l < "$tmp/list") autotune files in benchmarks/fla-autotune-cache.tgz"
rm -rf "$tmp"
