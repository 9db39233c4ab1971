"""Signed export with lineage: ``chunkstore export --sign KEY`` writes an artifact directory
that OpenSSF model-signing's own verifier accepts, and that it refuses once anything in
it changes; bad keys and taken targets are typed errors that write nothing; a killed
export leaves no artifact at OUT.

One store and one signed export, made once for the module, serve most tests (each
attack works on a copy of the artifact); keys are made with ``cryptography`` directly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("model_signing.signing")
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, rsa  # noqa: E402
from model_signing import verifying  # noqa: E402

import chunkstore  # noqa: E402
from chunkstore.errors import InvalidInputError, MissingDependencyError, SigningKeyError  # noqa: E402
from torch_bridge import Checkpointer, export_artifact  # noqa: E402

nn = torch.nn
PASSWORD = "correct horse"
REPO = Path(__file__).resolve().parent.parent


def _write_key(directory: Path, name: str, key: Any, password: str | None = None) -> Path:
    """``key`` as NAME (PKCS#8 PEM, encrypted under ``password``) and NAME.pub."""
    encryption = (serialization.BestAvailableEncryption(password.encode()) if password
                  else serialization.NoEncryption())
    path = directory / name
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8, encryption))
    (directory / f"{name}.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("keys")
    return {
        "p256": _write_key(where, "p256.pem", ec.generate_private_key(ec.SECP256R1()),
                           PASSWORD),
        "p384": _write_key(where, "p384.pem", ec.generate_private_key(ec.SECP384R1())),
        "k1": _write_key(where, "k1.pem", ec.generate_private_key(ec.SECP256K1())),
        "rsa": _write_key(where, "rsa.pem", rsa.generate_private_key(65537, 2048)),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run of three saves (model, Adam after a step, sampler-free) with a dataset id."""
    where = tmp_path_factory.mktemp("store")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    store = where / "s"
    with Checkpointer(store, run="exp", meta={"dataset": "toy-v2", "code_rev": "abc123"}
                      ) as ckpt:
        for step in (1, 2, 3):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            ckpt.save(step, model=model, optimizer=optimizer)
    with chunkstore.open(store) as opened:
        versions = {v.step: v for v in opened.versions()}
    return {"store": store, "versions": versions,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def artifact(saved: dict[str, Any], keys: dict[str, Path],
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("export") / "signed"
    summary = export_artifact(saved["store"], "exp@3", out, dtype="bfloat16",
                              sign_with=keys["p256"], key_password=PASSWORD)
    return out, summary


def _verify(directory: Path, public_key: Path) -> None:
    """model-signing's own verifier (its Python API); raises on any mismatch."""
    verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(
        directory, directory / "model.sig")


def _copy(artifact: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    copy = tmp_path / artifact[0].name
    shutil.copytree(artifact[0], copy)
    return copy


def test_the_signed_export_verifies_with_model_signing(
        artifact: tuple[Path, dict[str, Any]], keys: dict[str, Path],
        saved: dict[str, Any]) -> None:
    out, summary = artifact
    assert sorted(p.name for p in out.iterdir()) == [
        "lineage.json", "model.safetensors", "model.sig"]
    assert summary["signed"] and summary["version"] == saved["versions"][3].id
    _verify(out, Path(f"{keys['p256']}.pub"))
    loaded = safetensors_torch.load_file(out / "model.safetensors")
    assert loaded.keys() == saved["weights"].keys()  # optimizer state and RNG stripped
    for name, tensor in saved["weights"].items():
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16))


def test_the_lineage_names_the_version_and_what_was_done(
        artifact: tuple[Path, dict[str, Any]], saved: dict[str, Any]) -> None:
    lineage = json.loads((artifact[0] / "lineage.json").read_text())
    version = saved["versions"][3]
    source = lineage["source"]
    assert source["store"] == os.path.abspath(saved["store"])
    assert (source["version"], source["run"], source["step"]) == (version.id, "exp", 3)
    assert source["root"] == version.root.hex
    assert [p["id"] for p in source["parents"]] == [saved["versions"][2].id,
                                                    saved["versions"][1].id]
    assert not source["parents_cut"]
    assert lineage["code"]["code_rev"] == "abc123" and lineage["dataset"] == "toy-v2"
    assert lineage["saved_with"]["torch"] == torch.__version__
    assert lineage["environment"]["model_signing"].startswith("1.1.")
    done = lineage["export"]
    assert (done["dtype_cast"], done["tensors"], done["tensors_cast"]) == ("bfloat16", 4, 4)
    assert done["stripped"]["optimizer"]["tensors"] == 12  # step, exp_avg, exp_avg_sq x 4
    assert done["stripped"]["rng"]["tensors"] >= 1
    assert lineage["signature"]["hash"] == "sha256"
    assert lineage["signature"]["curve"] == "P-256"


@pytest.mark.parametrize("change", ["one byte of the weights", "the lineage", "a file added",
                                    "the lineage removed"])
def test_verification_fails_after_any_change(change: str, tmp_path: Path,
                                             artifact: tuple[Path, dict[str, Any]],
                                             keys: dict[str, Path]) -> None:
    copy = _copy(artifact, tmp_path)
    if change == "one byte of the weights":
        weights = copy / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01  # a bit of the last tensor's bytes: the file still loads
        weights.write_bytes(bytes(data))
        assert safetensors_torch.load_file(weights).keys()
    elif change == "the lineage":
        lineage = json.loads((copy / "lineage.json").read_text())
        lineage["source"]["step"] = 4
        (copy / "lineage.json").write_text(json.dumps(lineage, indent=2) + "\n")
    elif change == "a file added":
        (copy / "preprocess.py").write_text("import os\n")
    else:
        (copy / "lineage.json").unlink()
    with pytest.raises(ValueError, match="Signature mismatch"):
        _verify(copy, Path(f"{keys['p256']}.pub"))


def test_another_keys_public_key_is_refused(artifact: tuple[Path, dict[str, Any]],
                                            keys: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="Key mismatch"):
        _verify(artifact[0], Path(f"{keys['p384']}.pub"))


def test_the_cli_signs_and_the_model_signing_command_verifies(
        saved: dict[str, Any], keys: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the chunkstore command (its lazy export command), with a P-384 key; the
    ``model_signing`` console script accepts the artifact, and a one-byte change fails it."""
    from chunkstore.cli import cli

    out = tmp_path / "cli-artifact"
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    result = CliRunner().invoke(cli, ["export", str(saved["store"]), "exp@2", str(out),
                                      "--sign", str(keys["p384"]), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["files"] == ["lineage.json", "model.safetensors",
                                                  "model.sig"]
    command = [str(Path(sys.executable).parent / "model_signing"), "verify", "key",
               "--signature", str(out / "model.sig"), "--public_key", f"{keys['p384']}.pub",
               str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stderr
    # The password: from --key-password-file, or $CHUNKSTORE_KEY_PASSWORD.
    for args, env in ((["--key-password-file", str(password_file)], None),
                      ([], PASSWORD)):
        if env is not None:
            monkeypatch.setenv("CHUNKSTORE_KEY_PASSWORD", env)
        result = CliRunner().invoke(cli, ["export", str(saved["store"]), "exp@2", str(out),
                                          "--sign", str(keys["p256"]), "--force", *args])
        assert result.exit_code == 0, result.output
        _verify(out, Path(f"{keys['p256']}.pub"))


def test_bad_keys_are_typed_errors_that_write_nothing(
        saved: dict[str, Any], keys: dict[str, Path], tmp_path: Path) -> None:
    from chunkstore.cli import cli

    out = tmp_path / "never"
    (tmp_path / "garbage.pem").write_text("-----BEGIN PRIVATE KEY-----\nnope\n")
    cases = [
        (keys["p256"], None, "password was not given.*--key-password-file"),
        (keys["p256"], "wrong", "wrong password"),
        (keys["rsa"], None, "RSAPrivateKey, not an ECDSA key.*chunkstore keygen"),
        (keys["k1"], None, "curve secp256k1 is not one of P-256, P-384, P-521"),
        (tmp_path / "missing.pem", None, "cannot read the key file"),
        (tmp_path / "garbage.pem", None, "not a PEM private key"),
    ]
    for key, password, message in cases:
        with pytest.raises(SigningKeyError, match=f"(?i){message}"):
            export_artifact(saved["store"], "exp@3", out, sign_with=key, key_password=password)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.pem"]
    result = CliRunner().invoke(cli, ["export", str(saved["store"]), "exp@3", str(out),
                                      "--sign", str(keys["rsa"])])
    assert result.exit_code == 2 and "not an ECDSA key" in result.output
    result = CliRunner().invoke(cli, ["export", str(saved["store"]), "exp@3", str(out),
                                      "--key-password-file", str(tmp_path / "garbage.pem")])
    assert result.exit_code == 2 and "give --sign KEY" in result.output
    assert not out.exists()


def test_a_key_file_replaced_while_exporting_is_refused(
        saved: dict[str, Any], keys: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """model-signing loads the key from its path again: a key file replaced after the
    export loaded it would sign with another key than the lineage names; refused."""
    from torch_bridge.tools import signing

    key = tmp_path / "key.pem"
    shutil.copy(keys["p384"], key)
    load = signing.load_signing_key

    def load_then_replace(path: Any, password: Any = None) -> Any:
        loaded = load(path, password)
        _write_key(tmp_path, "key.pem", ec.generate_private_key(ec.SECP256R1()))
        return loaded

    monkeypatch.setattr(signing, "load_signing_key", load_then_replace)
    out = tmp_path / "out"
    with pytest.raises(SigningKeyError, match="the key file changed"):
        export_artifact(saved["store"], "exp@3", out, sign_with=key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.pem", "key.pem.pub"]


def test_missing_model_signing_is_a_typed_error_with_the_install_command(
        saved: dict[str, Any], keys: dict[str, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "model_signing" or
                 n.startswith("model_signing.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "model_signing", None)  # import fails as if absent
    with pytest.raises(MissingDependencyError, match=r"needs model-signing .*\[sign\] extra"
                       r".*install it with: pip install 'model-signing>=1.1.1,<1.2' pyOpenSSL"):
        export_artifact(saved["store"], "exp@3", tmp_path / "out", sign_with=keys["p384"])
    from chunkstore.cli import cli

    result = CliRunner().invoke(cli, ["export", str(saved["store"]), "exp@3",
                                      str(tmp_path / "out"), "--sign", str(keys["p384"])])
    assert result.exit_code == 2 and "install it with: pip install" in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_is_refused_without_force_and_only_an_artifact_replaced(
        saved: dict[str, Any], keys: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InvalidInputError, match="exists; pass --force"):
        export_artifact(saved["store"], "exp@3", out, sign_with=keys["p384"])
    with pytest.raises(InvalidInputError, match=r"more than an export artifact \(notes.txt\)"):
        export_artifact(saved["store"], "exp@3", out, sign_with=keys["p384"], overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    # An unsigned artifact (--lineage) is replaced by a signed one, which verifies.
    export_artifact(saved["store"], "exp@1", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["lineage.json", "model.safetensors"]
    assert json.loads((out / "lineage.json").read_text())["signature"] is None
    export_artifact(saved["store"], "exp@3", out, sign_with=keys["p384"], overwrite=True)
    _verify(out, Path(f"{keys['p384']}.pub"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left


def test_removed_parents_end_the_chain(tmp_path: Path) -> None:
    """A plain numpy store: every ancestor named until one that was removed."""
    import numpy as np

    store = tmp_path / "s"
    with chunkstore.open(store, create=True) as opened:
        for step in (1, 2, 3):
            with opened.new_version(run="r", step=step) as version:
                version.put("model.w", np.full(4, step, dtype=np.float32))
        first = opened.resolve("r@1").id
        opened.delete("r@1")
    export_artifact(store, "r@3", tmp_path / "out")
    source = json.loads((tmp_path / "out" / "lineage.json").read_text())["source"]
    assert [p.get("step") for p in source["parents"]] == [2, None]
    assert source["parents"][1] == {"id": first, "removed": True}
    assert json.loads((tmp_path / "out" / "lineage.json").read_text())["code"] is None


KILLED_CHILD = textwrap.dedent("""
    import sys, time
    from torch_bridge.tools import artifact, signing

    def stalled(*args):  # the weights and lineage are written
        print("signing", flush=True)
        time.sleep(60)

    artifact.signing.sign_directory = stalled
    artifact.export_artifact(sys.argv[1], "exp@3", sys.argv[2], sign_with=sys.argv[3])
""")


def test_a_sigkilled_export_leaves_no_artifact(saved: dict[str, Any], keys: dict[str, Path],
                                               tmp_path: Path) -> None:
    """SIGKILL while signing (the weights and lineage written, the signature not): OUT
    does not exist, and what is left is a hidden staging directory with no signature."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(saved["store"]),
                           str(out), str(keys["p384"])], stdout=subprocess.PIPE,
                          text=True, env=env) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "signing"
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
    assert not out.exists()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".out.export-")
    staged = left[0] / "out"
    assert sorted(p.name for p in staged.iterdir()) == ["lineage.json", "model.safetensors"]
    export_artifact(saved["store"], "exp@3", out, sign_with=keys["p384"])
    _verify(out, Path(f"{keys['p384']}.pub"))


def test_an_encrypted_store_exports_signed_with_its_own_password_apart(
        keys: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's password and the key's are two things: each from its own source."""
    import numpy as np

    from chunkstore.cli import cli
    from chunkstore.objects.keys import TEST_KDF_ENV

    monkeypatch.setenv(TEST_KDF_ENV, "1")
    monkeypatch.setenv("CHUNKSTORE_PASSWORD", "store password")
    store = tmp_path / "s"
    with chunkstore.open(store, create=True, encrypt=True) as opened:
        with opened.new_version(run="r", step=1, meta={"dataset": "secret-set"}) as version:
            version.put("model.w", np.arange(6, dtype=np.float32))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["export", str(store), "r@1", str(out), "--sign",
                                      str(keys["p256"])])
    assert result.exit_code == 2 and "--key-password-file" in result.output
    monkeypatch.setenv("CHUNKSTORE_KEY_PASSWORD", PASSWORD)
    result = CliRunner().invoke(cli, ["export", str(store), "r@1", str(out), "--sign",
                                      str(keys["p256"])])
    assert result.exit_code == 0, result.output
    _verify(out, Path(f"{keys['p256']}.pub"))
    assert json.loads((out / "lineage.json").read_text())["dataset"] == "secret-set"
