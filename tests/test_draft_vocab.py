"""Draft vocabularies (specjax.drafters.vocab): building the subset, the maps, drafting over it, the
losses with labels outside it, and exact verification in the engine (chi-square at T=1)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.sampling import SamplingArrays
from specjax.drafters import vocab as dv
from specjax.drafters.base import ContextUpdate
from specjax.drafters.dspark import BlockDrafterConfig
from specjax.drafters.dspark import make_block_drafter
from specjax.drafters.eagle3 import Eagle3Config, make_eagle3_drafter
from specjax.drafters.mtp import MTPConfig, make_mtp_drafter
from specjax.models.decoder import CausalLM
from specjax.drafters import losses
from specjax.training.config import ModelConfig
from specjax.training.objectives import make_objective

from engine_fixtures import drafter_pvalue, exact_continuations, tiny_target

V, GAMMA, PROMPT = 8, 3, [1, 5, 2, 1, 5]
DRAFT_IDS = np.array([1, 2, 4, 5, 6])  # N = 5 of V = 8


# ------------------------------------------------------------------------------------------------
# building the subset


def test_token_counts_and_build_draft_vocab():
    seqs = [np.array([3, 3, 3, 1, 2, 2, 7]), np.array([2, 0, 5, 5])]
    masks = [np.array([1, 1, 1, 1, 1, 1, 0]), np.ones(4)]
    c = dv.token_counts(seqs, 8, masks)
    np.testing.assert_array_equal(c, [1, 1, 3, 3, 0, 2, 0, 0])  # the masked-out 7 is not counted
    choice = dv.build_draft_vocab(c, 3)
    np.testing.assert_array_equal(choice.draft_ids, [2, 3, 5])  # ties broken toward the lower id
    assert choice.coverage == pytest.approx(8 / 10)
    forced = dv.build_draft_vocab(c, 3, always=[7])
    np.testing.assert_array_equal(forced.draft_ids, [2, 3, 7])
    assert forced.coverage == pytest.approx(6 / 10)
    assert dv.build_draft_vocab(c, 8).coverage == 1.0
    with pytest.raises(ValueError, match=r"size must be in \[1, 8\]"):
        dv.build_draft_vocab(c, 9)
    with pytest.raises(ValueError, match="token ids must lie in"):
        dv.token_counts([np.array([8])], 8)


def test_checkpoint_tensors_round_trip_and_errors():
    ids = np.array([0, 3, 4, 9])
    d2t, t2d = dv.d2t_offsets(ids), dv.t2d_mask(ids, 10)
    np.testing.assert_array_equal(d2t, [0, 2, 2, 6])  # EAGLE-3: target = draft + d2t[draft]
    assert t2d.dtype == np.bool_ and t2d.sum() == 4
    np.testing.assert_array_equal(dv.draft_ids_from_tensors(d2t, t2d, 10), ids)
    bad = t2d.copy()
    bad[1] = True
    with pytest.raises(ValueError, match="'t2d'.*does not mark exactly"):
        dv.draft_ids_from_tensors(d2t, bad, 10)
    with pytest.raises(ValueError, match="repeated ids"):
        dv.draft_ids_from_tensors(np.array([0, -1]), None, 10)
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size=10\)"):
        dv.draft_ids_from_tensors(np.array([0, 20]), None, 10)


def test_draft_vocab_module_maps():
    voc = dv.DraftVocab(8, 5)
    voc.set_ids(DRAFT_IDS)
    np.testing.assert_array_equal(voc.to_draft(jnp.arange(8)), [5, 0, 1, 5, 2, 3, 4, 5])
    np.testing.assert_array_equal(dv.draft_labels(voc, jnp.arange(8)), [-1, 0, 1, -1, 2, 3, 4, -1])
    np.testing.assert_array_equal(voc.to_target(jnp.arange(5)), DRAFT_IDS)
    q = voc.scatter_probs(jnp.full((2, 5), 0.2))
    assert q.shape == (2, 8) and np.allclose(q.sum(-1), 1.0) and float(q[:, [0, 3, 7]].max()) == 0.0
    with pytest.raises(ValueError, match="expected draft_vocab_size=5"):
        voc.set_ids(np.arange(4))
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        BlockDrafterConfig(vocab_size=8, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, target_layer_ids=(0,),
                           mask_token_id=7, draft_vocab_size=9)


# ------------------------------------------------------------------------------------------------
# drafters over a subset


def make(kind: str, target, draft_ids=DRAFT_IDS):
    cfg = target.config
    n = len(draft_ids)
    rngs = nnx.Rngs(4)
    if kind in ("dspark", "dspark-rnn", "dflash"):
        bcfg = BlockDrafterConfig.from_target(
            cfg, target_layer_ids=(0, 1), mask_token_id=V - 1, num_draft_layers=1, block_size=GAMMA,
            markov_rank=0 if kind == "dflash" else 8,
            markov_head_type="rnn" if kind == "dspark-rnn" else "vanilla",
            confidence_head=kind != "dflash", draft_vocab_size=n)
        return make_block_drafter(target, cfg, bcfg, rngs, draft_ids=draft_ids)
    if kind == "eagle3":
        ecfg = Eagle3Config.from_target(cfg, target_layer_ids=(0, 1), gamma=GAMMA, draft_vocab_size=n)
        return make_eagle3_drafter(target, ecfg, rngs, draft_ids=draft_ids)
    if kind == "mtp1":
        return make_mtp_drafter(target, MTPConfig.from_target(cfg, draft_vocab_size=n), rngs,
                                draft_ids=draft_ids)
    raise ValueError(kind)


@pytest.fixture(scope="module")
def model():
    return tiny_target(V, seed=11, layers=3, init_scale=3.0)


@pytest.mark.parametrize("kind", ["dspark", "dspark-rnn", "dflash", "eagle3", "mtp1"])
def test_subset_drafter_shapes_and_proposals(kind, model):
    d = make(kind, model)
    heads = d.shared_head.head if kind == "mtp1" else d.lm_head
    assert heads.kernel[...].shape == (model.config.hidden_size, 5)  # an N-wide lm_head
    target_head = np.asarray(model.model.embed_tokens.embedding[...]).T if model.lm_head is None \
        else np.asarray(model.lm_head.kernel[...])
    np.testing.assert_allclose(heads.kernel[...], target_head[:, DRAFT_IDS])
    if kind.startswith("dspark"):
        assert d.markov_head.markov_w1.embedding[...].shape == (6, 8)  # N + 1 rows ("other")
        assert d.markov_head.markov_w2.kernel[...].shape == (8, 5)
    st = d.init_state(4, 16)
    h = model.config.hidden_size
    upd = ContextUpdate(tokens=jnp.tile(jnp.array([[1, 3, 7, 0]], jnp.int32), (4, 1)),
                        positions=jnp.tile(jnp.arange(4, dtype=jnp.int32), (4, 1)),
                        taps=jnp.ones((4, 4, 2 * h)), hidden=jnp.ones((4, 4, h)),
                        n_valid=jnp.full((4,), 3, jnp.int32))
    st = d.commit(st, upd)
    anchors = jnp.array([0, 3, 7, 5], jnp.int32)  # three anchors outside the draft vocabulary
    keys = jax.random.split(jax.random.key(0), 4)
    for t in (1.0, 0.0):
        blk, z = d.propose_with_logits(st, anchors, jnp.full((4,), 3, jnp.int32),
                                       SamplingArrays.broadcast(4, t), keys)
        assert blk.q.shape == (4, d.gamma, V) and z.shape == (4, d.gamma, V)
        np.testing.assert_allclose(blk.q.sum(-1), 1.0, atol=1e-6)
        outside = np.setdiff1d(np.arange(V), DRAFT_IDS)
        assert float(blk.q[..., outside].max()) == 0.0 and np.all(np.isneginf(z[..., outside]))
        assert np.isin(np.asarray(blk.tokens), DRAFT_IDS).all()
        picked = np.take_along_axis(np.asarray(blk.q), np.asarray(blk.tokens)[..., None], -1)
        assert picked.min() > 0  # each token was drawn from the q handed to verification


# ------------------------------------------------------------------------------------------------
# exactness in the engine


class MismappedVocab(dv.DraftVocab):
    """Negative control: the drafter proposes the target token of the next draft index, so the q
    verification reads (over the draft vocabulary's columns) is q at the wrong token."""

    def to_target(self, draft):
        return super().to_target((draft.astype(jnp.int32) + 1) % self.size)


_EXACT = {}


def exact(model):
    if "t1" not in _EXACT:
        _EXACT["t1"] = exact_continuations(model, PROMPT, 3, temperature=1.0)
    return _EXACT["t1"]


def engine_pvalue(model, drafter) -> float:
    return drafter_pvalue(model, drafter, PROMPT, exact(model), temperature=1.0)


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp1"])
def test_subset_drafter_in_engine_is_exact(kind, model):
    p = engine_pvalue(model, make(kind, model))
    assert p > 1e-3, f"{kind} with a draft vocabulary changed the output distribution (p={p:.2e})"


def test_negative_control_q_at_the_wrong_token_is_detected(model):
    d = make("dspark", model)
    wrong = MismappedVocab(V, len(DRAFT_IDS))
    wrong.set_ids(DRAFT_IDS)
    d.draft_vocab = wrong
    p = engine_pvalue(model, d)
    assert p < 1e-6, f"the chi-square test did not catch q read at the wrong token (p={p:.2e})"


# ------------------------------------------------------------------------------------------------
# losses and objectives


def test_losses_leave_out_of_vocab_labels_out_of_ce():
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(1, 2, 3, 5)), jnp.float32)
    t = jnp.asarray(rng.normal(size=(1, 2, 3, 5)), jnp.float32)
    labels = jnp.array([[[0, -1, 2], [4, 1, -1]]], jnp.int32)
    mask = jnp.ones((1, 2, 3))
    _, m = losses.dspark_loss(z, t, labels, mask)
    logp = jax.nn.log_softmax(z, -1)
    w = np.exp(-np.arange(3) / 4.0)
    keep = [(0, 0, 0), (0, 0, 2), (0, 1, 0), (0, 1, 1)]
    want = sum(w[k] * -float(logp[b, a, k, int(labels[b, a, k])]) for b, a, k in keep) / \
        sum(w[k] for _, _, k in keep)
    assert float(m["ce"]) == pytest.approx(want, rel=1e-5)
    assert float(m["label_in_vocab"]) == pytest.approx(4 / 6)
    clipped, _ = losses.dspark_slot_terms(z, t, jnp.maximum(labels, 0))  # control: -1 read as 0
    assert float(clipped[0, 0, 1]) > 0
    _, mm = losses.mtp_loss(z[0], t[0], labels[0], mask[0])  # unweighted mean over the same slots
    want_mtp = sum(-float(logp[0, a, k, int(labels[0, a, k])]) for _, a, k in keep) / len(keep)
    assert float(mm["ce"]) == pytest.approx(want_mtp, rel=1e-5)


TCFG = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    tie_word_embeddings=True, max_position_embeddings=64, rope_theta=1e4)


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp"])
def test_objectives_train_a_subset_drafter(kind):
    target = CausalLM(TCFG, rngs=nnx.Rngs(1))
    gd, aux = nnx.split(target)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 63, (2, 16)).astype(np.int32)
    lm = np.zeros((2, 16), np.uint8)
    lm[:, 4:13] = 1
    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(lm),
             "valid": jnp.full((2,), 13, jnp.int32)}
    choice = dv.build_draft_vocab(dv.token_counts([ids], 64, [lm]), 16)
    own = {"dspark": dict(target_layer_ids=(0, 1, 2), num_draft_layers=1, block_size=3,
                          mask_token_id=63, markov_rank=4, num_anchors=4),
           "eagle3": dict(target_layer_ids=(0, 1, 2), num_draft_layers=1, block_size=3),
           "mtp": {}}[kind]
    mc = ModelConfig.from_mapping(dict(kind=kind, target="unused", compute_dtype="float32",
                                       draft_vocab_size=16, **own))
    with pytest.raises(ConfigError, match="needs draft_ids"):
        make_objective(mc, target, TCFG, target_graphdef=gd)
    obj = make_objective(mc, target, TCFG, target_graphdef=gd, feature_dtype=jnp.float32,
                         draft_ids=choice.draft_ids)
    graph, params, rest = nnx.split(obj.drafter, nnx.Param, ...)

    def f(p):
        return obj.loss_fn(nnx.merge(graph, p, rest), batch, jax.random.PRNGKey(0), aux)

    (loss, _), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads)) > 0


# ------------------------------------------------------------------------------------------------
# checkpoints


def _propose(d, model):
    st = d.init_state(2, 16)
    h = model.config.hidden_size
    upd = ContextUpdate(tokens=jnp.array([[1, 3, 7, 0]] * 2, jnp.int32),
                        positions=jnp.tile(jnp.arange(4, dtype=jnp.int32), (2, 1)),
                        taps=jnp.ones((2, 4, 2 * h)), hidden=jnp.ones((2, 4, h)),
                        n_valid=jnp.full((2,), 3, jnp.int32))
    return d.propose(d.commit(st, upd), jnp.array([0, 5], jnp.int32), jnp.full((2,), 3, jnp.int32),
                     SamplingArrays.broadcast(2, 1.0), jax.random.split(jax.random.key(3), 2))


@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp1"])
def test_subset_drafter_save_load_round_trip(kind, model, tmp_path):
    import json

    from safetensors.numpy import load_file

    from specjax.drafters.registry import load_drafter, save_drafter

    d = make(kind, model)
    out = save_drafter(d, tmp_path / kind, target_config=model.config)
    cfg = json.loads((tmp_path / kind / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 5 and cfg["vocab_size"] == V
    t = load_file(str(tmp_path / kind / "model.safetensors"))
    np.testing.assert_array_equal(t["d2t"], DRAFT_IDS - np.arange(5))
    np.testing.assert_array_equal(np.flatnonzero(t["t2d"]), DRAFT_IDS)
    back = load_drafter(out, target=model)
    np.testing.assert_array_equal(back.draft_vocab.draft_ids(), DRAFT_IDS)
    a, b = nnx.state(d), nnx.state(back)
    for (pa, va), (pb, vb) in zip(jax.tree_util.tree_leaves_with_path(a),
                                  jax.tree_util.tree_leaves_with_path(b)):
        assert pa == pb
        np.testing.assert_array_equal(va, vb, err_msg=str(pa))
    pa, pb = _propose(d, model), _propose(back, model)
    np.testing.assert_array_equal(pa.tokens, pb.tokens)
    np.testing.assert_allclose(pa.q, pb.q, atol=1e-6)
    # the maps must come with a draft_vocab_size config, and vice versa
    del t["d2t"]
    from safetensors.numpy import save_file
    save_file(t, str(tmp_path / kind / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'd2t'"):
        load_drafter(out, target=model)
