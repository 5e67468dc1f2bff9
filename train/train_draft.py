"""Train a DSpark or DFlash drafter.

Usage: `python -m train.train_draft --config configs/train/dspark.yaml [--set section.field=value]`.

Reads a `specjax.training.config.TrainConfig` YAML (`--set section.field=value` overrides), loads
the target checkpoint, builds the drafter with frozen copies of the target's embedding and
lm_head, and trains it on an offline target cache (`data.mode: cache`, made by
`python -m train.build_cache`) or online from chat JSONL (`data.mode: online`: the frozen target
runs inside the jitted step). Resumes from the latest checkpoint in `checkpoint.directory`;
SIGTERM / SIGINT save a checkpoint and exit with status 0.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from specjax import sharding as shd
from specjax.config import ConfigError
from specjax.training.config import TrainConfig, load_train_config, train_config_dict


def _mesh(cfg: TrainConfig):
    m = cfg.mesh
    n = len(jax.devices())
    fsdp = m.fsdp or max(1, n // (m.data * m.tensor))
    if m.data * fsdp * m.tensor > n:
        raise ConfigError(f"mesh data={m.data} x fsdp={fsdp} x tensor={m.tensor} needs more than "
                          f"the {n} available devices")
    return shd.train_mesh(m.data, fsdp, m.tensor)


class _SampleList:
    """Tokenised (ids, mask) pairs as dataset items."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        ids, mask = self.samples[i]
        return {"input_ids": ids, "loss_mask": mask}


class Run(NamedTuple):
    trainer: Any  # specjax.training.trainer.Trainer
    data: Any  # EpochBatches
    drafter_config: Any  # BlockDrafterConfig
    tap_layers: tuple[int, ...]
    target_graphdef: Any  # online mode: the frozen target's graph (its params are trainer aux)


def build(cfg: TrainConfig, *, mesh=None) -> Run:
    """Everything a run needs (trainer, data iterator, drafter config); nothing trained yet."""
    from specjax import hf
    from specjax.drafters.block import BlockDrafterConfig, default_target_layer_ids
    from specjax.drafters.dspark import make_block_drafter
    from specjax.training import features as feat
    from specjax.training.trainer import (EpochBatches, Trainer, block_drafter_loss,
                                          collate_block_batch)

    mc, dc = cfg.model, cfg.data
    mesh = mesh if mesh is not None else _mesh(cfg)
    target, tcfg = hf.load_target(mc.target, dtype=mc.target_dtype)
    layer_ids = tuple(mc.target_layer_ids) or default_target_layer_ids(tcfg.num_hidden_layers)
    dcfg = BlockDrafterConfig.from_target(
        tcfg, target_layer_ids=layer_ids, mask_token_id=mc.mask_token_id,
        num_draft_layers=mc.num_draft_layers, block_size=mc.block_size,
        markov_rank=mc.markov_rank, markov_head_type=mc.markov_head_type,
        confidence_head=mc.confidence_head,
        confidence_head_with_markov=mc.confidence_head_with_markov and mc.markov_rank > 0)
    drafter = make_block_drafter(target, tcfg, dcfg, rngs=nnx.Rngs(mc.init_seed),
                                 dtype=mc.compute_dtype, param_dtype=mc.param_dtype)
    identity = feat.target_identity(mc.target, tcfg)
    aux, target_graphdef = None, None
    if dc.mode == "cache":
        dataset = feat.TargetCache(dc.cache_dir, expect_layers=layer_ids,
                                   expect_hidden=tcfg.hidden_size, expect_target=identity)
        del target
    else:
        tok = hf.load_tokenizer(dc.tokenizer or mc.target)
        samples = feat.read_jsonl_samples(
            dc.train_jsonl, tok, max_length=dc.max_length, min_loss_tokens=dc.min_loss_tokens,
            system_prompt=dc.system_prompt, enable_thinking=dc.enable_thinking)
        dataset = _SampleList(samples)
        target_graphdef, aux = nnx.split(target)
    collate = functools.partial(collate_block_batch, buckets=dc.length_buckets,
                                max_length=dc.max_length)
    data = EpochBatches(dataset, dc.batch_size, seed=dc.seed, collate=collate,
                        shuffle=dc.shuffle)
    total = cfg.schedule.resolve_total_steps(data.steps_per_epoch)
    loss_fn = block_drafter_loss(
        num_anchors=mc.num_anchors, alpha_ce=mc.alpha_ce, alpha_tv=mc.alpha_tv,
        alpha_conf=mc.alpha_conf if mc.confidence_head else 0.0, decay=mc.loss_decay,
        chunk_anchors=mc.chunk_anchors, target_graphdef=target_graphdef, tap_layers=layer_ids,
        feature_dtype=jnp.bfloat16)
    trainer = Trainer(drafter, loss_fn, optimizer=cfg.optimizer, total_steps=total, mesh=mesh,
                      aux=aux, grad_accum_steps=dc.grad_accum_steps, seed=cfg.seed,
                      checkpoint=cfg.checkpoint, logging=cfg.logging)
    return Run(trainer, data, dcfg, layer_ids, target_graphdef)


def _export(trainer, state, dcfg, out_dir: str) -> None:
    """Hugging Face style export when specjax.hf provides a drafter exporter."""
    from specjax import hf

    exporter = getattr(hf, "export_drafter", None)
    if exporter is None:
        print(f"note: specjax.hf has no export_drafter; skipped the export to {out_dir} "
              "(the orbax checkpoint holds the trained parameters)", file=sys.stderr)
        return
    exporter(trainer.model(state), dcfg, out_dir)
    print(f"exported the drafter to {out_dir}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.train_draft",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training YAML (configs/train/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: the schedule's)")
    args = p.parse_args(argv)
    try:
        cfg = load_train_config(args.config, args.overrides)
        trainer, data, dcfg = build(cfg)[:3]
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(cfg.checkpoint.directory, exist_ok=True)
    with open(os.path.join(cfg.checkpoint.directory, "train_config.yaml"), "w") as f:
        yaml.safe_dump(train_config_dict(cfg), f, sort_keys=False)
    print(json.dumps({"run": cfg.name, "total_steps": trainer.total_steps,
                      "steps_per_epoch": data.steps_per_epoch,
                      "grad_accum_steps": trainer.grad_accum_steps,
                      "devices": len(trainer.mesh.devices.flat)}), flush=True)
    try:
        result = trainer.fit(data, total_steps=args.steps)
    finally:
        trainer.close()
    if result.status == "preempted":
        print(f"preempted at step {result.step}; rerun the same command to resume", flush=True)
        return 0
    if cfg.export_dir:
        _export(trainer, result.state, dcfg, cfg.export_dir)
    print(f"done: {result.step} steps; last metrics {json.dumps(result.metrics)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
