"""The commands that used to open an S3 store by URL alone take the CLI's storage options
too (``--storage-option``, ``CHUNKSTORE_STORAGE_OPTIONS``): ``export`` and ``demo`` (the
torch commands, in the ``chunkstore`` group and run standalone) and ``drill``, whose
restore runs in a child process.  Against the moto server CI runs; no AWS_ENDPOINT_URL,
so only the options can lead them to it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import chunkstore  # noqa: E402
from chunkstore.cli import cli  # noqa: E402
from tests.s3server import create_bucket, remove_bucket, s3_endpoint, storage_options  # noqa: E402
from torch_bridge import Checkpointer  # noqa: E402
from torch_bridge.tools import cli as torch_cli  # noqa: E402
from torch_bridge.tools import demo as demo_module  # noqa: E402
from torch_bridge.tools import training  # noqa: E402

__all__ = ["s3_endpoint"]  # the session fixture, re-exported so pytest finds it here


@pytest.fixture
def saved(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """An S3 store holding one torch_bridge version, r@1, and the model's weights."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("CHUNKSTORE_STORAGE_OPTIONS", raising=False)
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = create_bucket(s3_endpoint)
    url = f"s3://{bucket}/ckpts"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    try:
        with chunkstore.open(url, create=True, storage_options=storage_options(s3_endpoint),
                             index_dir=str(tmp_path / "writer")) as store, \
                Checkpointer(store, run="r") as ckpt:
            ckpt.save(1, model=model)
        yield url, {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        remove_bucket(s3_endpoint, bucket)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_export_takes_the_storage_options(saved: tuple[str, dict[str, torch.Tensor]],
                                          s3_endpoint: str, tmp_path: Path) -> None:
    url, weights = saved
    out = tmp_path / "a.safetensors"
    result = run("--storage-option", f"endpoint_url={s3_endpoint}", "export", url, "r@1",
                 str(out))
    assert result.exit_code == 0, result.output
    loaded = safetensors_torch.load_file(out)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    # the command run on its own (torch_bridge.tools.cli) reads the environment's
    out = tmp_path / "b.safetensors"
    env = {"CHUNKSTORE_STORAGE_OPTIONS": json.dumps(storage_options(s3_endpoint))}
    result = CliRunner().invoke(torch_cli.export, [url, "r@1", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert safetensors_torch.load_file(out).keys() == weights.keys()


@pytest.mark.parametrize("materialize", ["torch", "numpy"])
def test_drill_hands_the_storage_options_to_its_restore_process(
        saved: tuple[str, dict[str, torch.Tensor]], s3_endpoint: str, materialize: str) -> None:
    url, _ = saved
    result = run("--storage-option", f"endpoint_url={s3_endpoint}", "drill", url, "--json",
                 "--no-record", "--materialize", materialize)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["restored"] and report["step"] == 1, report


def test_the_demo_job_opens_its_store_with_the_storage_options(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's parts on a small job: the training subprocess gets the options
    through its environment, the parent opens with them."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("CHUNKSTORE_CACHE_DIR", str(tmp_path / "cache"))
    bucket = create_bucket(s3_endpoint)
    try:
        url = f"s3://{bucket}/demo"
        config = training.TrainConfig(steps=8, save_every=2, features=16, hidden=8,
                                      classes=3, examples=32, batch_size=8,
                                      chunk_size=64 * 1024)
        result = demo_module.run_demo(url, config, say=lambda _: None,
                                      storage_options=storage_options(s3_endpoint))
        assert result.matched, result.differences
        assert result.restored_step is not None and result.versions >= 3
    finally:
        remove_bucket(s3_endpoint, bucket)


def test_the_demo_command_passes_the_storage_options_on(
        s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_demo(where: str, say: object, storage_options: object = None,
                  seed: object = None) -> None:
        seen["options"] = storage_options
        raise RuntimeError("stop here")

    monkeypatch.setattr(demo_module, "run_demo", fake_demo)
    result = run("--storage-option", f"endpoint_url={s3_endpoint}", "demo", "s3://b/demo")
    assert result.exit_code == 4 and "stop here" in result.output
    assert seen["options"] == {"endpoint_url": s3_endpoint}
    assert run("demo", "local-dir-never-made").exit_code == 4
    assert seen["options"] is None  # a local path takes none


def test_a_signed_export_from_an_s3_store_names_its_url(
        saved: tuple[str, dict[str, torch.Tensor]], s3_endpoint: str, tmp_path: Path) -> None:
    """``export --sign`` reads an S3 store like any export; its lineage names the URL and
    model-signing's verifier accepts the artifact."""
    pytest.importorskip("model_signing.signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from model_signing import verifying

    url, weights = saved
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "k.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    out = tmp_path / "release"
    result = run("--storage-option", f"endpoint_url={s3_endpoint}", "export", url, "r@1",
                 str(out), "--sign", str(tmp_path / "k.pem"))
    assert result.exit_code == 0, result.output
    verifying.Config().use_elliptic_key_verifier(public_key=tmp_path / "k.pub").verify(
        out, out / "model.sig")
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["source"]["store"] == url and lineage["source"]["step"] == 1
    assert safetensors_torch.load_file(out / "model.safetensors").keys() == weights.keys()
