"""Drafter checkpoints: DeepSpec-named directories load, save -> load is exact, bad input is named."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from specjax import checkpoints
from specjax.config import ConfigError, TargetConfig
from specjax.sampling import SamplingArrays
from specjax.drafters import dspark_kind, registry
from specjax.drafters.base import ContextUpdate
from specjax.drafters.common import Calibration, Frozen
from specjax.drafters.dspark import BlockDrafterConfig, DSparkDrafter, make_block_drafter
from specjax.drafters.eagle3 import Eagle3Config, Eagle3Drafter, make_eagle3_drafter
from specjax.drafters.mtp import make_mtp_drafter
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.standalone import StandaloneDrafter
from specjax.models.decoder import CausalLM

V, H, NH, NKV, HD, FF, NT = 64, 32, 4, 2, 8, 64, 3  # target: vocab, hidden, heads, kv, hd, mlp, layers
R, GAMMA, MASK_ID = 8, 3, V - 1
TAPS = (-1, 1)  # DSpark taps (-1 = embedding output)
E_TAPS = (0, 1)  # Eagle3 taps (layer ids >= 0)
TCFG = TargetConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=NT,
                    num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                    rope_theta=10000.0)
BLOCK_VARIANTS = {
    "dspark": dict(markov_rank=R, markov_head_type="vanilla", confidence_head=True),
    "dspark-rnn": dict(markov_rank=R, markov_head_type="rnn", confidence_head=True),
    "dflash": dict(markov_rank=0, confidence_head=False, confidence_head_with_markov=False),
}
KINDS = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1", "standalone", "ngram")


def _scramble(module: nnx.Module, seed: int, std: float = 0.3) -> None:
    """Redraw every nnx.Param (norm weights around one) so that any mix-up shows."""
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    new = [jnp.asarray((1.0 if x.ndim == 1 else 0.0) + std * rng.standard_normal(x.shape), x.dtype)
           for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


def _variables(module: nnx.Module) -> dict[str, tuple[type, np.ndarray]]:
    """Every nnx.Variable of `module`: dotted path -> (variable type, host value)."""
    return {".".join(map(str, p)): (type(v), np.asarray(jax.device_get(v.get_value())))
            for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}


@pytest.fixture(scope="module")
def target() -> CausalLM:
    t = CausalLM(TCFG, rngs=nnx.Rngs(0))
    _scramble(t, 1, std=0.2)
    return t


def _make(kind: str, target: CausalLM) -> nnx.Module:
    if kind in BLOCK_VARIANTS:
        cfg = BlockDrafterConfig.from_target(TCFG, target_layer_ids=TAPS, mask_token_id=MASK_ID,
                                             num_draft_layers=2, block_size=GAMMA,
                                             **BLOCK_VARIANTS[kind])
        d = make_block_drafter(target, TCFG, cfg, nnx.Rngs(3))
        _scramble(d, 11)
        if cfg.confidence_head:
            d.set_confidence_temperatures([0.7, 1.3, 2.1])  # calibrated: stored in config.json
        return d
    if kind == "eagle3":
        d = make_eagle3_drafter(target, Eagle3Config.from_target(TCFG, target_layer_ids=E_TAPS,
                                                                 gamma=GAMMA), nnx.Rngs(5))
    elif kind == "mtp1":
        d = make_mtp_drafter(target, rngs=nnx.Rngs(6))
    elif kind == "standalone":
        small = TargetConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=8, rope_theta=10000.0, tie_word_embeddings=True)
        d = StandaloneDrafter.from_config(small, GAMMA, rngs=nnx.Rngs(7))
    else:
        return NGramDrafter(V, gamma=GAMMA, max_ngram=2)
    _scramble(d, 12)
    return d


# ------------------------------------------------------------------------------------------------
# running a drafter: commit a prompt's context, then propose (jitted, as the engine does)


_B, _T = 2, 6


@jax.jit
def _target_features(params, ids_bt):
    """All target layer outputs (taps -1..NT-1) and the final hidden state, one jitted forward."""
    model = nnx.merge(_TARGET_GRAPH[0], params)
    pos = jnp.broadcast_to(jnp.arange(ids_bt.shape[1], dtype=jnp.int32), ids_bt.shape)
    out = model.forward(ids_bt, pos, tap_layers=tuple(range(-1, NT)), logits="none")
    return out.taps, out.hidden


_TARGET_GRAPH: list = []


@functools.partial(jax.jit, static_argnums=0)
def _commit_propose(graph, state, update, anchor_b, position_b, sampling, keys):
    d = nnx.merge(graph, state)
    st = d.commit(d.init_state(_B, 16), update)
    return d.propose(st, anchor_b, position_b, sampling, keys)


def _run(drafter: nnx.Module, target: CausalLM, seed: int = 0):
    """(tokens, q, confidence) of one jitted commit + propose over a random 2-row prompt (the
    executable is shared by drafters with equal graphs, e.g. a drafter and its reloaded copy)."""
    ids = jax.random.randint(jax.random.key(seed), (_B, _T), 0, V - 1, dtype=jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(_T, dtype=jnp.int32), (_B, _T))
    graph_t, params_t = nnx.split(target)
    _TARGET_GRAPH[:] = [graph_t]
    taps_all, hidden = _target_features(params_t, ids)
    taps = [taps_all[i + 1] for i in drafter.tap_layers]
    update = ContextUpdate(tokens=ids, positions=pos,
                           taps=jnp.concatenate(taps, -1) if taps else None,
                           hidden=hidden if drafter.needs_hidden else None,
                           n_valid=jnp.array([_T, _T - 2], jnp.int32))
    graph, state = nnx.split(drafter)
    blk = _commit_propose(graph, state, update, jnp.array([5, 9], jnp.int32),
                          jnp.array([_T, _T - 2], jnp.int32),
                          SamplingArrays.broadcast(_B, temperature=1.0),
                          jax.random.split(jax.random.key(7), _B))
    conf = None if blk.confidence is None else np.asarray(blk.confidence)
    return np.asarray(blk.tokens), np.asarray(blk.q), conf


# ------------------------------------------------------------------------------------------------
# save -> load is exact


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_is_bit_exact(kind, target, tmp_path):
    d = _make(kind, target)
    out = registry.save_drafter(d, tmp_path / kind, target_config=TCFG)
    loaded = registry.load_drafter(out, target=target)
    assert type(loaded) is type(d)
    assert registry.drafter_kind(out) == {"dspark-rnn": "dspark", "dflash": "dspark",
                                          "mtp1": "mtp"}.get(kind, kind)
    a, b = _variables(d), _variables(loaded)
    assert a.keys() == b.keys()
    for path in a:
        assert a[path][0] is b[path][0], path
        assert a[path][1].dtype == b[path][1].dtype, path
        np.testing.assert_array_equal(a[path][1], b[path][1], err_msg=path)
    if kind == "ngram":
        assert (loaded.gamma, loaded.max_ngram, loaded.min_ngram) == (GAMMA, 2, 1)
        assert not os.path.exists(os.path.join(out, checkpoints.SAFE_WEIGHTS))
    else:
        assert loaded.config == d.config
    ta, qa, ca = _run(d, target)
    tb, qb, cb = _run(loaded, target)
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(qa, qb)
    assert (ca is None) == (cb is None) == (kind not in ("dspark", "dspark-rnn"))
    if ca is not None:
        np.testing.assert_array_equal(ca, cb)


def test_bfloat16_file_dtype_and_sharded_files(target, tmp_path):
    d = _make("dspark", target)
    out = registry.save_drafter(d, tmp_path / "bf16", dtype="bfloat16", max_shard_bytes=4096)
    assert os.path.exists(os.path.join(out, checkpoints.SAFE_INDEX))
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["torch_dtype"] == "bfloat16" and "num_target_layers" not in cfg  # no target given
    loaded = registry.load_drafter(out, dtype="bfloat16")
    a, b = _variables(d), _variables(loaded)
    for path, (kind, value) in a.items():
        want = value if kind is Calibration else value.astype(jnp.bfloat16)
        np.testing.assert_array_equal(b[path][1], want, err_msg=path)


def test_saved_dspark_directory_has_deepspec_names_and_fields(target, tmp_path):
    base = {**TCFG.to_hf_dict(), "max_window_layers": NT, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    del base["rope_theta"], base["rope_scaling"]  # a transformers 5 target config
    d = _make("dspark-rnn", target)
    out = registry.save_drafter(d, tmp_path / "rnn", target_config=base,
                                extra_config={"target_model_name_or_path": "tiny"})
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == NT
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["max_window_layers"] == NT
    assert cfg["sliding_window"] is None and cfg["use_sliding_window"] is False
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 2
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "rope_theta" not in cfg  # the target's dialect is kept
    assert {k: cfg[k] for k in ("block_size", "mask_token_id", "target_layer_ids", "num_anchors",
                                "markov_rank", "markov_head_type", "enable_confidence_head",
                                "confidence_head_with_markov", "target_model_name_or_path")} == {
        "block_size": GAMMA, "mask_token_id": MASK_ID, "target_layer_ids": list(TAPS),
        "num_anchors": 512, "markov_rank": R, "markov_head_type": "rnn",
        "enable_confidence_head": True, "confidence_head_with_markov": True,
        "target_model_name_or_path": "tiny"}
    assert cfg["confidence_temperatures"] == pytest.approx([0.7, 1.3, 2.1])
    with checkpoints.SafetensorsDir(out) as reader:
        shapes = {k: reader.tensor_shape(k) for k in reader}
    assert shapes == _deepspec_shapes("dspark-rnn", num_layers=2)
    import transformers  # DeepSpec's eval.py reads the draft config with AutoConfig

    auto = transformers.AutoConfig.from_pretrained(out)
    assert auto.architectures[0] == "Qwen3DSparkModel" and auto.block_size == GAMMA


# ------------------------------------------------------------------------------------------------
# a directory written the way DeepSpec writes it loads unchanged


def _deepspec_shapes(variant: str, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and torch shapes of a Qwen3DSparkModel state dict (reference §2.6)."""
    s = {"embed_tokens.weight": (V, H), "fc.weight": (H, len(TAPS) * H), "hidden_norm.weight": (H,),
         "norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        s.update({p + "self_attn.q_proj.weight": (NH * HD, H), p + "self_attn.k_proj.weight": (NKV * HD, H),
                  p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.o_proj.weight": (H, NH * HD),
                  p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
                  p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                  p + "mlp.down_proj.weight": (H, FF), p + "input_layernorm.weight": (H,),
                  p + "post_attention_layernorm.weight": (H,)})
    if variant != "dflash":
        s.update({"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
                  "confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)})
    if variant == "dspark-rnn":
        s.update({"markov_head.joint_proj.weight": (3 * R, 2 * R + H),
                  "markov_head.joint_proj.bias": (3 * R,)})
    return s


def _ours(hf_name: str) -> tuple[str, bool]:
    """(our variable path, transposed?) of a DeepSpec tensor name, written out independently of
    specjax.checkpoints: torch Linear weights [out, in] are our kernels [in, out]."""
    if hf_name in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
        return hf_name[:-len("weight")] + "embedding", False
    if hf_name.endswith("norm.weight") or hf_name.endswith(".bias"):
        return hf_name, False
    return hf_name[:-len("weight")] + "kernel", True


def _deepspec_config(variant: str, dialect: str, num_layers: int) -> dict:
    """config.json as DeepSpec's build_draft_config + save_pretrained write it (a deep copy of the
    target's Qwen3 config with the draft fields; optional fields only when they apply)."""
    d = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V,
         "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": num_layers,
         "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
         "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "initializer_range": 0.02,
         "max_window_layers": NT, "sliding_window": None, "use_sliding_window": False,
         "layer_types": ["full_attention"] * num_layers, "tie_word_embeddings": False,
         "bos_token_id": 1, "eos_token_id": 2, "use_cache": True, "torch_dtype": "bfloat16",
         "transformers_version": "4.57.1", "block_size": GAMMA, "mask_token_id": MASK_ID,
         "target_layer_ids": list(TAPS), "num_anchors": 512, "num_target_layers": NT,
         "markov_rank": 0 if variant == "dflash" else R,
         "enable_confidence_head": variant != "dflash"}
    if variant != "dflash":
        d["markov_head_type"] = "rnn" if variant == "dspark-rnn" else "vanilla"
        d["confidence_head_with_markov"] = True
    if dialect == "rope_parameters":  # transformers 5
        d["rope_parameters"] = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
    else:  # Qwen3 as first released
        d.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    return d


def _write_deepspec_dir(path, variant: str, dialect: str, *, num_layers: int = 2, seed: int = 0,
                        file_dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {k: (rng.standard_normal(shape) * 0.3 + (1.0 if len(shape) == 1 else 0.0))
               .astype(np.float32).astype(file_dtype)
               for k, shape in _deepspec_shapes(variant, num_layers).items()}
    os.makedirs(path, exist_ok=True)
    on_disk = dict(tensors, **{"rotary_emb.inv_freq": np.ones((HD // 2,), np.float32)})
    save_file(on_disk, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_deepspec_config(variant, dialect, num_layers), f)
    return tensors


@pytest.mark.parametrize("dialect", ["rope_parameters", "rope_theta"])
@pytest.mark.parametrize("variant", ["dspark", "dspark-rnn", "dflash"])
def test_deepspec_directory_loads_with_transposes(variant, dialect, target, tmp_path):
    file_dtype = jnp.bfloat16 if variant == "dspark-rnn" else np.float32  # released: bf16
    tensors = _write_deepspec_dir(tmp_path / "ds", variant, dialect, file_dtype=file_dtype)
    d = registry.load_drafter(tmp_path / "ds", target=target)
    assert isinstance(d, DSparkDrafter)
    cfg = d.config
    assert cfg.variant == ("dflash" if variant == "dflash" else "dspark")
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (5000.0, "linear", 2.0)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids, cfg.num_draft_layers) == \
        (GAMMA, MASK_ID, TAPS, 2)
    assert cfg.markov_rank == (0 if variant == "dflash" else R)
    assert cfg.confidence_head == (variant != "dflash")
    if variant != "dflash":
        assert cfg.markov_head_type == ("rnn" if variant == "dspark-rnn" else "vanilla")
    ours = _variables(d)
    covered = set()
    for name, arr in tensors.items():
        path, transpose = _ours(name)
        want = np.asarray(arr, np.float32)
        want = want.T if transpose else want
        assert ours[path][1].shape == want.shape, name
        np.testing.assert_array_equal(ours[path][1], want, err_msg=name)
        covered.add(path)
    assert set(ours) - covered <= {"confidence_temperatures"}  # nothing left at its init
    assert isinstance(d.embed_tokens.embedding, Frozen) and isinstance(d.lm_head.kernel, Frozen)
    if cfg.confidence_head:
        np.testing.assert_array_equal(ours["confidence_temperatures"][1], np.ones(GAMMA))


def test_specforge_midlayer_eagle3_without_embedding_takes_it_from_target(target, tmp_path):
    d = _make("eagle3", target)
    out = registry.save_drafter(d, tmp_path / "e3")
    with checkpoints.SafetensorsDir(out) as reader:
        tensors = {k: reader[k] for k in reader}
    assert "layers.0.self_attn.q_proj.weight" in tensors  # DeepSpec's Qwen3Eagle3Model names
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()
               if k != "embed_tokens.weight"}
    renamed["d2t"] = np.zeros((V,), np.int64)  # identity vocabulary maps
    renamed["t2d"] = np.ones((V,), np.bool_)
    spec = tmp_path / "specforge"
    os.makedirs(spec)
    save_file(renamed, str(spec / "model.safetensors"))
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["draft_vocab_size"] = V
    with open(spec / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        registry.load_drafter(spec)  # no target to copy the frozen embedding from
    loaded = registry.load_drafter(spec, target=target)
    assert isinstance(loaded, Eagle3Drafter)
    a, b = _variables(d), _variables(loaded)
    for path in a:
        np.testing.assert_array_equal(a[path][1], b[path][1], err_msg=path)
    renamed["d2t"] = np.arange(V, dtype=np.int64)  # a real reduced-vocabulary map
    save_file(renamed, str(spec / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t"):
        registry.load_drafter(spec, target=target)


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.fixture
def dspark_dir(target, tmp_path):
    return registry.save_drafter(_make("dspark", target), tmp_path / "good", target_config=TCFG)


def _edit_config(path, **changes) -> None:
    p = os.path.join(path, "config.json")
    d = json.loads(open(p).read())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(p, "w") as f:
        json.dump(d, f)


def _edit_tensors(path, edit) -> None:
    with checkpoints.SafetensorsDir(path) as reader:
        tensors = {k: reader[k] for k in reader}
    edit(tensors)
    save_file(tensors, os.path.join(path, checkpoints.SAFE_WEIGHTS), metadata={"format": "pt"})


def test_missing_directory_and_config_json_are_named(dspark_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        registry.load_drafter(tmp_path / "nowhere")
    assert "nowhere" in str(e.value)
    os.remove(os.path.join(dspark_dir, "config.json"))
    with pytest.raises(ConfigError, match="config.json") as e:
        registry.load_drafter(dspark_dir)
    assert str(dspark_dir) in str(e.value)


def test_unknown_architecture_is_named(dspark_dir):
    _edit_config(dspark_dir, architectures=["Gemma4DSparkModel"])
    with pytest.raises(ConfigError, match="Gemma4DSparkModel"):
        registry.load_drafter(dspark_dir)


def test_wrong_shaped_tensor_names_key_and_shapes(dspark_dir):
    def edit(t):  # stored in our [r, V] layout instead of torch's [V, r]
        t["markov_head.markov_w2.weight"] = np.ascontiguousarray(t["markov_head.markov_w2.weight"].T)

    _edit_tensors(dspark_dir, edit)
    with pytest.raises(ValueError) as e:
        registry.load_drafter(dspark_dir)
    msg = str(e.value)
    assert "markov_head.markov_w2.weight" in msg and f"[{R}, {V}]" in msg and f"[{V}, {R}]" in msg
    assert str(dspark_dir) in msg


def test_missing_and_extra_tensors_are_named(dspark_dir):
    _edit_tensors(dspark_dir, lambda t: t.pop("fc.weight"))
    with pytest.raises(ValueError, match="'fc.weight'"):
        registry.load_drafter(dspark_dir)

    def edit(t):
        t["fc.weight"] = np.zeros((H, len(TAPS) * H), np.float32)
        t["layers.7.mlp.up_proj.weight"] = np.zeros((FF, H), np.float32)

    _edit_tensors(dspark_dir, edit)
    with pytest.raises(ValueError, match="layers.7.mlp.up_proj.weight"):
        registry.load_drafter(dspark_dir)


def test_missing_tensor_dir_and_missing_or_bad_fields(dspark_dir, tmp_path):
    _edit_config(dspark_dir, mask_token_id=None)
    with pytest.raises(ConfigError, match="mask_token_id"):
        registry.load_drafter(dspark_dir)
    _edit_config(dspark_dir, mask_token_id=MASK_ID, markov_head_type="gated")
    with pytest.raises(ConfigError, match="markov_head_type.*gated"):
        registry.load_drafter(dspark_dir)
    _edit_config(dspark_dir, markov_head_type="vanilla", confidence_temperatures=[1.0, -2.0, 1.0])
    with pytest.raises(ConfigError, match="confidence_temperatures"):
        registry.load_drafter(dspark_dir)
    _edit_config(dspark_dir, confidence_temperatures=None, layer_types=["sliding_attention"] * 2)
    with pytest.raises(ConfigError, match="layer_types"):
        registry.load_drafter(dspark_dir)
    _edit_config(dspark_dir, layer_types=None)
    registry.load_drafter(dspark_dir)  # repaired: loads again
    os.remove(os.path.join(dspark_dir, checkpoints.SAFE_WEIGHTS))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        registry.load_drafter(dspark_dir)


@pytest.mark.parametrize("change, field", [
    (dict(vocab_size=V + 16), "vocab_size"),
    (dict(hidden_size=2 * H, num_attention_heads=8, num_key_value_heads=4), "hidden_size"),
    (dict(num_hidden_layers=1), "target_layer_ids"),  # tap layer 1 needs >= 2 target layers
])
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_incompatible_target_names_the_field(kind, change, field, target, tmp_path):
    out = registry.save_drafter(_make(kind, target), tmp_path / kind)
    other = dataclasses.replace(TCFG, **change)
    with pytest.raises(ConfigError, match=field) as e:
        registry.load_drafter(out, target=other)
    assert "incompatible" in str(e.value) and "config.json" in str(e.value)
    registry.load_drafter(out, target=TCFG)  # the right target is fine


def test_mtp_and_standalone_check_the_target_and_gamma(target, tmp_path):
    mtp = registry.save_drafter(_make("mtp1", target), tmp_path / "mtp")
    lm = registry.save_drafter(_make("standalone", target), tmp_path / "lm")
    wide = dataclasses.replace(TCFG, vocab_size=V + 1)
    for path in (mtp, lm):
        with pytest.raises(ConfigError, match="vocab_size"):
            registry.load_drafter(path, target=wide)
    with pytest.raises(ValueError, match="gamma"):
        registry.load_drafter(mtp, gamma=2)
    assert registry.load_drafter(lm, gamma=5).gamma == 5
    with open(os.path.join(lm, "config.json")) as f:  # a plain Qwen3 LM, as transformers sees it
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["specjax_drafter"] == "standalone"


def test_save_rejects_a_mismatched_target_and_conflicting_extras(target, tmp_path):
    d = _make("dspark", target)
    with pytest.raises(ConfigError, match="vocab_size"):
        registry.save_drafter(d, tmp_path / "a", target_config=dataclasses.replace(TCFG, vocab_size=80))
    with pytest.raises(ValueError, match="block_size"):
        registry.save_drafter(d, tmp_path / "b", extra_config={"block_size": 9})
    with pytest.raises(ValueError, match="unsupported drafter type"):
        registry.save_drafter(nnx.Module(), tmp_path / "c")


def test_export_drafter_entry_point(target, tmp_path):
    d = _make("dflash", target)
    out = registry.export_drafter(d, d.config, tmp_path / "exp", target_config=TCFG)
    assert registry.load_drafter(out).config == d.config
    with pytest.raises(ValueError, match="not the drafter's own config"):
        registry.export_drafter(d, dataclasses.replace(d.config, block_size=5), tmp_path / "bad")


def test_set_confidence_temperatures_in_place(target, tmp_path):
    out = registry.save_drafter(_make("dspark", target), tmp_path / "sts")
    dspark_kind.set_confidence_temperatures(out, [1.0, 2.0, 4.0])
    np.testing.assert_allclose(registry.load_drafter(out).confidence_temperatures[...], [1, 2, 4])
    flash = registry.save_drafter(_make("dflash", target), tmp_path / "flash")
    with pytest.raises(ConfigError, match="confidence head"):
        dspark_kind.set_confidence_temperatures(flash, [1.0, 2.0, 4.0])


# ------------------------------------------------------------------------------------------------
# LLM(drafter=path)


def test_llm_generates_with_a_saved_drafter_directory(target, tmp_path):
    from specjax.api import LLM, SamplingParams
    from specjax.decoding.engine import EngineConfig

    out = registry.save_drafter(_make("dspark", target), tmp_path / "llm_drafter",
                                target_config=TCFG)
    ec = EngineConfig(max_slots=2, max_len=32, max_prefill=16, policy="fixed",
                      slots_buckets=(2,), tokens_buckets=(GAMMA + 1,), prefill_buckets=(16,))
    llm = LLM(target=(target, TCFG), drafter=out, engine_config=ec)
    assert isinstance(llm.drafter, DSparkDrafter)
    prompt, n = [3, 14, 15, 9, 26], 8
    got = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n))[0]
    graph, params = nnx.split(target)
    fwd = jax.jit(lambda p, ids: nnx.merge(graph, p)(ids))
    seq = list(prompt)
    for _ in range(n):  # plain greedy decoding of the target (causal: right padding is inert)
        padded = jnp.array([seq + [0] * (16 - len(seq))], jnp.int32)
        seq.append(int(jnp.argmax(fwd(params, padded)[0, len(seq) - 1])))
    assert got.token_ids == seq[len(prompt):]  # speculation must not change greedy output
    assert got.metrics["num_draft_tokens"] > 0
