"""Build the embedded default target: `python -m train.pretrain_target --out specjax/assets/pystd`.

Steps (all deterministic for a given Python version and recipe):
  1. collect the interpreter's standard-library sources and split them by module (split.json;
     a split.json already in --out decides by module name),
  2. train the byte-level BPE tokenizer on the training modules,
  3. pre-train the Qwen3-architecture target with next-token cross-entropy on packed sequences
     (`specjax.training.trainer.Trainer`: AdamW, warmup + cosine, orbax checkpoints in --run-dir;
     rerunning the same command resumes; SIGTERM / Ctrl-C save a checkpoint and stop),
  4. evaluate train / held-out loss, export config.json + model.safetensors + tokenizer files +
     generation_config.json to <out>/target, and write <out>/target/training.json,
  5. write the held-out and training-module completion prompts to <out>/prompts/.

The recipe is configs/embedded/target.yaml; flags override its fields.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from typing import Any, Sequence

import numpy as np

from specjax import embedded as emb
from specjax.config import ConfigError, to_dict

DEFAULT_CONFIG = os.path.join("configs", "embedded", "target.yaml")
RUN_MARKER = "run_config.json"


def _log(msg: str) -> None:
    print(f"[pretrain_target {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _prepare_run_dir(run_dir: str, identity: dict[str, Any], fresh: bool) -> None:
    """Create the run directory; refuse to resume a run made with another recipe or tokenizer."""
    marker = os.path.join(run_dir, RUN_MARKER)
    if fresh and os.path.isdir(run_dir):
        if not os.path.exists(marker) and os.listdir(run_dir):
            raise ConfigError(f"--fresh: {run_dir} is not a pretrain_target run directory "
                              f"(no {RUN_MARKER}); not deleting it")
        shutil.rmtree(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    if os.path.exists(marker):
        old = _read_json(marker)
        if old != identity:
            diff = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            raise ConfigError(f"{run_dir} holds a run with a different {diff}; pass --fresh to "
                              f"start over or choose another --run-dir")
    else:
        _write_json(marker, identity)


def _decode_latency_ms(model: Any, *, layers: int, n: int = 100) -> dict[str, float]:
    """Median ms of one jitted batch-1 decode step (1 token, 512-slot cache) of `model` and of a
    model with `layers` layers of the same width (a one-layer drafter's order of cost)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from specjax.models.decoder import CausalLM

    def one(m) -> float:
        graphdef, state = nnx.split(m)

        @jax.jit
        def step(state, cache, tok, pos):
            out = nnx.merge(graphdef, state).forward(tok, pos, cache, logits="last")
            return jnp.argmax(out.logits[:, -1], axis=-1), out.cache

        cache = m.init_cache(1, 512)
        tok, pos = jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 200, jnp.int32)
        jax.block_until_ready(step(state, cache, tok, pos)[0])
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, cache, tok, pos)[0])
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts) * 1e3)

    cfg = model.config
    small_cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    small = CausalLM(small_cfg, rngs=nnx.Rngs(0))
    return {"target_ms": round(one(model), 3), f"{layers}_layer_ms": round(one(small), 3)}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def build_prompts(files_train, files_held, tok, cfg: emb.PretrainConfig, out: str) -> dict[str, int]:
    """Write prompts/heldout.jsonl and prompts/train_prompts.jsonl; returns the counts."""
    def n_tokens(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False).ids)

    held = emb.extract_prompts(files_held, n_tokens, max_tokens=cfg.prompt_max_tokens)
    train = emb.extract_prompts(files_train, n_tokens, max_tokens=cfg.prompt_max_tokens)
    held_sel = emb.select_prompts(held, cfg.heldout_prompts, salt="pystd-heldout-v1")
    train_sel = emb.select_prompts(train, cfg.train_prompts, salt="pystd-train-v1")
    n_h = emb.write_jsonl((p.to_json() for p in held_sel), os.path.join(out, "prompts", "heldout.jsonl"))
    n_t = emb.write_jsonl((p.to_json() for p in train_sel),
                          os.path.join(out, "prompts", "train_prompts.jsonl"))
    return {"heldout": n_h, "heldout_candidates": len(held), "train": n_t,
            "train_candidates": len(train)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.pretrain_target",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=emb.asset_dir(), help="asset directory (default: %(default)s)")
    p.add_argument("--config", default=DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None,
                   help="recipe YAML (default: %(default)s; built-in defaults when absent)")
    p.add_argument("--run-dir", default=os.path.join("runs", "pretrain"),
                   help="checkpoints and logs (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="delete --run-dir first (no resume)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per packed sequence")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--eval-rows", type=int, default=128,
                   help="packed rows used for each of the train / held-out loss (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    args = p.parse_args(argv)

    t_start = time.time()
    try:
        cfg = emb.load_pretrain_config(args.config, {
            "total_steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "learning_rate": args.lr, "compute_dtype": args.compute_dtype})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    # 1. corpus and split
    files = emb.collect_corpus()
    split_file = os.path.join(out, "split.json")
    recorded = emb.load_split(split_file) if os.path.exists(split_file) else None
    split = emb.resolve_split(files, recorded)
    emb.save_split(split, split_file)
    files_train, files_held = emb.split_files(files, split)
    _log(f"corpus: {len(files)} files from {emb.stdlib_root()}; split {split.stats}")

    # 2. tokenizer
    tok = emb.train_tokenizer([f.text for f in files_train], cfg.vocab_size)
    tok_dir = os.path.join(args.run_dir, "tokenizer")
    specials = {t: tok.token_to_id(t) for t in emb.SPECIAL_TOKENS}
    eos_id = specials[emb.EOS_TOKEN]

    # 3. data and run directory
    identity = {"config": to_dict(cfg), "python_version": emb.python_version(),
                "split_train": list(split.train), "split_heldout": list(split.heldout),
                "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest()}
    try:
        _prepare_run_dir(args.run_dir, identity, args.fresh)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emb.save_tokenizer(tok, tok_dir, model_max_length=cfg.model.max_position_embeddings)
    emb.write_generation_config(tok_dir, eos_id)
    train_rows = emb.pack_documents(emb.encode_documents(tok, [f.text for f in files_train]),
                                    cfg.seq_len, eos_id)
    held_rows = emb.pack_documents(emb.encode_documents(tok, [f.text for f in files_held]),
                                   cfg.seq_len, eos_id)
    _log(f"tokenizer: vocab {tok.get_vocab_size()}, specials {specials}; packed rows of "
         f"{cfg.seq_len}: train {len(train_rows)}, held-out {len(held_rows)}")

    # 4. model and training
    import jax
    from flax import nnx

    from specjax import checkpoints
    from specjax.models.decoder import CausalLM
    from specjax.training.config import CheckpointConfig, LoggingConfig, OptimizerConfig
    from specjax.training.trainer import EpochBatches, Trainer

    tcfg = cfg.target_config(tok.get_vocab_size(), eos_id)
    model = CausalLM(tcfg, rngs=nnx.Rngs(cfg.seed), dtype=cfg.compute_dtype,
                             param_dtype="float32")
    opt = OptimizerConfig(learning_rate=cfg.learning_rate, b1=0.9, b2=cfg.b2,
                          weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          warmup_ratio=cfg.warmup_ratio)
    trainer = Trainer(
        model, emb.lm_loss, optimizer=opt, total_steps=cfg.total_steps, seed=cfg.seed,
        checkpoint=CheckpointConfig(directory=os.path.join(args.run_dir, "checkpoints"),
                                    save_every=cfg.save_every, keep=2, async_save=True, resume=True),
        logging=LoggingConfig(directory=os.path.join(args.run_dir, "logs"), every=cfg.log_every,
                              tensorboard=False, progress=not args.no_progress))
    data = EpochBatches(emb.PackedRows(train_rows), cfg.batch_size, seed=cfg.seed,
                        collate=emb.collate_rows)
    resumed_from = trainer.latest_checkpoint()
    _log(f"training {cfg.total_steps} steps x {cfg.batch_size} x {cfg.seq_len} tokens "
         f"({data.steps_per_epoch} steps per epoch, compute {cfg.compute_dtype}"
         + (f", resuming from step {resumed_from}" if resumed_from else "") + ")")
    t_train = time.time()
    try:
        result = trainer.fit(data)
    finally:
        trainer.close()
    wall_file = os.path.join(args.run_dir, "wall_time.json")
    walls = _read_json(wall_file)
    walls["training_s"] = float(walls.get("training_s", 0.0)) + (time.time() - t_train)
    if result.metrics.get("steps_per_s"):
        walls["steps_per_s"] = result.metrics["steps_per_s"]
        walls["last_logged_step_loss"] = result.metrics.get("loss")
    _write_json(wall_file, walls)
    if result.status == "preempted":
        _log(f"preempted at step {result.step}; rerun the same command to resume")
        return 0
    trained = trainer.model(result.state)

    # 5. evaluation, export, prompts, record
    def eval_rows(rows: np.ndarray) -> np.ndarray:
        step = max(1, len(rows) // args.eval_rows)
        return rows[::step][:args.eval_rows]

    ev_train = emb.evaluate_loss(trained, eval_rows(train_rows))
    ev_held = emb.evaluate_loss(trained, eval_rows(held_rows))
    _log(f"loss (nats/token): train {ev_train['loss']:.4f}, held-out {ev_held['loss']:.4f}")
    target_out = os.path.join(out, "target")
    if os.path.isdir(target_out):
        for f in os.listdir(target_out):  # stale files of an earlier build
            if os.path.isfile(os.path.join(target_out, f)):
                os.remove(os.path.join(target_out, f))
    checkpoints.export_target(trained, tcfg, target_out, tokenizer_dir=tok_dir, dtype=cfg.export_dtype)
    emb.write_generation_config(target_out, eos_id)
    for f in os.listdir(target_out):
        os.chmod(os.path.join(target_out, f), 0o644)

    served, _ = checkpoints.load_target(target_out, dtype="float32")
    latency = _decode_latency_ms(served, layers=1)
    tok_hf = checkpoints.load_tokenizer(target_out)
    counts = build_prompts(files_train, files_held, tok, cfg, out)
    samples = []
    for rec in emb.read_prompts(os.path.join(out, "prompts", "heldout.jsonl"))[:3]:
        ids = tok_hf(rec["prompt"], add_special_tokens=False)["input_ids"]
        gen = emb.greedy_generate(served, ids, 48, eos_token_id=eos_id)
        samples.append({"prompt": rec["prompt"], "completion": tok_hf.decode(gen)})
    n_steps = int(result.step)
    record = {
        "steps": n_steps,
        "tokens_seen": n_steps * cfg.batch_size * cfg.seq_len,
        "losses": {"train": round(ev_train["loss"], 4), "heldout": round(ev_held["loss"], 4),
                   "train_accuracy": round(ev_train["accuracy"], 4),
                   "heldout_accuracy": round(ev_held["accuracy"], 4),
                   "eval_rows": {"train": ev_train["rows"], "heldout": ev_held["rows"]},
                   "last_logged_step_loss": walls.get("last_logged_step_loss")},
        "wall_time_s": {"training": round(walls["training_s"], 1),
                        "this_invocation": round(time.time() - t_start, 1),
                        "resumed_from_step": resumed_from},
        "steps_per_s": walls.get("steps_per_s"),
        "decode_step_latency": latency,
        "params": int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(served, nnx.Param)))),
        "export_bytes": _dir_bytes(target_out),
        "special_tokens": specials,
        "mask_token_id": specials[emb.MASK_TOKEN],
        "data": {"train_rows": int(len(train_rows)), "heldout_rows": int(len(held_rows)),
                 "train_tokens": int(train_rows.size), "heldout_tokens": int(held_rows.size),
                 "split": split.stats},
        "prompts": counts,
        "config": to_dict(cfg),
        "machine": {**emb.machine_description(), "jax": jax.__version__,
                    "jax_backend": jax.default_backend()},
        "command": "python -m train.pretrain_target " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "samples": samples,
    }
    _write_json(os.path.join(target_out, "training.json"), record)
    _log(f"done in {time.time() - t_start:.0f} s: {n_steps} steps; export "
         f"{record['export_bytes'] / 1e6:.2f} MB in {target_out}; prompts {counts}; "
         f"decode step {latency}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
