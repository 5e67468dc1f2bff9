"""Target features: online (jitted, stop_gradient) vs the tensorstore cache, size estimate,
resumable builds, mismatch errors, and the build_cache CLI."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.checkpoints import export_target
from specjax.models.decoder import CausalLM
from specjax.training import cache_build
from specjax.training import features as feat
from specjax.training.config import DataConfig

V, H, LAYERS = 61, 16, 4
TCFG = TargetConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=4, rope_theta=10000.0)
TAPS = (-1, 1, 2)


def _scramble(module: nnx.Module, seed: int, std: float = 0.3) -> None:
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.RandomState(seed)
    new = [jnp.asarray((1.0 if x.ndim == 1 else 0.0) + std * rng.standard_normal(x.shape), x.dtype)
           for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def target() -> CausalLM:
    t = CausalLM(TCFG, rngs=nnx.Rngs(0))
    _scramble(t, 1)
    return t


def _samples(n: int = 7, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = int(rng.integers(5, 31))
        ids = rng.integers(0, V, s).astype(np.int32)
        mask = (np.arange(s) >= s // 3).astype(np.uint8)
        out.append((ids, mask))
    return out


def _ident(path: str = "tiny/target") -> feat.TargetIdentity:
    return feat.TargetIdentity(path=path, config_hash=feat.config_hash(TCFG))


def _online(target, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Online features of one sequence (right-padded to 32 tokens: one compilation)."""
    graphdef, params = nnx.split(target)
    n = len(ids)
    padded = np.zeros((1, 32), np.int32)
    padded[0, :n] = ids
    taps, hid = feat.target_features_jit(params, graphdef, jnp.asarray(padded),
                                         jnp.asarray([n], jnp.int32), tap_layers=TAPS)
    return np.asarray(taps[0, :n], np.float32), np.asarray(hid[0, :n], np.float32)


def test_online_features_shapes_padding_and_no_gradient(target):
    graphdef, params = nnx.split(target)
    ids = np.random.default_rng(3).integers(0, V, (2, 12)).astype(np.int32)
    valid = np.array([12, 7], np.int32)
    taps, hid = feat.target_features_jit(params, graphdef, ids, valid, tap_layers=TAPS)
    assert taps.shape == (2, 12, len(TAPS) * H) and hid.shape == (2, 12, H)
    assert taps.dtype == jnp.bfloat16 and hid.dtype == jnp.bfloat16
    # Layer blocks are in tap order and equal the target's own forward (fp32 -> bf16).
    out = jax.jit(lambda p, x, v: nnx.merge(graphdef, p).forward(
        x, jnp.broadcast_to(jnp.arange(12), (2, 12)), valid_b=v, tap_layers=TAPS,
        logits="none"))(params, jnp.asarray(ids), jnp.asarray(valid))
    for k, lid in enumerate(TAPS):
        np.testing.assert_allclose(np.asarray(taps[..., k * H:(k + 1) * H], np.float32),
                                   np.asarray(out.taps[k].astype(jnp.bfloat16), np.float32))
    # Right padding does not change the real tokens of row 1.
    t1, h1 = _online(target, ids[1, :7])
    np.testing.assert_allclose(np.asarray(taps[1, :7], np.float32), t1, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(hid[1, :7], np.float32), h1, atol=2e-2, rtol=2e-2)
    # stop_gradient: no gradient reaches the target's parameters.
    g = jax.jit(jax.grad(lambda p: jnp.sum(feat.target_features(
        p, graphdef, ids, valid, tap_layers=TAPS, dtype=jnp.float32)[1] ** 2)))(params)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))
    no_taps, hid_only = feat.target_features(params, graphdef, ids, valid, tap_layers=())
    assert no_taps is None  # mtp / standalone read the hidden state only
    np.testing.assert_allclose(np.asarray(hid_only, np.float32), np.asarray(hid, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_cache_roundtrip_equals_online(target, tmp_path):
    samples = _samples()
    with pytest.raises(ValueError, match="tap_layers"):  # a cache without taps has nothing to serve
        cache_build.build_cache(tmp_path / "none", target, samples, tap_layers=(), identity=_ident())
    rep = cache_build.build_cache(tmp_path / "c", target, samples, tap_layers=TAPS, identity=_ident(),
                                  tokenizer_name="tiny", batch_size=4, chunk_tokens=16)
    assert rep.complete and rep.samples_written == len(samples)
    cache = feat.TargetCache(tmp_path / "c", expect_layers=TAPS, expect_hidden=H,
                             expect_target=_ident())
    assert len(cache) == len(samples)
    assert cache.manifest["tokenizer"] == "tiny" and cache.manifest["num_tokens"] == sum(
        len(s[0]) for s in samples)
    got = cache.read([4, 0, 6])
    for item, i in zip(got, (4, 0, 6)):
        ids, mask = samples[i]
        np.testing.assert_array_equal(item["input_ids"], ids)
        np.testing.assert_array_equal(item["loss_mask"], mask)
        assert item["taps"].dtype == ml_dtypes.bfloat16 and item["taps"].shape == (len(ids), 3 * H)
        taps, hid = _online(target, ids)
        # bf16 tolerance: both are the same fp32 computation rounded to bf16 (shapes differ).
        np.testing.assert_allclose(item["taps"].astype(np.float32), taps, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(item["hidden"].astype(np.float32), hid, rtol=1e-2, atol=1e-2)
    with pytest.raises(IndexError):
        cache[len(samples)]


def test_estimate_matches_bytes_written(target, tmp_path):
    samples = _samples(5, seed=2)
    chunk = 16
    cache_build.build_cache(tmp_path / "c", target, samples, tap_layers=TAPS, identity=_ident(),
                            chunk_tokens=chunk, batch_size=4)
    n_tok = sum(len(s[0]) for s in samples)
    # estimate_bytes counts the tensor data: T * (5 + 2H(L+1)) + 8(N+1). The files hold exactly
    # that plus the padding of the last chunk of each token array (chunks are stored whole) and
    # one shard index per shard (16 bytes per chunk slot + a 4-byte crc32c); stored_bytes counts
    # those too. Not counted: zarr.json metadata, manifest.json.
    written = feat.stored_tensor_bytes(tmp_path / "c")
    assert written == feat.stored_bytes(n_tok, H, len(TAPS), len(samples), chunk_tokens=chunk)
    raw = feat.estimate_bytes(n_tok, H, len(TAPS), len(samples))
    assert raw == n_tok * (5 + 2 * H * (len(TAPS) + 1)) + 8 * (len(samples) + 1)
    padded = -(-n_tok // chunk) * chunk  # whole chunks, one shard per array at this size
    slots = 1 << (-(-n_tok // chunk) - 1).bit_length()
    assert written == raw + (padded - n_tok) * feat.bytes_per_token(H, len(TAPS)) + 4 * (
        16 * slots + 4)
    # Several shards per array when shards are small: still exact.
    cache_build.build_cache(tmp_path / "s", target, samples, tap_layers=TAPS, identity=_ident(),
                            chunk_tokens=chunk, shard_bytes=2048, batch_size=4)
    assert feat.stored_tensor_bytes(tmp_path / "s") == feat.stored_bytes(
        n_tok, H, len(TAPS), len(samples), chunk_tokens=chunk, shard_bytes=2048)
    layout = feat.TargetCache(tmp_path / "s").manifest["arrays"]
    assert layout["taps"]["shard_tokens"] == 16 and layout["input_ids"]["shard_tokens"] > 16
    # Reference §7.5 per-token arithmetic (minus the attention-mask byte not stored here).
    assert feat.bytes_per_token(2560, 5) == 30726 - 1


def test_resume_after_partial_build(target, tmp_path):
    samples = _samples(9, seed=4)
    out = tmp_path / "c"
    rep = cache_build.build_cache(out, target, samples, tap_layers=TAPS, identity=_ident(),
                                  batch_size=4, stop_after=3)
    assert not rep.complete and rep.samples_written == 3
    assert not (out / "manifest.json").exists()
    state = json.loads((out / "build_state.json").read_text())
    assert state["samples_done"] == 3
    with pytest.raises(ConfigError, match="interrupted"):
        feat.TargetCache(out)
    # A different sample set may not continue this partial build.
    with pytest.raises(feat.CacheMismatchError, match="plan_hash|num_samples|num_tokens"):
        cache_build.build_cache(out, target, samples[:-1], tap_layers=TAPS, identity=_ident())
    rep2 = cache_build.build_cache(out, target, samples, tap_layers=TAPS, identity=_ident(), batch_size=4)
    assert rep2.complete and rep2.samples_written == len(samples) - 3
    assert not (out / "build_state.json").exists()
    fresh = cache_build.build_cache(tmp_path / "fresh", target, samples, tap_layers=TAPS,
                                    identity=_ident(), batch_size=4)
    a, b = feat.TargetCache(out), feat.TargetCache(tmp_path / "fresh")
    for i in range(len(samples)):
        x, y = a[i], b[i]
        for k in feat.TOKEN_ARRAYS:
            np.testing.assert_allclose(x[k].astype(np.float32), y[k].astype(np.float32),
                                       rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(x["input_ids"], samples[i][0])
    # Rerunning a complete build is a no-op.
    assert cache_build.build_cache(out, target, samples, tap_layers=TAPS,
                                   identity=_ident()).samples_written == 0
    assert fresh.complete


def test_reader_mismatch_errors(target, tmp_path):
    cache_build.build_cache(tmp_path / "c", target, _samples(3), tap_layers=TAPS, identity=_ident(),
                            batch_size=4)
    with pytest.raises(feat.CacheMismatchError, match="target_layer_ids"):
        feat.TargetCache(tmp_path / "c", expect_layers=(1, 2))
    with pytest.raises(feat.CacheMismatchError, match="hidden_size"):
        feat.TargetCache(tmp_path / "c", expect_hidden=H * 2)
    other = feat.TargetIdentity("tiny/target", "0123456789abcdef")
    with pytest.raises(feat.CacheMismatchError, match="config_hash"):
        feat.TargetCache(tmp_path / "c", expect_target=other)
    with pytest.raises(feat.CacheMismatchError, match="target.path"):
        feat.TargetCache(tmp_path / "c", expect_target=_ident("elsewhere"), check_target_path=True)
    feat.TargetCache(tmp_path / "c", expect_target=_ident("elsewhere"))  # path only informative
    with pytest.raises(ConfigError, match="does not exist"):
        feat.TargetCache(tmp_path / "missing")
    # A complete cache refuses a build for other layers.
    with pytest.raises(feat.CacheMismatchError, match="target_layer_ids"):
        cache_build.build_cache(tmp_path / "c", target, _samples(3), tap_layers=(0,), identity=_ident())
    with pytest.raises(ConfigError, match="out of range"):
        cache_build.build_cache(tmp_path / "d", target, _samples(3), tap_layers=(LAYERS,),
                                identity=_ident())
    assert feat.config_hash(TCFG) != feat.config_hash(
        TargetConfig(**{**TCFG.__dict__, "rope_theta": 5000.0}))


def test_build_cache_cli_estimate_then_build(target, tmp_path, capsys):
    from train import build_cache as cli

    tdir = export_target(target, TCFG, tmp_path / "target")
    samples = _samples(4, seed=7)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for ids, mask in samples:
            f.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
        f.write(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}) + "\n")  # filtered
    out = tmp_path / "cache"
    args = ["--target", str(tdir), "--data", str(data), "--out", str(out), "--layers=-1,1,2",
            "--min-loss-tokens", "2", "--chunk-tokens", "16", "--batch-size", "4", "--quiet",
            "--dtype", "float32"]
    assert cli.main(args + ["--estimate"]) == 0
    est = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not out.exists()  # --estimate writes nothing
    assert est["num_samples"] == 4
    assert cli.main(args) == 0
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["complete"] and done["tensor_bytes"] == est["stored_bytes"]
    cache = feat.TargetCache(out, expect_layers=TAPS, expect_hidden=H,
                             expect_target=feat.target_identity(tdir, TCFG))
    taps, _ = _online(target, samples[2][0])
    np.testing.assert_allclose(cache[2]["taps"].astype(np.float32), taps, rtol=1e-2, atol=1e-2)
    assert cli.main(args + [f"--layers=0,{LAYERS}"]) == 2  # bad layer: clear error
    assert "out of range" in capsys.readouterr().err


def test_tokenize_record_formats():
    ids, mask = feat.tokenize_record({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}, None,
                                     max_length=3)
    np.testing.assert_array_equal(ids, [5, 6, 7])
    np.testing.assert_array_equal(mask, [0, 1, 1])
    with pytest.raises(ValueError, match="tokenizer"):
        feat.tokenize_record({"prompt": "a", "completion": "b"}, None, max_length=8)
    with pytest.raises(ValueError, match="none of"):
        feat.tokenize_record({"text": "a"}, object(), max_length=8)


def test_offline_cache_run_matches_online_run(target, tmp_path):
    """train_draft in cache mode and in online mode see the same batch and give the same loss."""
    import yaml

    from specjax.training.config import load_train_config
    from specjax.training.run import build

    tdir = export_target(target, TCFG, tmp_path / "target")
    samples = _samples(6, seed=9)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for ids, mask in samples:
            f.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
    cache_dir = tmp_path / "cache"
    loaded = feat.read_jsonl_samples([data], None, max_length=32, min_loss_tokens=1)
    from specjax.checkpoints import load_target

    t2, _ = load_target(tdir)
    cache_build.build_cache(cache_dir, t2, loaded, tap_layers=TAPS,
                            identity=feat.target_identity(tdir, TCFG), batch_size=4)

    def run(mode: str):
        cfg = {"model": {"kind": "dspark", "target": str(tdir), "mask_token_id": V - 1,
                         "target_layer_ids": list(TAPS), "num_draft_layers": 1, "block_size": 3,
                         "markov_rank": 4, "num_anchors": 4, "compute_dtype": "float32",
                         "target_dtype": "float32"},
               "schedule": {"total_steps": 2},
               "data": {"mode": mode, "cache_dir": str(cache_dir), "train_jsonl": [str(data)],
                        "max_length": 32, "min_loss_tokens": 1, "batch_size": 2,
                        "length_buckets": [32]},
               "checkpoint": {"directory": str(tmp_path / f"ck_{mode}")}}
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return build(load_train_config(path))

    off, on = run("cache"), run("online")
    b_off, b_on = next(off.data), next(on.data)
    np.testing.assert_array_equal(b_off["input_ids"], b_on["input_ids"])
    assert "taps" in b_off and "taps" not in b_on
    key = jax.random.PRNGKey(3)

    def loss(r, batch):
        tr = r.trainer
        rest, aux = tr.frozen
        f = jax.jit(lambda p, b: tr.loss_fn(nnx.merge(tr.graphdef, p, rest), b, key, aux))
        return f(tr.init_state().params, tr.put_batch(batch))

    (l_off, m_off), (l_on, m_on) = loss(off, b_off), loss(on, b_on)
    assert float(l_off) == pytest.approx(float(l_on), rel=2e-2)
    assert float(m_off["ce"]) == pytest.approx(float(m_on["ce"]), rel=2e-2)
    with pytest.raises(feat.CacheMismatchError, match="target_layer_ids"):
        cfg_path = tmp_path / "bad.yaml"
        cfg = yaml.safe_load((tmp_path / "cache.yaml").read_text())
        cfg["model"]["target_layer_ids"] = [0, 1]
        cfg_path.write_text(yaml.safe_dump(cfg))
        build(load_train_config(cfg_path))


def _overwrite_array_files(cache_dir, name: str) -> None:
    """Zero every data file of one cache array in place (same sizes; zarr metadata kept)."""
    import os

    for root, _, files in os.walk(cache_dir / name):
        for f in files:
            if f != "zarr.json":
                p = os.path.join(root, f)
                size = os.path.getsize(p)
                with open(p, "r+b") as fh:
                    fh.write(b"\0" * size)


def test_cache_pool_serves_repeated_reads_and_is_bounded(target, tmp_path):
    """With a cache pool, a sample read once is served from memory (the files are not read again);
    with none (pool 0, tensorstore's default) every read goes back to the files."""
    samples = _samples()
    cache_build.build_cache(tmp_path / "c", target, samples, tap_layers=TAPS, identity=_ident(), batch_size=4,
                            chunk_tokens=16, shard_bytes=4096)
    pooled = feat.TargetCache(tmp_path / "c", cache_pool_bytes=1 << 20)
    unpooled = feat.TargetCache(tmp_path / "c", cache_pool_bytes=0)
    for c in (pooled, unpooled):
        first = c.read([2])[0]
        np.testing.assert_array_equal(first["input_ids"], samples[2][0])
    _overwrite_array_files(tmp_path / "c", "input_ids")  # the chunks and the shard indexes
    np.testing.assert_array_equal(pooled.read([2])[0]["input_ids"], samples[2][0])
    with pytest.raises(ValueError, match="shard index"):  # re-read from the files: a failed checksum
        unpooled.read([2])
    assert pooled.context["cache_pool"].to_json() == {"total_bytes_limit": 1 << 20}
    assert feat.TargetCache(tmp_path / "c").context["cache_pool"].to_json() == {
        "total_bytes_limit": feat.DEFAULT_CACHE_POOL_BYTES}
    for bad in (-1, 1.5, True, "64MB"):
        with pytest.raises(ConfigError, match="cache_pool_bytes"):
            feat.TargetCache(tmp_path / "c", cache_pool_bytes=bad)
        with pytest.raises(ConfigError, match="cache_pool_bytes"):  # the training config's field
            DataConfig(cache_dir=str(tmp_path / "c"), cache_pool_bytes=bad)
    assert DataConfig(cache_dir="c", cache_pool_bytes=1 << 20).cache_pool_bytes == 1 << 20
