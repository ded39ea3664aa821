"""The library's import layers: ``pallas_kernels`` (the compute floor) imports nothing from
``rewy_jax``, ``benchmarks``, ``examples`` or the developer ``tools``, nor jax's private
``jax._src``; inside the GPU package every module imports only downward (no cycles).

Read from the source (every ``import`` statement, also those inside functions), so a lazy
import cannot hide a dependency that a plain ``import`` of the module would not trigger."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("rewy_jax", "benchmarks", "examples", "tools", "jax._src")


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def _modules(package: str) -> dict[str, Path]:
    root = ROOT / package.replace(".", "/")
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in root.rglob("*.py")}


def test_pallas_kernels_imports_nothing_above_it():
    bad = {}
    for name, path in _modules("pallas_kernels").items():
        hits = sorted(m for m in _imports(path)
                      if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
        if hits:
            bad[name] = hits
    assert not bad, bad


def test_gpu_package_imports_only_downward():
    """config, blocks -> decay -> launch -> the pipeline stages -> api: each module of pallas_kernels.gpu
    imports only modules of a lower layer (so there is no cycle, direct or through a function),
    and every module of the package has a layer."""
    layers = [["pallas_kernels.gpu.config"], ["pallas_kernels.gpu.blocks"],
              ["pallas_kernels.gpu.decay"], ["pallas_kernels.gpu.launch"],
              ["pallas_kernels.gpu." + m for m in ("chunk_local", "gates", "state_passes",
                                                  "output", "chunk_backward")],
              ["pallas_kernels.gpu.api"]]
    rank = {m: i for i, names in enumerate(layers) for m in names}
    mods = _modules("pallas_kernels.gpu")
    assert set(mods) - {"pallas_kernels.gpu"} == set(rank), sorted(mods)
    for name, i in rank.items():
        inside = {m for m in _imports(mods[name]) if m in rank}
        above = {m for m in inside if rank[m] >= i}
        assert not above, (name, sorted(above))


def test_importing_the_kernels_loads_no_rewy_jax():
    """At run time too: importing the GPU package's api loads no module of rewy_jax, the
    benchmarks or the tools."""
    code = ("import sys, pallas_kernels.gpu.api, pallas_kernels.tpu; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('rewy_jax', 'benchmarks', 'examples', 'tools')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
