"""The job runs straight down: ``prepare`` resolves and checks the model config once, ``build`` builds that very
config, ``run`` trains the built job. In this process, one step of a two-layer tiny model."""

from __future__ import annotations

import torch.distributed as dist

import moeshard.train.config.layout as layout
from moeshard.train.config import load_config
from moeshard.train.job import run_job

TINY = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--parallel.ep_size=1",
    "--train.global_batch_size=2",
    "--train.micro_batch_size=2",
    "--train.steps=1",
    "--eval.every_steps=0",
    "--eval.at_start=false",
    "--logging.progress_bar=false",
    "--logging.tensorboard=false",
    "--logging.expert_load_every=0",
    "--checkpoint.save_final=false",
]


def test_the_built_job_trains_the_model_config_prepare_resolved(clean_env, monkeypatch, tmp_path):
    resolved = []
    real = layout.resolve_model_config

    def resolve(cfg):
        resolved.append(real(cfg))
        return resolved[-1]

    monkeypatch.setattr(layout, "resolve_model_config", resolve)  # check_layout's, the one prepare calls
    cfg = load_config(None, [*TINY, f"--logging.output_dir={tmp_path / 'out'}"])
    try:
        result = run_job(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len(resolved) == 1  # once, by prepare's layout check
    assert result["job"].model_config is resolved[0]  # built from it, not resolved again
    assert len(result["losses"]) == 1
