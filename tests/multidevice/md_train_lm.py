"""examples/train_lm.py on 4 fake CPU devices (data=2 × seq=2, hybrid model): a run interrupted
after a checkpoint and resumed gives exactly the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from _md import require_devices

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train_lm  # noqa: E402

COMMON = ["--batch", "4", "--seq-len", "32", "--d-model", "32", "--layers", "4", "--hybrid",
          "--chunk-size", "16", "--max-bytes", "100000", "--mesh", "data=2,seq=2",
          "--ckpt-every", "2", "--eval-every", "4", "--no-progress", "--backend", "xla",
          "--warmup", "1", "--lr", "1e-2"]


def test_resume_continues_exactly(tmp_path):
    require_devices(4)
    full = train_lm.main(COMMON + ["--steps", "4", "--workdir", str(tmp_path / "full")])
    part = tmp_path / "part"
    first = train_lm.main(COMMON + ["--steps", "4", "--workdir", str(part), "--stop-after", "2"])
    assert [s for s, _ in first["train"]] == [1, 2]
    resumed = train_lm.main(COMMON + ["--steps", "4", "--workdir", str(part), "--resume"])
    full_bpb = np.array([b for _, b in full["train"]])
    res_bpb = np.array([b for _, b in resumed["train"]])
    assert [s for s, _ in resumed["train"]] == [1, 2, 3, 4]
    np.testing.assert_array_equal(res_bpb, full_bpb)  # bit-exact continuation
    assert full_bpb[-1] < full_bpb[0], full_bpb  # it learns
    assert resumed["val"] == full["val"]
    assert (part / "bpb.png").stat().st_size > 1000
    assert json.loads((part / "history.json").read_text())["train"] == resumed["train"]
