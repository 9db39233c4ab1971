"""The torch commands of the ``chunkstore`` CLI: ``demo``, ``export`` and ``plan``.

Each is a standalone click command; ``chunkstore.cli`` loads this module only
when one of them runs, and this module loads torch only inside the commands
that need it, so ``chunkstore --help`` never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from chunkstore.cli import (
    EXIT_FAILURE,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    exit_code_for,
    format_size,
    missing_dependency,
    plural,
)
from chunkstore.cli import CliError as CommandError
from chunkstore.cli.common import open_any, storage_options_for
from chunkstore.errors import ChunkStoreError
from chunkstore.handle.encryption import read_password_file

if TYPE_CHECKING:
    from chunkstore import Store
    from torch_bridge.tools.plan import Plan


@contextlib.contextmanager
def _errors(command: str, extra: str = "torch") -> Iterator[None]:
    """Errors become one ``chunkstore: error:`` line with the core CLI's exit codes
    (these commands also run standalone, outside the ``chunkstore`` group); a
    missing torch (or safetensors) names the extra that installs it."""
    try:
        yield
    except ChunkStoreError as exc:
        raise CommandError(str(exc), exit_code_for(exc)) from exc
    except ImportError as exc:
        error = missing_dependency(command, exc, extra)
        if error is None:
            raise
        raise error from exc
    except (OSError, RuntimeError) as exc:
        raise CommandError(str(exc), EXIT_FAILURE) from exc


# --- demo -----------------------------------------------------------------------------------


#: Where ``chunkstore demo`` takes its seed from when --seed is not given.
DEMO_SEED_ENV_VAR = "CHUNKSTORE_DEMO_SEED"


@click.command()
@click.argument("path", required=False)
@click.option("--seed", type=click.IntRange(min=0), envvar=DEMO_SEED_ENV_VAR,
              help="Draw the kill point from this seed (default: a fresh one from"
                   f" os.urandom, printed; also ${DEMO_SEED_ENV_VAR}).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the outcome as JSON (the progress lines go to stderr).")
def demo(path: str | None, seed: int | None, as_json: bool) -> None:
    """Kill a training job at a random moment, resume it, and prove the result is bit-exact.

    Trains a small model on the CPU (a frozen 4 MiB backbone under a trained
    head with dropout; Adam, a learning-rate schedule, a shuffling data loader)
    three ways: uninterrupted in this process; in a subprocess with an async
    checkpoint every 2 steps, SIGKILLed at a random point of the second half of
    training (between saves, or while a save is in flight: the output says
    which, and the seed that drew it); and resumed from the newest checkpoint
    that verifies. Compares parameters, optimizer state, per-step losses and
    consumed example ids bit for bit against the uninterrupted run.

    Then says what one checkpoint holds and what the checkpoints took on disk
    against torch.save, for this job (most of each save is the frozen
    backbone: the best case) and for the same job with every weight training
    (the dense case, 8 saves into a temporary store).

    PATH is a new store directory (default: a temporary one, removed
    afterwards). Takes well under a minute.

    \b
    Examples:
      chunkstore demo
      chunkstore demo --seed 1234
      chunkstore demo ./demo-store && chunkstore log ./demo-store

    \b
    Exit codes: 0 the resumed run matched; 1 it did not (or verify failed);
    2 PATH is not empty, or PyTorch is not installed; 4 failure.
    """
    say = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    with _errors("demo"), _demo_dir(path) as where:
        if os.path.exists(where) and os.listdir(where):
            raise CommandError(f"{where} is not empty; give a new directory", EXIT_USAGE)
        from torch_bridge.tools.demo import run_demo

        result = run_demo(where, say=say, storage_options=storage_options_for(where),
                          seed=seed)
        say("")
        for line in _demo_summary(result):
            say(line)
        if path is None:
            say("the store was temporary and is removed now; to keep one and try the"
                " other commands on it: chunkstore demo ./demo-store &&"
                " chunkstore report ./demo-store")
        if as_json:
            click.echo(json.dumps(result.to_json(), indent=2))
        if not result.matched:
            raise SystemExit(EXIT_PROBLEMS)


def _demo_summary(result: object) -> list[str]:
    from torch_bridge.tools.demo import DemoResult

    assert isinstance(result, DemoResult)
    verdict = ("IDENTICAL: parameters, optimizer state, per-step losses and example ids"
               " match the uninterrupted run bit for bit" if not result.differences
               else "DIFFERENT: " + ", ".join(result.differences[:8]))
    lines = [
        verdict,
        f"store: {plural(result.versions, 'version')} of {format_size(result.logical_bytes)};"
        f" verify {'ok' if result.verify_ok else 'FAILED'}",
        "storage against torch.save of the same checkpoints:",
    ]
    for label, figure in (("frozen-base model (this job: the best case)", result.frozen),
                          ("dense model (every weight trains)", result.dense)):
        if figure is not None:
            lines.append(_figure_line(label, figure))
    return lines


def _figure_line(label: str, figure: object) -> str:
    from torch_bridge.tools.demo import StorageFigure

    assert isinstance(figure, StorageFigure)
    return (f"  {label}: {plural(figure.versions, 'checkpoint')}, torch.save"
            f" {format_size(figure.torch_save_bytes)}, chunkstore stored"
            f" {format_size(figure.stored_bytes)}: {figure.ratio:.2f}x less (chunks stored"
            f" once {figure.dedup:.2f}x, compression {figure.compression:.2f}x)")


@contextlib.contextmanager
def _demo_dir(path: str | None) -> Iterator[str]:
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="chunkstore-demo-") as tmp:
        yield os.path.join(tmp, "store")


# --- export ---------------------------------------------------------------------------------


#: Where ``chunkstore export --sign`` takes the key's password from when
#: --key-password-file is not given.
KEY_PASSWORD_ENV_VAR = "CHUNKSTORE_KEY_PASSWORD"


@click.command()
@click.argument("store_path", metavar="STORE")
@click.argument("selector")
@click.argument("out", type=click.Path())
@click.option("--prefix", default="model.", show_default=True,
              help="Export the tensors whose entry names start with this; it is removed"
                   " from the names (a model's tensors get their state_dict keys).")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]),
              help="Cast floating-point tensors to this dtype.")
@click.option("--sign", "key", type=click.Path(dir_okay=False), metavar="KEY",
              help="Write OUT as a signed artifact directory (weights, lineage.json and an"
                   " OpenSSF model-signing signature, model.sig) with this ECDSA private"
                   " key (PEM, P-256/384/521: `chunkstore keygen KEY` makes one).")
@click.option("--key-password-file", type=click.Path(dir_okay=False),
              help="The --sign key's password: the first line of this file (else"
                   f" ${KEY_PASSWORD_ENV_VAR}).")
@click.option("--lineage", is_flag=True,
              help="Write OUT as an unsigned artifact directory (weights and lineage.json),"
                   " to sign with another tool (model_signing sign DIR).")
@click.option("--force", is_flag=True,
              help="Replace OUT if it exists (refused otherwise; a directory only if it"
                   " holds an artifact's files alone).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def export(store_path: str, selector: str, out: str, prefix: str, dtype: str | None,
           key: str | None, key_password_file: str | None, lineage: bool, force: bool,
           as_json: bool) -> None:
    """Write a version's weights to a safetensors file (optimizer and the rest stripped).

    SELECTOR is a version id (or unique prefix), RUN@STEP, RUN@latest, latest or
    a tag. The file loads with safetensors.torch.load_file; every tensor is
    hash-verified on the way out, and the file appears only when complete.

    With --sign KEY (or --lineage), OUT is a directory: model.safetensors,
    lineage.json (store, version, run, step, parent versions, code revision,
    dataset, environment, dtype cast, what was stripped) and, signed, model.sig:
    a signature over both in the OpenSSF model-signing format (SHA-256, the
    key's ECDSA curve), which `model_signing verify key` checks. It appears
    whole or not at all.

    \b
    Examples:
      chunkstore export ckpts/ exp1@latest model.safetensors
      chunkstore export ckpts/ best model-fp16.safetensors --dtype float16
      chunkstore export ckpts/ best model-signed/ --sign key.pem
      model_signing verify key --signature model-signed/model.sig \\
          --public_key key.pem.pub model-signed/

    \b
    Exit codes: 0 written; 2 bad store, selector, prefix or key, OUT exists, or
    PyTorch, safetensors or (--sign) model-signing not installed; 3 damaged
    data; 4 failure.
    """
    with _errors("export", extra="export"):
        if key is None and key_password_file is not None:
            raise CommandError("--key-password-file is for the --sign key; give --sign KEY",
                               EXIT_USAGE)
        with open_any(store_path, create=False) as store:
            summary = _export(store, selector, out, prefix, dtype, key,
                              _key_password(key, key_password_file), lineage, force)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        made = (f" ({'signed' if summary['signed'] else 'unsigned'} artifact:"
                f" {', '.join(summary['files'])})" if "files" in summary else "")
        click.echo(f"wrote {plural(summary['tensors'], 'tensor')}"
                   f" ({format_size(summary['bytes'])}) of"
                   f" {summary['version'][:12]} (step {summary['step']}) to {out}{made}")


def _export(store: Store, selector: str, out: str, prefix: str, dtype: str | None,
            key: str | None, key_password: str | None, lineage: bool,
            force: bool) -> dict[str, Any]:
    if key is None and not lineage:
        from torch_bridge.tools.export import export_safetensors

        return export_safetensors(store, selector, out, prefix=prefix, dtype=dtype,
                                  overwrite=force)
    from torch_bridge.tools.artifact import export_artifact

    return export_artifact(store, selector, out, prefix=prefix, dtype=dtype, sign_with=key,
                           key_password=key_password, overwrite=force)


def _key_password(key: str | None, path: str | None) -> str | None:
    if key is None:
        return None
    if path is not None:
        return read_password_file(path)
    return os.environ.get(KEY_PASSWORD_ENV_VAR) or None


# --- plan -----------------------------------------------------------------------------------


@click.command()
@click.option("--save-seconds", type=float, required=True,
              help="How long one save pauses training, in seconds.")
@click.option("--mtbf", type=float, required=True,
              help="Mean time between failures (preemptions, crashes) of the job, in hours.")
@click.option("--step-seconds", type=float,
              help="Seconds per training step, to express the interval in steps.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(save_seconds: float, mtbf: float, step_seconds: float | None, as_json: bool) -> None:
    """How often to checkpoint: the interval that minimises pause cost plus lost work.

    Saving more often costs more pauses; saving less often loses more work at
    each failure. The optimum is Young's sqrt(2 x save cost x MTBF), refined by
    Daly. Measure the save cost as the pause your loop sees (with async saves,
    the staging copy, not the write). When a save costs so much against the
    time between failures that even the best interval loses as much time as
    it saves (expected overhead of 100% or more), it says that no interval
    makes sense instead of naming one (--json: "sensible": false, the
    interval null, "warning" saying why). Needs no PyTorch.

    \b
    Examples:
      chunkstore plan --save-seconds 2 --mtbf 6
      chunkstore plan --save-seconds 0.4 --mtbf 1.5 --step-seconds 0.25 --json

    \b
    Exit codes: 0 planned (also when no interval makes sense); 2 bad input.
    """
    from torch_bridge.tools.plan import plan as make_plan

    with _errors("plan"):
        result = make_plan(save_seconds, mtbf, step_seconds)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.warning is not None:
        click.echo(result.warning)
    else:
        _plan_text(result)


def _plan_text(result: Plan) -> None:
    click.echo(f"save every {result.daly_seconds:.1f} s"
               + (f" (every {plural(result.steps, 'step')})" if result.steps is not None else "")
               + f"; Young's first-order interval: {result.young_seconds:.1f} s")
    click.echo(f"expected overhead at that interval: {100 * result.overhead:.2f}% of run time"
               " (pauses plus work redone after failures)")
