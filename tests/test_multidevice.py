"""Multi-device tests on fake CPU devices, each module in its own process.

XLA fixes the number of CPU devices when the backend starts, so the 8-device tests cannot share
the main pytest process (which has one CPU device, and whose other tests must not change). Each
module of ``tests/multidevice/`` (named ``md_*.py`` so that the main run does not collect them)
runs here in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; its
pytest output is shown when it fails. Run one directly with
``XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/multidevice/md_shard_map.py``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent / "multidevice"
MODULES = sorted(p.name for p in HERE.glob("md_*.py"))


@pytest.mark.parametrize("module", MODULES)
def test_multidevice_module(module):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(HERE / module)],
        env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
