"""Fixtures shared by the app's tests."""

from __future__ import annotations

import contextlib
import os

import pytest

from moeshard.meshes import testing

# Every rank that run_distributed starts here imports the app (~1 s of CPU a rank on 2 cores, a few dozen ranks in
# this folder): its fork server imports it once instead (read when the server starts, at the first call).
testing.PRELOAD = (*testing.PRELOAD, "moeshard.train.job", "moeshard.models.qwen3moe", "moeshard.models.deepseekv3")

# What a run reads from its launcher; a test that runs a job in-process starts without any of it.
LAUNCH_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MOESHARD_FAULT",
    "MOESHARD_TRACEBACK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


@pytest.fixture(scope="session")
def without_launch_env():
    """A context manager: its body runs without the launcher's variables; the environment is restored after."""
    return _without_launch_env


@contextlib.contextmanager
def _without_launch_env():
    saved = dict(os.environ)
    for k in LAUNCH_ENV:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def clean_env():
    """The test runs without the launcher's variables; the whole environment is restored after it."""
    with _without_launch_env():
        yield
