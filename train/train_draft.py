"""Train a drafter: DSpark / DFlash, Eagle3, MTP-1 or a standalone draft LM.

Usage: `python -m train.train_draft --config configs/train/dspark.yaml [--set section.field=value]`.

Reads a `specjax.training.config.TrainConfig` YAML (`--set section.field=value` overrides), loads
the target checkpoint, builds the drafter of `model.kind` with frozen copies of the target's
embedding and lm_head (`specjax.training.objectives`), and trains it on an offline target cache
(`data.mode: cache`: DSpark / DFlash / Eagle3 / MTP-1, made by `python -m train.build_cache`) or online from chat
or {"prompt", "completion"} JSONL (`data.mode: online`: the frozen target runs inside the jitted
step). Resumes from the latest checkpoint in `checkpoint.directory`;
SIGTERM / SIGINT save a checkpoint and exit with status 0.

Multi-host (one process per host, `specjax.distributed`): run the same command on every host with
`--coordinator-address HOST:PORT --num-processes N --process-id I` (or on a TPU pod slice / SLURM
with their own settings); the mesh spans every process's devices and each process reads and feeds
only its slice of every global batch. Process 0 writes the logs, the config copy and the export.
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

from specjax import distributed as dist
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

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.samples]

    def __getitem__(self, i: int):
        ids, mask = self.samples[i]
        return {"input_ids": ids, "loss_mask": mask}


class Run(NamedTuple):
    trainer: Any  # specjax.training.trainer.Trainer
    data: Any  # EpochBatches
    drafter_config: Any  # the drafter's config (BlockDrafterConfig, Eagle3Config, MTPConfig, ...)
    tap_layers: tuple[int, ...]
    target_graphdef: Any  # online mode: the frozen target's graph (its params are trainer aux)


def build(cfg: TrainConfig, *, mesh=None, draft_ids=None) -> Run:
    """Everything a run needs (trainer, data iterator, drafter config); nothing trained yet.
    `draft_ids`: the draft vocabulary's target ids (required when model.draft_vocab_size > 0)."""
    from specjax import checkpoints
    from specjax.training import features as feat
    from specjax.training.cache_parts import open_target_caches
    from specjax.training.config import CACHE_KINDS
    from specjax.training.objectives import make_objective
    from specjax.training.data import EpochBatches, collate_block_batch
    from specjax.training.trainer import Trainer

    mc, dc = cfg.model, cfg.data
    mesh = mesh if mesh is not None else _mesh(cfg)
    if dc.mode == "cache" and mc.kind not in CACHE_KINDS:
        raise ConfigError(f"data.mode 'cache' supports kinds {CACHE_KINDS}; kind {mc.kind!r} "
                          f"trains online (data.mode: online)")
    target, tcfg = checkpoints.load_target(mc.target, dtype=mc.target_dtype)
    target_graphdef, aux = nnx.split(target)
    obj = make_objective(mc, target, tcfg, target_graphdef=target_graphdef,
                         feature_dtype=jnp.bfloat16, draft_ids=draft_ids)
    if dc.mode == "cache":
        identity = feat.target_identity(mc.target, tcfg)
        dataset = open_target_caches(  # MTP-1 reads only the final hidden state
            (dc.cache_dir, *dc.extra_cache_dirs),
            expect_layers=obj.tap_layers if mc.kind != "mtp" else None,
            expect_hidden=tcfg.hidden_size, expect_target=identity,
            cache_pool_bytes=dc.cache_pool_bytes)
        aux, target_graphdef = None, None
    else:
        tok = checkpoints.load_tokenizer(dc.tokenizer or mc.target)
        samples = feat.read_jsonl_samples(
            dc.train_jsonl, tok, max_length=dc.max_length, min_loss_tokens=dc.min_loss_tokens,
            system_prompt=dc.system_prompt, enable_thinking=dc.enable_thinking)
        dataset = _SampleList(samples)
    del target
    collate = functools.partial(collate_block_batch, buckets=dc.length_buckets,
                                max_length=dc.max_length)
    steps_per_epoch = EpochBatches(dataset, dc.batch_size).steps_per_epoch
    total = cfg.schedule.resolve_total_steps(steps_per_epoch)
    trainer = Trainer(obj.drafter, obj.loss_fn, optimizer=cfg.optimizer, total_steps=total,
                      mesh=mesh, aux=aux, grad_accum_steps=dc.grad_accum_steps, seed=cfg.seed,
                      checkpoint=cfg.checkpoint, logging=cfg.logging)
    # every process walks the same global batches and reads only the rows its devices hold
    data = EpochBatches(dataset, dc.batch_size, seed=dc.seed, collate=collate,
                        shuffle=dc.shuffle, rows=trainer.process_rows(dc.batch_size))
    return Run(trainer, data, obj.drafter_config, obj.tap_layers, target_graphdef)


def _export(trainer, state, dcfg, out_dir: str, *, target: Any = None,
            dtype: str | None = None) -> None:
    """Hugging Face style export (config.json + safetensors, DeepSpec names) of the drafter,
    written by process 0 (the parameters are first gathered onto every process)."""
    from specjax.drafters import registry

    if jax.process_count() > 1:
        state = jax.jit(lambda s: s, out_shardings=shd.replicated(trainer.mesh))(state)
    if dist.is_primary():
        registry.export_drafter(trainer.model(state), dcfg, out_dir, target_config=target, dtype=dtype)
        print(f"exported the drafter to {out_dir}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.train_draft",
                                description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="training YAML (configs/train/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: the schedule's)")
    p.add_argument("--draft-vocab", default=None, metavar="JSON",
                   help="draft vocabulary file ({\"draft_ids\": [...]}, written by the "
                        "embedded build's vocab stage); needed when model.draft_vocab_size > 0")
    p.add_argument("--export-dtype", default=None, choices=("float32", "bfloat16"),
                   help="tensor dtype of the export (default: the parameters' own)")
    dist.add_distributed_args(p)
    args = p.parse_args(argv)
    try:
        dist.initialize_from_args(args)
        cfg = load_train_config(args.config, args.overrides)
        draft_ids = None
        if args.draft_vocab:
            from specjax.training.build import read_draft_vocab

            draft_ids = read_draft_vocab(args.draft_vocab, size=cfg.model.draft_vocab_size)
        trainer, data, dcfg = build(cfg, draft_ids=draft_ids)[:3]
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.is_primary():
        os.makedirs(cfg.checkpoint.directory, exist_ok=True)
        with open(os.path.join(cfg.checkpoint.directory, "train_config.yaml"), "w") as f:
            yaml.safe_dump(train_config_dict(cfg), f, sort_keys=False)
    print(json.dumps({"run": cfg.name, "total_steps": trainer.total_steps,
                      "samples": len(data.dataset), "steps_per_epoch": data.steps_per_epoch,
                      "grad_accum_steps": trainer.grad_accum_steps,
                      "devices": len(trainer.mesh.devices.flat),
                      "process": f"{jax.process_index()}/{jax.process_count()}",
                      "batch_rows": data.rows.tolist()}), flush=True)
    try:
        result = trainer.fit(data, total_steps=args.steps)
    finally:
        trainer.close()
    if result.status == "preempted":
        print(f"preempted at step {result.step}; rerun the same command to resume", flush=True)
        return 0
    if cfg.export_dir:
        from specjax import checkpoints

        # the target's config (a .gguf target has no config.json to copy)
        _export(trainer, result.state, dcfg, cfg.export_dir,
                target=checkpoints.read_target_config(cfg.model.target), dtype=args.export_dtype)
    print(f"done: {result.step} steps; last metrics {json.dumps(result.metrics)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
