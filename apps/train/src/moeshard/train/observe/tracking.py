"""Experiment tracking beside TensorBoard: Weights & Biases (``logging.wandb``) and MLflow (``logging.mlflow``).

Both are optional extras (``pip install 'moeshard-train[wandb]'``, ``'moeshard-train[mlflow]'``), imported only when
their key is set, and work without a network: W&B's ``mode: offline`` writes under ``<output_dir>/wandb``
(``wandb sync`` uploads it later), MLflow's default tracking URI is the SQLite file ``<output_dir>/mlflow.db``
with artifacts in ``<output_dir>/mlartifacts`` (``mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db``). Rank 0 logs the resolved config, the code's version (the
git commit of a checkout, else the package version) and every scalar that ``MetricsLogger`` writes to
TensorBoard, at the same step. A resumed run continues the same tracked run: the ids are kept in
``<output_dir>/tracking.json``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

from moeshard.train.config import JobConfig, MlflowConfig, WandbConfig
from moeshard.train.errors import JobError

_EXTRA = {"wandb": "wandb", "mlflow": "mlflow"}  # logging key -> the module it needs (and the extra's name)


class Sink(Protocol):
    """Where ``MetricsLogger`` sends each step's scalars besides TensorBoard."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Record ``scalars`` (flat names, ``comm/all_to_all/ep/bytes``) at optimizer step ``step``."""

    def close(self) -> None:
        """Flush and end the run."""


def check_available(cfg: JobConfig) -> None:
    """Before the run (every rank alike): each enabled tracker's package is installed.

    Raises:
        JobError: naming the key and the extra to install.
    """
    for key, module in _EXTRA.items():
        missing = sys.modules.get(module) is None and importlib.util.find_spec(module) is None
        if getattr(cfg.logging, key) is not None and missing:
            raise JobError(
                f"logging.{key} is set but {module} is not installed: pip install 'moeshard-train[{key}]', or "
                f"remove logging.{key}"
            )


def code_version() -> dict[str, Any]:
    """``{"moeshard_train": version}``, plus ``git_commit`` (and ``git_dirty``) where this code lies in a git
    checkout that tracks it (not a wheel inside some other repository)."""
    try:
        out: dict[str, Any] = {"moeshard_train": version("moeshard-train")}
    except PackageNotFoundError:
        out = {"moeshard_train": "unknown"}
    here = Path(__file__).resolve()

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(here.parent), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    if git("ls-files", "--", "."):  # this package's folder is tracked by the repository around it
        commit = git("rev-parse", "HEAD")
        if commit:
            out["git_commit"] = commit
            out["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    return out


def open_sinks(cfg: JobConfig, output_dir: Path) -> list[Sink]:
    """Rank 0's trackers for this run (none unless ``logging.wandb`` / ``logging.mlflow`` is set)."""
    sinks: list[Sink] = []
    if cfg.logging.wandb is None and cfg.logging.mlflow is None:
        return sinks
    version = code_version()
    ids_file = output_dir / "tracking.json"
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
    if cfg.logging.wandb is not None:
        sinks.append(WandbSink(cfg.logging.wandb, cfg, output_dir, version, ids.get("wandb")))
        ids["wandb"] = sinks[-1].run_id
    if cfg.logging.mlflow is not None:
        sinks.append(MlflowSink(cfg.logging.mlflow, cfg, output_dir, version, ids.get("mlflow")))
        ids["mlflow"] = sinks[-1].run_id
    ids_file.write_text(json.dumps(ids, indent=1))
    return sinks


class WandbSink:
    """A W&B run: the config and code version in its config, each step's scalars as its history."""

    def __init__(
        self, c: WandbConfig, cfg: JobConfig, output_dir: Path, version: dict[str, Any], run_id: str | None
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=c.project,
            entity=c.entity,
            name=c.name or output_dir.resolve().name,
            group=c.group,
            tags=list(c.tags) or None,
            mode=c.mode,
            dir=str(output_dir),
            config={**cfg.to_dict(), "code": version},
            id=run_id,
            resume="allow",  # the same id after a resume: one run
        )
        self.run_id = getattr(self.run, "id", run_id)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """An MLflow run (through ``MlflowClient``: no process-wide active run): the flattened config as params, the
    code version as tags, ``config.yaml`` as an artifact, each step's scalars as metrics."""

    def __init__(
        self, c: MlflowConfig, cfg: JobConfig, output_dir: Path, version: dict[str, Any], run_id: str | None
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        here = output_dir.resolve()
        self.client = MlflowClient(tracking_uri=c.tracking_uri or f"sqlite:///{here / 'mlflow.db'}")
        if run_id is not None and self._exists(run_id):
            self.run_id = run_id  # a resumed run: its params are logged already (MLflow never changes them)
            return
        found = self.client.get_experiment_by_name(c.experiment)
        if found is not None:
            experiment = found.experiment_id
        else:  # artifacts beside the run, not in the working directory (MLflow's default)
            experiment = self.client.create_experiment(c.experiment, artifact_location=(here / "mlartifacts").as_uri())
        tags = {f"moeshard.{k}": str(v) for k, v in version.items()}
        run = self.client.create_run(experiment, run_name=c.run_name or here.name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:500]) for k, v in _flat(cfg.to_dict())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_dict(self.run_id, cfg.to_dict(), "config.yaml")

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - MlflowException when the store has no such run
            return False
        return True

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _mlflow_key(name: str) -> str:
    """MLflow's metric names take letters, digits and ``_-. :/``; anything else (a source's name) becomes ``_``."""
    return "".join(ch if ch.isalnum() or ch in "_-. :/" else "_" for ch in name)
