"""A drafter's training run, as `specjax-train` (`specjax.cli.train`) drives it: `build` makes
everything a run needs from a `TrainConfig` (mesh, target, objective, data, trainer), `train`
trains it (resuming from the latest checkpoint) and exports the drafter.

Data: an offline target cache (`data.mode: cache`: DSpark / DFlash / Eagle3 / MTP-1, made by
`python -m train.build_cache`) or chat / {"prompt", "completion"} JSONL (`data.mode: online`:
the frozen target runs inside the jitted step). Multi-host: the mesh spans every process's
devices and each process reads and feeds only its slice of every global batch; process 0 writes
the logs, the config copy and the export.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from specjax import checkpoints
from specjax import distributed as dist
from specjax import sharding as shd
from specjax.config import ConfigError
from specjax.drafters import registry
from specjax.io import write_json_atomic
from specjax.training import features as feat
from specjax.training.build_outputs import PROGRESS_NAME
from specjax.training.cache_parts import open_target_caches
from specjax.training.config import TrainConfig, train_config_dict
from specjax.training.data import EpochBatches, collate_block_batch
from specjax.training.objectives import make_objective
from specjax.training.trainer import Trainer


def train_mesh(cfg: TrainConfig) -> Any:
    m = cfg.mesh
    n = len(jax.devices())
    fsdp = m.fsdp or max(1, n // (m.data * m.tensor))
    if m.data * fsdp * m.tensor > n:
        raise ConfigError(f"mesh data={m.data} x fsdp={fsdp} x tensor={m.tensor} needs more than "
                          f"the {n} available devices")
    return shd.train_mesh(m.data, fsdp, m.tensor)


class SampleList:
    """Tokenised (ids, mask) pairs as dataset items."""

    def __init__(self, samples: list[tuple[Any, Any]]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.samples]

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, mask = self.samples[i]
        return {"input_ids": ids, "loss_mask": mask}


class Run(NamedTuple):
    """What `build` makes."""

    trainer: Trainer
    data: EpochBatches
    drafter_config: Any  # the drafter's config (BlockDrafterConfig, Eagle3Config, MTPConfig, ...)
    tap_layers: tuple[int, ...]
    target_graphdef: Any  # online mode: the frozen target's graph (its params are trainer aux)


def build(cfg: TrainConfig, *, mesh: Any = None, draft_ids: Any = None) -> Run:
    """Everything a run needs (trainer, data iterator, drafter config); nothing trained yet.
    `draft_ids`: the draft vocabulary's target ids (required when model.draft_vocab_size > 0)."""
    mc, dc = cfg.model, cfg.data
    mesh = mesh if mesh is not None else train_mesh(cfg)
    if dc.mode == "cache" and mc.kind not in registry.CACHE_KINDS:
        raise ConfigError(f"data.mode 'cache' supports kinds {registry.CACHE_KINDS}; kind {mc.kind!r} "
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
        dataset = SampleList(samples)
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


def export_trained(trainer, state, dcfg, out_dir: str, *, target: Any = None,
            dtype: str | None = None) -> None:
    """Hugging Face style export (config.json + safetensors, DeepSpec names) of the drafter,
    written by process 0 (the parameters are first gathered onto every process)."""
    if jax.process_count() > 1:
        state = jax.jit(lambda s: s, out_shardings=shd.replicated(trainer.mesh))(state)
    if dist.is_primary():
        registry.export_drafter(trainer.model(state), dcfg, out_dir, target_config=target, dtype=dtype)
        print(f"exported the drafter to {out_dir}")


def curve_hook(cfg: TrainConfig, run: Run) -> Any:
    """The `Trainer.fit` callback of the run's learning curve (`cfg.curve`, `specjax.eval.curve`):
    the greedy texts are made once (plain decoding of the target, float32, as the engine runs it),
    then the target's features of them; points go to <logging.directory>/learning_curve.jsonl."""
    from specjax.api import LLM
    from specjax.decoding.engine import EngineConfig
    from specjax.eval import curve as C
    from specjax.eval.datasets import load_dataset

    cc, mc = cfg.curve, cfg.model
    if jax.process_count() > 1:
        raise ConfigError("curve: a learning curve is computed in single-process runs only")
    texts_path = cc.texts or os.path.join(cfg.logging.directory, "curve_texts.jsonl")
    max_len = cc.max_prompt_tokens + cc.max_tokens + 16
    if os.path.isfile(texts_path):
        target, _ = checkpoints.load_target(mc.target, dtype="float32")
    else:
        missing = [(cs.name, path) for cs in cc.sets for path in cs.files if not os.path.isfile(path)]
        if missing:
            raise ConfigError(f"curve set {missing[0][0]!r}: prompt file {missing[0][1]} does not exist")
        greedy_only = EngineConfig(max_slots=8, max_len=max_len, policy="plain", sampling_variants=("greedy",),
                                   max_prefill=min(256, cc.max_prompt_tokens))  # compiles a third of the rounds
        llm = LLM(mc.target, tokenizer=cfg.data.tokenizer, dtype="float32", engine_config=greedy_only)
        prompt_sets = {}
        for cs in cc.sets:
            prompt_sets[cs.name] = [p for path in cs.files
                                    for p in load_dataset(path, llm.tokenizer, cap=cc.prompts).prompts
                                    if len(p) <= cc.max_prompt_tokens]
            if not prompt_sets[cs.name]:
                raise ConfigError(f"curve set {cs.name!r}: no prompt of at most {cc.max_prompt_tokens} "
                                  f"tokens in {list(cs.files)}")
        counts = C.write_curve_texts(llm, prompt_sets, texts_path, max_tokens=cc.max_tokens)
        print(f"curve: greedy texts {counts} -> {texts_path}", flush=True)
        target = llm.model
        del llm
    curve = C.LearningCurve(target, C.read_curve_texts(texts_path), max_len=max_len,
                            max_tokens=cc.max_tokens, tap_layers=run.tap_layers)
    log = C.CurveLog(os.path.join(cfg.logging.directory, C.CURVE_LOG))
    return C.curve_hook(curve, log, cc.every, run.trainer.model, primary=dist.is_primary())


def train(cfg: TrainConfig, run: Run, *, steps: int | None = None,
          export_dtype: str | None = None, deadline: float | None = None, curve: Any = None) -> None:
    """Train `run` (built from `cfg`; printing a start line and a final line), then export the
    drafter to `cfg.export_dir` with its progress file (`PROGRESS_NAME`). `steps`: stop after
    this many optimizer steps in total (default: the schedule's). A preempted run saves a
    checkpoint and returns (rerun to resume). `deadline` (a `time.monotonic()` value): a run that
    reaches it saves a checkpoint and exports the drafter it has (a rerun continues it). `curve`:
    the learning curve's callback (`curve_hook`), called every step and at the end, after the
    export."""
    trainer, data, dcfg = run[:3]
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
    t0 = time.monotonic()
    start = (trainer.latest_checkpoint() or 0) if cfg.checkpoint.resume else 0
    try:
        result = trainer.fit(data, total_steps=steps, deadline=deadline, on_step=curve)
    finally:
        trainer.close()
    if result.status == "preempted":
        print(f"preempted at step {result.step}; rerun the same command to resume", flush=True)
        return
    if cfg.export_dir:
        # the target's config (a .gguf target has no config.json to copy)
        export_trained(trainer, result.state, dcfg, cfg.export_dir,
                       target=checkpoints.read_target_config(cfg.model.target), dtype=export_dtype)
        if dist.is_primary():
            seconds = time.monotonic() - t0
            write_json_atomic(os.path.join(cfg.export_dir, PROGRESS_NAME), {
                "step": result.step, "total_steps": steps or trainer.total_steps,
                "status": result.status, "batch_size": cfg.data.batch_size,
                "samples": len(data.dataset), "steps_this_run": result.step - start,
                "seconds_this_run": round(seconds, 1),
                "steps_per_s": round((result.step - start) / max(seconds, 1e-9), 3),
                "sequences_per_s": round((result.step - start) * cfg.data.batch_size
                                         / max(seconds, 1e-9), 2)})
    # the last curve point after the export: a run stopped at its time limit, then killed while
    # measuring (the build kills a child at its share), keeps the drafter it trained
    if curve is not None:
        curve(result.step, result.state, force=True)
    if result.status == "time_limit":
        print(f"time limit: exported the drafter of step {result.step} of "
              f"{steps or trainer.total_steps}; rerun to continue", flush=True)
    print(f"done: {result.step} steps; last metrics {json.dumps(result.metrics)}", flush=True)


__all__ = ["Run", "SampleList", "build", "curve_hook", "export_trained", "train", "train_mesh"]
