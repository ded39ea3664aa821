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


def test_readme_layer_example_runs_and_decoding_matches():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    layer_blocks = [b for b in blocks if "rewy_jax.layers" in b]
    assert layer_blocks, "README has no Flax layer example"
    scope: dict = {}
    exec(compile(layer_blocks[0], "README.md", "exec"), scope)  # noqa: S102
    assert scope["y"].shape == scope["x"].shape
    np.testing.assert_allclose(np.asarray(scope["y_next"]), np.asarray(scope["y"][:, 99:]),
                               rtol=2e-4, atol=2e-4)


def test_readme_is_short_and_stays_inside_the_repository():
    """A newcomer's first page: at most ~10 KB, and every link points into this repository."""
    text = README.read_text()
    assert len(text.encode()) <= 10_500, len(text.encode())
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links, "README links into docs/"
    outside = [x for x in links if x.startswith(("/", "..", "http:", "https:"))]
    assert not outside, outside
    assert "../shared" not in text
