"""The collector pause shared by saves, restores and commands (chunkstore.collector)."""

from __future__ import annotations

import gc
import threading

import click

from chunkstore.cli import cli, main
from chunkstore.collector import collector_paused


def test_overlapping_pauses_resume_the_collector_once_after_the_last() -> None:
    enabled = gc.isenabled()
    gc.enable()
    try:
        inside, leave = threading.Event(), threading.Event()

        def other() -> None:
            with collector_paused():
                inside.set()
                leave.wait(10)

        thread = threading.Thread(target=other)
        with collector_paused():
            thread.start()
            assert inside.wait(10)
        assert not gc.isenabled()  # the other thread's pause still holds
        leave.set()
        thread.join(10)
        assert gc.isenabled()
    finally:
        if not enabled:
            gc.disable()


def test_command_line_commands_run_with_the_collector_paused() -> None:
    seen: list[bool] = []

    @click.command("collector-probe")
    def probe() -> None:
        seen.append(gc.isenabled())

    enabled = gc.isenabled()
    gc.enable()
    cli.add_command(probe)
    try:
        main(["collector-probe"])
    except SystemExit as exc:
        assert exc.code == 0
    finally:
        cli.commands.pop("collector-probe")
        assert gc.isenabled()
        if not enabled:
            gc.disable()
    assert seen == [False]
