"""The README's example runs as written (a newcomer copies it first)."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_gives_finite_gradients():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102
    for name in ("dq", "dk", "dv"):
        grad = scope[name]
        assert grad.shape == scope["q"].shape[:3] + (grad.shape[-1],)
        assert np.all(np.isfinite(np.asarray(grad.astype(jnp.float32))))
    assert float(jnp.abs(scope["dq"].astype(jnp.float32)).sum()) > 0
