"""Export to safetensors (API and CLI), the plan command, and lazy torch imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import chunkstore  # noqa: E402
from torch_bridge import Checkpointer, export_safetensors  # noqa: E402
from torch_bridge.tools.cli import demo, export, plan  # noqa: E402

nn = torch.nn


def _saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    model[2].to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters())
    store = tmp_path / "s"
    with Checkpointer(store, run="exp") as ckpt:
        ckpt.save(5, model=model, optimizer=optimizer)
    return store, {k: v.clone() for k, v in model.state_dict().items()}


def test_export_round_trips_through_safetensors(tmp_path: Path) -> None:
    store, expected = _saved(tmp_path)
    out = tmp_path / "model.safetensors"
    summary = export_safetensors(store, "exp@5", out)
    loaded = safetensors_torch.load_file(out)
    assert loaded.keys() == expected.keys()  # optimizer state and RNG stripped
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor)
    assert summary["tensors"] == len(expected) and summary["step"] == 5


def test_a_tensor_named_like_the_safetensors_header_is_refused_before_writing(
        tmp_path: Path) -> None:
    """A model entry named '__metadata__' would be written as a tensor of that name, and
    the file would not load ("duplicate field"): refused, and no file is written."""
    from chunkstore.errors import InvalidInputError

    store = tmp_path / "s"
    with Checkpointer(store, run="exp") as ckpt:
        ckpt.save(1, model={"__metadata__": torch.ones(2), "w": torch.zeros(3)})
    out = tmp_path / "model.safetensors"
    with pytest.raises(InvalidInputError, match="__metadata__"):
        export_safetensors(store, "exp@1", out)
    assert not out.exists()


def test_export_casts_floating_point_tensors(tmp_path: Path) -> None:
    store, expected = _saved(tmp_path)
    out = tmp_path / "half.safetensors"
    export_safetensors(store, "latest", out, dtype="float16")
    loaded = safetensors_torch.load_file(out)
    assert all(t.dtype == torch.float16 for t in loaded.values())
    assert torch.equal(loaded["0.weight"], expected["0.weight"].half())


def test_export_command(tmp_path: Path) -> None:
    store, expected = _saved(tmp_path)
    out = tmp_path / "cli.safetensors"
    result = CliRunner().invoke(export, [str(store), "exp@latest", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tensors"] == len(expected)
    assert safetensors_torch.load_file(out).keys() == expected.keys()
    bad = CliRunner().invoke(export, [str(store), "exp@99", str(out)])
    assert bad.exit_code == 2 and "chunkstore: error: " in bad.output
    empty = CliRunner().invoke(export, [str(store), "exp@5", str(tmp_path / "none.safetensors"),
                                        "--prefix", "nope."])
    assert empty.exit_code == 2 and "no tensors under prefix" in empty.output
    missing = CliRunner().invoke(export, [str(tmp_path / "none"), "latest", str(out)])
    assert missing.exit_code == 2


def test_plan_command() -> None:
    result = CliRunner().invoke(plan, ["--save-seconds", "2", "--mtbf", "6",
                                       "--step-seconds", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert 280 < body["interval_seconds"] < body["young_interval_seconds"] < 300  # sqrt(2*2*21600)
    assert body["interval_steps"] == round(body["interval_seconds"] / 0.5)
    bad = CliRunner().invoke(plan, ["--save-seconds", "0", "--mtbf", "6"])
    assert bad.exit_code == 2 and bad.output.startswith("chunkstore: error: ")


def test_commands_have_help() -> None:
    for command in (demo, export, plan):
        result = CliRunner().invoke(command, ["--help"])
        assert result.exit_code == 0 and "Exit codes" in result.output


def test_the_cli_module_imports_torch_only_when_a_command_needs_it() -> None:
    code = ("import sys, torch_bridge, torch_bridge.tools.cli, torch_bridge.tools.plan\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_demo_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(demo, [str(tmp_path)])
    assert result.exit_code == 2 and "not empty" in result.output


def test_export_gives_the_file_the_usual_mode_and_takes_store_urls(tmp_path: Path) -> None:
    import os

    store, expected = _saved(tmp_path)
    out = tmp_path / "url.safetensors"
    result = CliRunner().invoke(export, [f"file://{store}", "exp@latest", str(out)])
    assert result.exit_code == 0, result.output
    assert safetensors_torch.load_file(out).keys() == expected.keys()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_and_diff_read_delta_versions(tmp_path: Path) -> None:
    """A sparse update saved as deltas exports and diffs like any version."""
    from chunkstore.cli import cli

    torch.manual_seed(0)
    model = nn.Embedding(2000, 32)  # 256 KB: four 64 KiB chunks
    store = tmp_path / "s"
    chunkstore.open(store, chunk_size=64 * 1024, delta_depth=2, create=True).close()
    with Checkpointer(store, run="exp", chunk_size=64 * 1024) as ckpt:
        ckpt.save(1, model=model)
        with torch.no_grad():
            model.weight[3] += 1  # chunk 0 only
        ckpt.save(2, model=model)
        bases = ckpt.store.open_version("exp@2").entry("model.weight").shards[0].bases
        assert bases and bases[0], "step 2's changed chunk must be a delta"
    out = tmp_path / "model.safetensors"
    export_safetensors(store, "exp@2", out)
    assert torch.equal(safetensors_torch.load_file(out)["weight"], model.weight.detach())
    diff = CliRunner().invoke(cli, ["diff", str(store), "exp@1", "exp@2", "--json"])
    assert diff.exit_code == 0, diff.output
    rows = {r["name"]: r for r in json.loads(diff.output)["entries"]}
    assert rows["model.weight"]["changed_chunks"] == 1


def test_export_never_clobbers_a_file_and_names_a_missing_directory(tmp_path: Path) -> None:
    """An existing file was silently replaced, and a missing directory was reported by
    the name of an internal temporary file.  Both are refused before anything is read
    (--force / overwrite=True replaces), and no temporary file is left."""
    from chunkstore.errors import InvalidInputError

    store, expected = _saved(tmp_path)
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"someone else's file")
    with pytest.raises(InvalidInputError, match="exists; pass --force"):
        export_safetensors(store, "exp@5", out)
    assert out.read_bytes() == b"someone else's file"
    result = CliRunner().invoke(export, [str(store), "exp@5", str(out)])
    assert result.exit_code == 2 and "exists; pass --force" in result.output
    result = CliRunner().invoke(export, [str(store), "exp@5", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert safetensors_torch.load_file(out).keys() == expected.keys()
    with pytest.raises(InvalidInputError, match=r"the directory .*nowhere does not exist"):
        export_safetensors(store, "exp@5", tmp_path / "nowhere" / "m.safetensors")
    assert not list(tmp_path.rglob(".export-*"))
