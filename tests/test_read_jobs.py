"""The read jobs of one read call (chunkstore.read.reader.run_jobs): the calling thread
takes jobs beside the pool's, every job is done before the call returns, the first
failure in job order is raised, and an interrupt of the calling thread stops the call."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from chunkstore.read.reader import run_jobs


def test_a_single_job_runs_in_the_calling_thread_without_the_pool() -> None:
    pool = ThreadPoolExecutor(2)
    pool.shutdown()  # any submit now raises RuntimeError
    ran_on: list[int] = []
    run_jobs(pool, [lambda: ran_on.append(threading.get_ident())], 4)
    assert ran_on == [threading.get_ident()]


def test_every_job_runs_and_the_calling_thread_takes_some() -> None:
    done: list[tuple[int, int]] = []

    def job(number: int) -> None:
        time.sleep(0.002)
        done.append((number, threading.get_ident()))

    with ThreadPoolExecutor(4) as pool:
        run_jobs(pool, [lambda n=n: job(n) for n in range(40)], 3)
    assert sorted(number for number, _ in done) == list(range(40))
    threads = {thread for _, thread in done}
    assert threading.get_ident() in threads
    assert len(threads) <= 3  # at most at_once at a time: the caller and two pool jobs


def test_the_first_failure_in_job_order_is_raised_after_every_job_ran() -> None:
    ran: list[int] = []

    def job(number: int) -> None:
        ran.append(number)
        if number in (7, 3, 12):
            raise ValueError(f"job {number}")

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="job 3"):
            run_jobs(pool, [lambda n=n: job(n) for n in range(16)], 2)
    assert sorted(ran) == list(range(16))


def test_an_interrupt_in_the_calling_thread_stops_the_call_once_pool_jobs_are_done() -> None:
    caller = threading.get_ident()
    started: list[int] = []
    finished: list[int] = []

    def job(number: int) -> None:
        started.append(number)
        if threading.get_ident() == caller:
            raise KeyboardInterrupt
        time.sleep(0.02)
        finished.append(number)

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(KeyboardInterrupt):
            run_jobs(pool, [lambda n=n: job(n) for n in range(50)], 2)
        # Nothing still runs: the pool's job was done before the interrupt was raised ...
        assert len(finished) == len(started) - 1
        time.sleep(0.05)
        assert len(started) == len(finished) + 1
    # ... and the jobs not yet begun were dropped.
    assert len(started) < 10
