"""The MQAR main job (examples/mqar.py): data, a very short training run, outputs."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import mqar  # noqa: E402


def test_batch_layout():
    rng = np.random.default_rng(0)
    n, T, vocab = 6, 32, 40
    inputs, targets, mask = mqar.make_batch(rng, 5, T, n, vocab)
    assert inputs.shape == targets.shape == mask.shape == (5, T)
    for b in range(5):
        keys, values = inputs[b, 0:2 * n:2], inputs[b, 1:2 * n:2]
        assert len(set(keys.tolist())) == n  # distinct keys
        assert np.all((keys >= 1) & (keys < vocab // 2)) and np.all(values >= vocab // 2)
        table = dict(zip(keys.tolist(), values.tolist()))
        assert not mask[b, :2 * n].any() and mask[b, 2 * n:].all()
        for t in range(2 * n, T):  # every query's target is its key's value
            assert targets[b, t] == table[int(inputs[b, t])]


def test_bad_task_sizes_are_rejected():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="seq_len"):
        mqar.make_batch(rng, 2, 16, 8, 64)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        mqar.make_batch(rng, 2, 64, 20, 32)
    with pytest.raises(SystemExit):
        mqar.parse_args(["--mixers", "deltanet,mamba"])


def test_short_run_loss_falls_and_writes_outputs(tmp_path, capsys):
    out = tmp_path / "mqar"
    results = mqar.main(["--mixers", "deltanet", "--steps", "30", "--seq-len", "32",
                         "--num-kv-pairs", "4", "--d-model", "32", "--batch-size", "16",
                         "--eval-every", "15", "--eval-size", "32", "--chunk-size", "16",
                         "--lr", "1e-2", "--out", str(out), "--no-progress"])
    (r,) = results
    assert r["final_loss"] < r["first_loss"] - 0.3, r
    assert 0.0 <= r["accuracy"] <= 1.0 and r["params"] > 0 and r["steps_per_s"] > 0
    assert [s for s, _ in r["curve"]] == [15, 30]
    printed = capsys.readouterr().out
    assert "deltanet" in printed and "steps/s" in printed and "params" in printed
    assert (out / "mqar.png").stat().st_size > 1000
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"][0]["mixer"] == "deltanet"
