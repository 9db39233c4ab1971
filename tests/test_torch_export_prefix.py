"""``export --prefix ""`` exports every tensor of the version, numpy arrays included.

It used to leave out the arrays a state holds as numpy arrays (the numpy RNG's key,
``rng.numpy.1``) without a word: only torch tensors were taken from a torch_bridge
version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import chunkstore  # noqa: E402
from chunkstore.format.manifest import TensorEntry  # noqa: E402
from torch_bridge import Checkpointer  # noqa: E402
from torch_bridge.tools.cli import export  # noqa: E402


def test_an_empty_prefix_exports_every_tensor_entry(tmp_path: Path) -> None:
    torch.manual_seed(0)
    np.random.seed(3)
    model = torch.nn.Linear(3, 2)
    store = tmp_path / "s"
    with Checkpointer(store, run="r") as ckpt:
        ckpt.save(1, model=model, extra={"table": np.arange(6, dtype=np.int32)})
    with chunkstore.open(store) as opened:
        reader = opened.open_version("r@1")
        tensors = {name for name, leaf in reader.entries().items()
                   if isinstance(leaf, TensorEntry)}
        expected = {name: reader.get(name) for name in tensors}
    assert {"rng.numpy.1", "extra.table", "model.weight"} <= tensors

    out = tmp_path / "all.safetensors"
    result = CliRunner().invoke(export, [str(store), "r@1", str(out), "--prefix", ""])
    assert result.exit_code == 0, result.output
    loaded = safetensors_torch.load_file(out)
    assert set(loaded) == tensors
    for name, array in expected.items():
        assert np.array_equal(loaded[name].numpy(), array), name

    # under a prefix, the prefix is removed from the names as before
    out = tmp_path / "rng.safetensors"
    result = CliRunner().invoke(export, [str(store), "r@1", str(out), "--prefix", "rng."])
    assert result.exit_code == 0, result.output
    assert set(safetensors_torch.load_file(out)) == {name[4:] for name in tensors
                                                     if name.startswith("rng.")}
