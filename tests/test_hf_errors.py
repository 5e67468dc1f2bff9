"""Bad checkpoints give clear errors that name the problem (file, field, tensor, shapes)."""
from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

try:
    from tests.hf_fixtures import make_tiny_qwen3
except ImportError:  # tests/ itself on sys.path
    from hf_fixtures import make_tiny_qwen3

from specjax import checkpoints
from specjax.config import ConfigError


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("hf_errors"), hidden=32, heads=4, kv_heads=2,
                           head_dim=8, layers=2, vocab=61, intermediate=48)


@pytest.fixture
def ckpt(base, tmp_path):
    """A private copy of the base checkpoint that a test may damage."""
    return shutil.copytree(base, tmp_path / "ckpt")


def _rewrite_tensors(path, edit) -> None:
    tensors = dict(checkpoints.read_safetensors_dir(path))
    edit(tensors)
    save_file(tensors, os.path.join(path, checkpoints.SAFE_WEIGHTS), metadata={"format": "pt"})


def _edit_config(path, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(d, f)


def test_base_checkpoint_loads(ckpt):
    model, cfg = checkpoints.load_target(ckpt)  # the damage in the other tests is what fails them
    assert cfg.vocab_size == 61 and model.lm_head is not None


def test_missing_config_json_names_the_path(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(ConfigError, match="config.json") as e:
        checkpoints.load_target(ckpt)
    assert str(ckpt) in str(e.value)


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as e:
        checkpoints.load_target(tmp_path / "nowhere")
    assert "nowhere" in str(e.value)


def test_unsupported_architecture_is_named(ckpt):
    _edit_config(ckpt, architectures=["MistralForCausalLM"])
    with pytest.raises(ConfigError, match="'MistralForCausalLM'.*supported: Qwen3ForCausalLM"):
        checkpoints.load_target(ckpt)
    _edit_config(ckpt, architectures=["LlamaForCausalLM"])  # a family that disagrees with model_type
    with pytest.raises(ConfigError, match="model_type 'qwen3' does not match.*LlamaForCausalLM"):
        checkpoints.load_target(ckpt)


def test_wrong_shape_names_key_and_shapes(ckpt):
    key = "model.layers.1.self_attn.k_proj.weight"  # HF [kv*hd, hidden] = [16, 32]

    def edit(t):
        t[key] = np.zeros((12, 32), np.float32)

    _rewrite_tensors(ckpt, edit)
    with pytest.raises(ValueError) as e:
        checkpoints.load_target(ckpt)
    msg = str(e.value)
    assert key in msg and "[12, 32]" in msg and "[16, 32]" in msg


def test_missing_tensor_is_named(ckpt):
    _rewrite_tensors(ckpt, lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    with pytest.raises(ValueError, match="missing tensor") as e:
        checkpoints.load_target(ckpt)
    assert "model.layers.0.post_attention_layernorm.weight" in str(e.value)


def test_untied_checkpoint_without_lm_head_is_refused(ckpt):
    _rewrite_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        checkpoints.load_target(ckpt)


def test_unexpected_extra_tensor_is_named(ckpt):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros((32,), np.float32)

    _rewrite_tensors(ckpt, edit)
    with pytest.raises(ValueError, match="unexpected") as e:
        checkpoints.load_target(ckpt)
    assert "model.layers.0.self_attn.q_proj.bias" in str(e.value)


def test_harmless_extras_are_ignored(ckpt, base):
    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((4,), np.float32)
        t["model.rotary_emb.inv_freq"] = np.ones((4,), np.float32)

    _rewrite_tensors(ckpt, edit)
    model, cfg = checkpoints.load_target(ckpt)
    ref, ref_cfg = checkpoints.load_target(base)
    assert cfg == ref_cfg
    # every parameter is the checkpoint's own (the inv_freq extras neither land anywhere nor shift
    # anything), and the model computes what the clean checkpoint's does
    got, want = nnx.to_flat_state(nnx.state(model, nnx.Param)), nnx.to_flat_state(nnx.state(ref, nnx.Param))
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(k))
    ids = jnp.asarray([[1, 5, 9, 2]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))


def test_tied_config_ignores_a_stored_lm_head_copy(ckpt):
    _edit_config(ckpt, tie_word_embeddings=True)
    model, cfg = checkpoints.load_target(ckpt)
    assert cfg.tie_word_embeddings and model.lm_head is None


def test_bare_backbone_names_load_like_prefixed_ones(ckpt, base):
    def edit(t):
        for k in [k for k in t if k.startswith("model.")]:
            t[k[len("model."):]] = t.pop(k)

    _rewrite_tensors(ckpt, edit)
    model, _ = checkpoints.load_target(ckpt)
    ref, _ = checkpoints.load_target(base)
    np.testing.assert_array_equal(np.asarray(model.model.layers[1].mlp.gate_up_proj.kernel[...]),
                                  np.asarray(ref.model.layers[1].mlp.gate_up_proj.kernel[...]))


def test_pytorch_bin_only_dir_is_refused(ckpt):
    os.remove(ckpt / checkpoints.SAFE_WEIGHTS)
    (ckpt / "pytorch_model.bin").write_bytes(b"not a pickle; must never be opened")
    with pytest.raises(ValueError, match="safetensors is required") as e:
        checkpoints.load_target(ckpt)
    assert "pytorch_model.bin" in str(e.value)


def test_no_weights_at_all_is_named(ckpt):
    os.remove(ckpt / checkpoints.SAFE_WEIGHTS)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoints.load_target(ckpt)


def test_index_listing_a_missing_shard_is_named(tmp_path):
    path = make_tiny_qwen3(tmp_path, vocab=61, max_shard_size="20KB")
    index = json.loads((path / checkpoints.SAFE_INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.remove(path / shard)
    with pytest.raises(FileNotFoundError, match=shard):
        checkpoints.load_target(path)


def test_yarn_rope_scaling_is_refused_naming_the_type(ckpt):
    _edit_config(ckpt, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                        "original_max_position_embeddings": 32768})
    with pytest.raises(ConfigError, match="yarn"):
        checkpoints.load_target(ckpt)


def test_yarn_rope_scaling_old_dialect_is_refused(ckpt):
    cfg_path = ckpt / "config.json"
    d = json.loads(cfg_path.read_text())
    d.pop("rope_parameters", None)
    d.update(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0})
    cfg_path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="yarn"):
        checkpoints.load_target(ckpt)


def test_export_refuses_a_model_that_does_not_match_the_config(ckpt, tmp_path):
    import dataclasses

    model, cfg = checkpoints.load_target(ckpt)
    wrong = dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size * 2)
    with pytest.raises(ValueError, match="do not match the config"):
        checkpoints.export_target(model, wrong, tmp_path / "out")
    assert not (tmp_path / "out" / checkpoints.SAFE_WEIGHTS).exists()
