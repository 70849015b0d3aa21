"""The hang watchdog: past its timeout one rank reports, in one line, the ranks that did not arrive and every rank's
last finished step (the real end-to-end case, a stopped worker of a torchrun job, is in the app's recovery tests)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch.distributed as dist

from moeshard.checkpoint import HangWatchdog
from moeshard.checkpoint._watchdog import describe_hang, main_thread_location


def test_the_report_names_the_ranks_that_did_not_arrive_and_every_rank_s_last_step(world_of_one):
    store = dist.HashStore()
    fired, lines, done = threading.Event(), [], threading.Event()
    dog = HangWatchdog(0.4, init_timeout_s=30, store=store, key="train.timeout_s", console=lines.append)
    dog.on_fire, dog.settle_s = (lambda line: fired.set()), 0.5
    # Two peers seen through the store: rank 1 runs (its watchdog counts) but finished only step 6; rank 2's
    # process stopped (its counter stands still) before it finished a step.
    dog.world = 3
    store.set("moeshard/last_step/1", "6")

    def rank_1_alive():
        while not done.wait(0.1):
            store.add("moeshard/alive/1", 1)

    threading.Thread(target=rank_1_alive, daemon=True).start()
    with dog:
        for step in range(1, 8):
            dog.beat(step)
            time.sleep(0.02)
        assert fired.wait(10)
    done.set()
    assert len(lines) == 1 and re.fullmatch(
        r"rank 2 did not arrive \(its process stopped running: stopped, frozen or its host gone\); rank 1 did not "
        r"arrive \(behind the others' steps\); no step ended for 0\.\d s \(train\.timeout_s 0\.4\); last finished "
        r"step per rank \{0: 7, 1: 6, 2: none\}; stopping the job: nothing partial is published, resume: auto "
        r"continues from the newest complete checkpoint",
        lines[0],
    ), lines
    # Another rank of the same job fires later: it leaves the report to the first one.
    late = HangWatchdog(0.4, store=store, console=lines.append)
    assert late.report(1.0) == ""


def test_steps_that_keep_ending_never_fire_and_zero_is_off(world_of_one):
    fired = []
    with HangWatchdog(0.3, init_timeout_s=30, on_fire=fired.append, console=fired.append) as dog:
        for step in range(1, 15):
            dog.beat(step)
            time.sleep(0.05)
    assert fired == []
    with HangWatchdog(0, on_fire=fired.append) as off:
        assert off._thread is None
    with pytest.raises(ValueError, match="must be >= 0"):
        HangWatchdog(-1)


def test_a_rank_stuck_before_a_collective_is_named_with_where_it_is():
    where = {
        0: "in a collective at distributed/distributed_c10d.py:2950 in all_reduce",
        1: "at train/train.py:310 in train_step",
        2: "in a collective at _fully_shard/_fsdp_collectives.py:290 in wait_for_unshard",
    }
    line = describe_hang({0: 7, 1: 7, 2: 7}, [], where, idle=20.3, key="train.timeout_s", timeout_s=20)
    assert line.startswith(
        "rank 1 (at train/train.py:310 in train_step) did not arrive (the others wait in a collective); no step "
        "ended for 20.3 s (train.timeout_s 20); last finished step per rank {0: 7, 1: 7, 2: 7}; stopping the job"
    )
    # every rank in a collective, none behind: said as such
    same = {r: where[0] for r in range(3)}
    assert describe_hang({0: 7, 1: 7, 2: 7}, [], same, idle=20, key="k", timeout_s=20).startswith(
        "no rank is behind: every rank finished step 7 and runs, none finished the next"
    )
    assert main_thread_location().startswith("at ")  # this thread is the main thread, in this test's code
