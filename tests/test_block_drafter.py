"""DSpark / DFlash drafter (block backbone + heads): masks, train/infer equivalence, caches, frozen parts."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig, from_dict, to_dict
from specjax.sampling import SamplingArrays, probs_from_logits
from specjax.drafters.base import ContextUpdate, Drafter
from specjax.drafters.common import Frozen, attend_context_and_block, default_target_layer_ids
from specjax.drafters.dspark import BlockDrafterConfig, DSparkDrafter, make_block_drafter
from specjax.drafters.dspark_layers import ConfidenceHead, MarkovHead, RNNHead
from specjax.models.layers import gqa_attention
from specjax.models.decoder import CausalLM

V, H = 64, 32
MASK_ID = V - 1
TAPS = (-1, 1)
GAMMA = 3
TCFG = TargetConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
VARIANTS = {
    "dflash": dict(markov_rank=0, confidence_head=False),
    "vanilla": dict(markov_rank=8, markov_head_type="vanilla", confidence_head=True),
    "rnn": dict(markov_rank=8, markov_head_type="rnn", confidence_head=True),
    "conf_only": dict(markov_rank=0, confidence_head=True, confidence_head_with_markov=False),
}


def _scramble(module: nnx.Module, seed: int, std: float = 0.3) -> None:
    """Redraw every trainable Param (norm weights too) so that bugs show up in the outputs."""
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.RandomState(seed)
    new = [jnp.asarray((1.0 if x.ndim == 1 else 0.0) + std * rng.standard_normal(x.shape), x.dtype)
           for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


class _Jit:
    """Call a module's methods through jax.jit on its split state, as the engine does."""

    def __init__(self, module: nnx.Module):
        self.graphdef, self.state = nnx.split(module)
        self._fns: dict = {}

    def refresh(self, module: nnx.Module) -> "_Jit":
        """Take the module's current values (same graph: no recompilation)."""
        self.state = nnx.state(module)
        return self

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("graphdef", "state"):
            raise AttributeError(name)
        if name not in self._fns:
            g = self.graphdef
            self._fns[name] = jax.jit(lambda st, *a: getattr(nnx.merge(g, st), name)(*a))
        fn = self._fns[name]
        return lambda *a: fn(self.state, *a)


@pytest.fixture(scope="module")
def target() -> CausalLM:
    t = CausalLM(TCFG, rngs=nnx.Rngs(0))
    _scramble(t, 1, std=0.2)
    return t


def _cfg(variant: str, **kw) -> BlockDrafterConfig:
    args = dict(target_layer_ids=TAPS, mask_token_id=MASK_ID, num_draft_layers=2, block_size=GAMMA)
    args.update(VARIANTS[variant])
    args.update(kw)
    return BlockDrafterConfig.from_target(TCFG, **args)


_DRAFTERS: dict = {}


def _drafter(target, variant: str, seed: int = 3) -> DSparkDrafter:
    """A scrambled drafter of `variant` (built once per module; each call returns a clone)."""
    key = (id(target), variant, seed)
    if key not in _DRAFTERS:
        d = make_block_drafter(target, TCFG, _cfg(variant), nnx.Rngs(seed))
        _scramble(d, seed + 10)
        _DRAFTERS[key] = d
    return nnx.clone(_DRAFTERS[key])


_DATA: dict = {}


def _data(target, b: int, s: int, seed: int = 0):
    """Random ids [b, s] and the target's concatenated taps there (cached per arguments)."""
    if (id(target), b, s, seed) not in _DATA:
        ids = jnp.asarray(np.random.RandomState(seed).randint(0, V - 1, (b, s)), jnp.int32)
        g, st = nnx.split(target)
        taps = jax.jit(lambda st, ids: jnp.concatenate(nnx.merge(g, st).forward(
            ids, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), tap_layers=TAPS,
            logits="none").taps, axis=-1))(st, ids)
        _DATA[(id(target), b, s, seed)] = (ids, taps)
    return _DATA[(id(target), b, s, seed)]


def _update(ids, taps, start_b, n_b, t: int) -> ContextUpdate:
    """Rows' tokens/taps at positions start_b + 0..t-1 (n_b of them real)."""
    s = ids.shape[1]
    pos = jnp.asarray(start_b, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    idx = jnp.clip(pos, 0, s - 1)
    return ContextUpdate(tokens=jnp.take_along_axis(ids, idx, axis=1), positions=pos,
                         taps=jnp.take_along_axis(taps, idx[..., None], axis=1), hidden=None,
                         n_valid=jnp.asarray(n_b, jnp.int32))


def _same(x, y) -> bool:
    return np.allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- config and structure

def test_config_validation_and_roundtrip():
    cfg = _cfg("vanilla")
    assert cfg.hidden_size == H and cfg.num_taps == 2 and cfg.variant == "dspark"
    assert _cfg("dflash").variant == "dflash"
    assert from_dict(BlockDrafterConfig, to_dict(cfg)) == cfg
    bad = [(dict(markov_head_type="gated"), "markov_head_type"), (dict(block_size=0), "block_size"),
           (dict(mask_token_id=V), "mask_token_id"), (dict(target_layer_ids=()), "target_layer_ids"),
           (dict(target_layer_ids=(1, 1)), "target_layer_ids"),
           (dict(markov_rank=-1), "markov_rank"),
           (dict(markov_rank=0, confidence_head=True), "confidence_head_with_markov")]
    for kw, field in bad:
        with pytest.raises(ConfigError, match=field):
            dataclasses.replace(cfg, **kw)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        BlockDrafterConfig.from_target(TCFG, target_layer_ids=(3,), mask_token_id=0)
    with pytest.raises(ConfigError, match="hidden_size"):
        dataclasses.replace(cfg, hidden_size=16, num_attention_heads=2).check_target(TCFG)
    assert default_target_layer_ids(36) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(40) == (1, 10, 19, 28, 37)
    with pytest.raises(ConfigError):
        default_target_layer_ids(4)


def test_structure_names_and_protocol(target):
    d = _drafter(target, "rnn")
    assert isinstance(d, Drafter) and d.gamma == GAMMA and d.tap_layers == TAPS
    assert d.needs_hidden is False
    paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(d))}
    for name in ["embed_tokens/embedding", "fc/kernel", "hidden_norm/weight", "norm/weight",
                 "lm_head/kernel", "layers/1/input_layernorm/weight",
                 "layers/0/self_attn/q_proj/kernel", "layers/0/self_attn/k_norm/weight",
                 "layers/0/post_attention_layernorm/weight", "layers/0/mlp/down_proj/kernel",
                 "markov_head/markov_w1/embedding", "markov_head/markov_w2/kernel",
                 "markov_head/joint_proj/kernel", "markov_head/joint_proj/bias",
                 "confidence_head/proj/kernel", "confidence_head/proj/bias",
                 "confidence_temperatures"]:
        assert name in paths, name
    assert d.fc.kernel[...].shape == (2 * H, H)
    assert d.markov_head.joint_proj.kernel[...].shape == (2 * 8 + H, 3 * 8)
    assert d.confidence_head.proj.kernel[...].shape == (H + 8, 1)
    assert isinstance(d.embed_tokens.embedding, Frozen) and isinstance(d.lm_head.kernel, Frozen)
    flat = _drafter(target, "dflash")
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(flat))}
    assert not any(n.startswith(("markov_head", "confidence_head")) for n in names)
    assert _drafter(target, "conf_only").confidence_head.proj.kernel[...].shape == (H, 1)


@pytest.mark.parametrize("tied", [False, True])
def test_make_block_drafter_copies_target_embedding_and_head(tied):
    tcfg = dataclasses.replace(TCFG, tie_word_embeddings=tied)
    tgt = CausalLM(tcfg, rngs=nnx.Rngs(5))
    _scramble(tgt, 6)
    d = make_block_drafter(tgt, tcfg, _cfg("dflash"), nnx.Rngs(1))
    ids = jnp.arange(V)[None, :]
    np.testing.assert_array_equal(d.embed_tokens(ids), tgt.embed(ids))
    h = jnp.asarray(np.random.RandomState(0).standard_normal((2, 5, H)), jnp.float32)
    np.testing.assert_allclose(d.lm_logits(h), tgt.logits(h), atol=1e-5)
    with pytest.raises(ConfigError, match="vocab_size"):
        make_block_drafter(tgt, dataclasses.replace(tcfg, vocab_size=V + 1), _cfg("dflash"))


def test_head_formulas_against_numpy():
    """Markov bias W2 W1[x], RNN recurrence (reference §3.4) and confidence logit, in numpy."""
    r, k = 8, GAMMA
    rng = np.random.RandomState(3)
    h = rng.standard_normal((2, k, H)).astype(np.float32)
    prev = rng.randint(0, V, (2, k))
    markov = MarkovHead(V, r, rngs=nnx.Rngs(0))
    rnn = RNNHead(V, r, H, rngs=nnx.Rngs(1))
    conf = ConfidenceHead(H + r, rngs=nnx.Rngs(2))
    for m in (markov, rnn, conf):
        _scramble(m, 4)
    w1, w2 = (np.asarray(markov.markov_w1.embedding[...]), np.asarray(markov.markov_w2.kernel[...]))
    np.testing.assert_allclose(markov.bias_sequence(jnp.asarray(h), jnp.asarray(prev)),
                               w1[prev] @ w2, atol=1e-5)
    w1, w2 = (np.asarray(rnn.markov_w1.embedding[...]), np.asarray(rnn.markov_w2.kernel[...]))
    wj, bj = np.asarray(rnn.joint_proj.kernel[...]), np.asarray(rnn.joint_proj.bias[...])
    s = np.zeros((2, r), np.float32)
    want = []
    for j in range(k):
        y = np.concatenate([s, w1[prev[:, j]], h[:, j]], -1) @ wj + bj
        g, c, o = 1 / (1 + np.exp(-y[:, :r])), np.tanh(y[:, r:2 * r]), y[:, 2 * r:]
        want.append(np.tanh(o) @ w2)
        s = g * s + (1 - g) * c
    np.testing.assert_allclose(rnn.bias_sequence(jnp.asarray(h), jnp.asarray(prev)),
                               np.stack(want, 1), atol=1e-5)
    wc, bc = np.asarray(conf.proj.kernel[...]), np.asarray(conf.proj.bias[...])
    np.testing.assert_allclose(conf(jnp.asarray(h), jnp.asarray(w1[prev])),
                               (np.concatenate([h, w1[prev]], -1) @ wc + bc)[..., 0], atol=1e-5)


# ---------------------------------------------------------------- attention / masks

def test_two_part_attention_equals_gqa_attention_on_concat():
    rng = np.random.RandomState(0)
    b, t, s, nh, nkv, hd = 2, 3, 6, 4, 2, 8

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, kc, vc, kb, vb = (rand(b, t, nh, hd), rand(b, s, nkv, hd), rand(b, s, nkv, hd),
                         rand(b, t, nkv, hd), rand(b, t, nkv, hd))
    mc = np.broadcast_to(np.arange(s)[None, None, :] < np.array([4, 0])[:, None, None], (b, t, s))
    mb = np.ones((b, t, t), bool)
    mb[1, 2] = False  # row (1, 2) sees nothing at all
    got = jax.jit(attend_context_and_block)(q, kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3), mc, kb, vb, mb)
    want = jax.jit(gqa_attention)(q, jnp.concatenate([kc, kb], 1), jnp.concatenate([vc, vb], 1),
                                  np.concatenate([mc, mb], -1))
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.all(np.asarray(got[1, 2]) == 0.0) and np.all(np.isfinite(np.asarray(got)))


def test_block_mask_positions_and_label_alignment(target):
    """Reference §12: anchors 5 and 9, S=12, K=3, as seen through the training forward."""
    d = _Jit(_drafter(target, "vanilla"))
    ids, taps = _data(target, 2, 12)
    anchors = jnp.array([[5, 9], [5, 9]])
    keep = jnp.ones((2, 2), bool)
    h, z, c = d.train_forward(taps, ids, anchors, keep)
    assert h.shape == (2, 2, GAMMA, H) and z.shape == (2, 2, GAMMA, V) and c.shape == (2, 2, GAMMA)
    assert z.dtype == jnp.float32 and c.dtype == jnp.float32

    def fwd(taps_=taps, ids_=ids, keep_=keep):
        return d.train_forward(taps_, ids_, anchors, keep_)

    # Context at t >= 5 (including the anchor's own position) is hidden from block 0 only.
    for t in (5, 6, 8):
        h2, z2, c2 = fwd(taps.at[0, t].add(1.0))
        assert _same(h2[0, 0], h[0, 0]) and _same(z2[0, 0], z[0, 0]) and _same(c2[0, 0], c[0, 0])
        assert not _same(h2[0, 1], h[0, 1]), t
        assert _same(h2[1], h[1])  # rows are independent
    # Context at t = 4 < 5 is seen by both blocks; t >= 9 by neither.
    h2, _, _ = fwd(taps.at[0, 4].add(1.0))
    assert not _same(h2[0, 0], h[0, 0]) and not _same(h2[0, 1], h[0, 1])
    h2, _, _ = fwd(taps.at[:, 9:].add(1.0))
    assert _same(h2, h)
    # A block token (block 1's anchor) changes every slot of block 1 (bidirectional) and not block 0.
    ids2 = ids.at[0, 9].set((ids[0, 9] + 1) % (V - 1))
    h2, z2, c2 = fwd(ids_=ids2)
    assert _same(h2[0, 0], h[0, 0]) and _same(z2[0, 0], z[0, 0]) and _same(c2[0, 0], c[0, 0])
    assert all(not _same(h2[0, 1, j], h[0, 1, j]) for j in range(GAMMA))
    # Teacher-forced prev tokens: slot j's Markov bias uses ids[a+j]; ids[6] only moves slot 1 of
    # block 0 (the hidden state is unchanged: ids[6] is not an input of any block).
    ids3 = ids.at[0, 6].set((ids[0, 6] + 1) % (V - 1))
    h3, z3, c3 = fwd(ids_=ids3)
    assert _same(h3, h)
    assert _same(z3[0, 0, 0], z[0, 0, 0]) and _same(z3[0, 0, 2], z[0, 0, 2])
    assert not _same(z3[0, 0, 1], z[0, 0, 1]) and not _same(c3[0, 0, 1], c[0, 0, 1])
    prev = d.teacher_prev_tokens(ids, jnp.array([[9, 10], [0, 1]]))
    np.testing.assert_array_equal(prev[0, 0], ids[0, 9:12])
    np.testing.assert_array_equal(prev[0, 1], ids[0, jnp.array([10, 11, 11])])
    # Positions: the same anchor block shifted by one position (context shifted along) differs.
    h5, _, _ = d.train_forward(taps, ids, jnp.array([[5, 9], [6, 9]]), keep)
    assert not _same(h5[1, 0], h[1, 0]) and _same(h5[1, 1], h[1, 1])
    # A dummy block: finite outputs and the kept block is unaffected.
    h4, z4, c4 = fwd(keep_=jnp.array([[True, False], [True, True]]))
    for x in (h4, z4, c4):
        assert np.all(np.isfinite(np.asarray(x)))
    assert _same(h4[0, 0], h[0, 0]) and _same(z4[0, 0], z[0, 0]) and _same(h4[1], h[1])
    # ... and the dummy block sees no context at all (nor its own anchor token: slot 0 is a mask).
    dummy = jnp.array([[True, False], [True, True]])
    h6, _, _ = fwd(taps.at[0, :9].add(1.0), ids.at[0, 9].set(0), dummy)
    assert _same(h6[0, 1], h4[0, 1]) and not _same(h6[0, 0], h4[0, 0])


# ---------------------------------------------------------------- train / inference

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_train_inference_equivalence(target, variant):
    drafter = _drafter(target, variant)
    d = _Jit(drafter)
    b = 2
    ids, taps = _data(target, b, 12)
    a = jnp.array([7, 4], jnp.int32)
    state = d.commit(drafter.init_state(3, 16), _update(ids, taps, jnp.zeros(b), a, 8))
    np.testing.assert_array_equal(state.lengths, [7, 4, 0])
    for kvbuf in state.kv:  # slot 2 is not part of the update: untouched
        assert np.all(np.asarray(kvbuf[:, 2]) == 0.0)
    anchor = ids[jnp.arange(b), a]
    keys = jax.random.split(jax.random.key(7), b)
    keep = jnp.ones((b, 1), bool)
    for temp in (1.0, 0.0):
        sampling = SamplingArrays.broadcast(b, temperature=temp)
        block, z = d.propose_with_logits(state, anchor, a, sampling, keys)
        assert block.tokens.shape == (b, GAMMA) and block.tokens.dtype == jnp.int32
        assert block.q.shape == (b, GAMMA, V) and block.q.dtype == jnp.float32
        # Teacher-force the sampled tokens as previous tokens: training forward == inference.
        prev = jnp.concatenate([anchor[:, None], block.tokens[:, :-1]], axis=1)[:, None, :]
        _, logits, conf = d.train_forward(taps, ids, a[:, None], keep, prev)
        np.testing.assert_allclose(z, logits[:, 0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(block.q, probs_from_logits(logits[:, 0], sampling), atol=1e-5)
        if VARIANTS[variant]["confidence_head"]:
            np.testing.assert_allclose(block.confidence, jax.nn.sigmoid(conf[:, 0]), atol=1e-5)
        else:
            assert block.confidence is None and conf is None
        if temp == 0.0:
            np.testing.assert_array_equal(block.tokens, jnp.argmax(z, -1))


def test_incremental_commit_equals_one_shot(target):
    drafter = _drafter(target, "rnn")
    d = _Jit(drafter)
    b = 2
    ids, taps = _data(target, b, 12)
    a = jnp.array([9, 6], jnp.int32)
    one = d.commit(drafter.init_state(b, 16), _update(ids, taps, jnp.zeros(b), a, 9))
    c1 = jnp.array([4, 1], jnp.int32)
    two = d.commit(drafter.init_state(b, 16), _update(ids, taps, jnp.zeros(b), c1, 9))
    two = d.commit(two, _update(ids, taps, c1, a - c1, 9))
    np.testing.assert_array_equal(one.lengths, a)
    np.testing.assert_array_equal(one.lengths, two.lengths)
    for kv1, kv2 in zip(one.kv, two.kv):
        for r in range(b):
            n = int(a[r])
            np.testing.assert_allclose(kv1[:, r, :, :n], kv2[:, r, :, :n], atol=1e-6)  # keys and values
    sa = SamplingArrays.broadcast(b, 0.0)
    keys = jax.random.split(jax.random.key(0), b)
    anchor = ids[jnp.arange(b), a]
    p1, z1 = d.propose_with_logits(one, anchor, a, sa, keys)
    p2, z2 = d.propose_with_logits(two, anchor, a, sa, keys)
    np.testing.assert_allclose(z1, z2, atol=1e-5)
    np.testing.assert_allclose(p1.confidence, p2.confidence, atol=1e-6)
    # Committing one more position changes the proposal (the new context is seen).
    three = d.commit(one, _update(ids, taps, a, jnp.ones(b), 9))
    _, z3 = d.propose_with_logits(three, anchor, a + 1, sa, keys)
    assert not _same(z3, z1)


def test_jitted_engine_style_round_and_sampling(target):
    drafter = _drafter(target, "vanilla")
    b = 2
    ids, taps = _data(target, b, 12)
    graphdef, params = nnx.split(drafter)

    @jax.jit
    def round_(params, state, upd, anchor, pos, sa, keys):
        m = nnx.merge(graphdef, params)
        state = m.commit(state, upd)
        return state, m.propose(state, anchor, pos, sa, keys)

    a = jnp.array([5, 8], jnp.int32)
    upd = _update(ids, taps, jnp.zeros(b), a, 8)
    sa = SamplingArrays.broadcast(b, temperature=1.0, top_k=5)
    anchor = ids[jnp.arange(b), a]

    def draw(seed):
        return round_(params, drafter.init_state(b, 12), upd, anchor, a, sa,
                      jax.random.split(jax.random.key(seed), b))

    state, blk = draw(3)
    np.testing.assert_array_equal(state.lengths, a)
    q = np.asarray(blk.q)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert np.all((q > 0).sum(-1) <= 5)
    tok = np.asarray(blk.tokens)
    assert np.all(np.take_along_axis(q, tok[..., None], -1)[..., 0] > 0)
    conf = np.asarray(blk.confidence)
    assert conf.shape == (b, GAMMA) and np.all((conf > 0) & (conf < 1))
    np.testing.assert_array_equal(draw(3)[1].tokens, blk.tokens)  # deterministic given the keys
    draws = {tuple(np.asarray(draw(s)[1].tokens).ravel()) for s in range(4)}
    assert len(draws) > 1  # vocab 64, top-5, 6 draws: different keys give different tokens


def test_confidence_temperatures(target):
    drafter = _drafter(target, "vanilla")
    b = 2
    ids, taps = _data(target, b, 12)
    a = jnp.array([5, 3], jnp.int32)
    d = _Jit(drafter)
    state = d.commit(drafter.init_state(b, 12), _update(ids, taps, jnp.zeros(b), a, 5))
    anchor = ids[jnp.arange(b), a]
    args = (state, anchor, a, SamplingArrays.broadcast(b, 0.0), jax.random.split(jax.random.key(0), b))
    blk = d.propose(*args)
    temps = jnp.array([1.0, 2.0, 4.0])
    drafter.set_confidence_temperatures(temps)
    blk_t = d.refresh(drafter).propose(*args)
    logit = jnp.log(blk.confidence) - jnp.log1p(-blk.confidence)
    np.testing.assert_allclose(blk_t.confidence, jax.nn.sigmoid(logit / temps), atol=1e-5)
    assert not _same(blk_t.confidence, blk.confidence)
    np.testing.assert_array_equal(blk_t.tokens, blk.tokens)
    with pytest.raises(ValueError, match="confidence_temperatures"):
        drafter.set_confidence_temperatures([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="confidence_temperatures"):
        drafter.set_confidence_temperatures([1.0, 1.0])
    with pytest.raises(ValueError, match="confidence head"):
        _drafter(target, "dflash").set_confidence_temperatures([1.0, 1.0, 1.0])


def test_commit_requires_taps(target):
    d = _drafter(target, "dflash")
    upd = ContextUpdate(tokens=jnp.zeros((1, 2), jnp.int32), positions=jnp.zeros((1, 2), jnp.int32),
                        taps=None, hidden=None, n_valid=jnp.array([2]))
    with pytest.raises(ValueError, match="taps"):
        d.commit(d.init_state(1, 4), upd)


# ---------------------------------------------------------------- frozen parts

def test_gradients_skip_frozen_embedding_and_lm_head(target):
    d = _drafter(target, "rnn")
    ids, taps = _data(target, 2, 12)
    anchors, keep = jnp.array([[2, 6], [1, 7]]), jnp.ones((2, 2), bool)
    labels = jnp.take_along_axis(ids, (anchors[..., None] + 1 + jnp.arange(GAMMA)).reshape(2, -1),
                                 axis=1).reshape(2, 2, GAMMA)

    def loss_fn(m):
        _, z, c = m.train_forward(taps, ids, anchors, keep)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(z), labels[..., None], -1).mean()
        return ce + jnp.mean(jax.nn.log_sigmoid(c))

    # One gradient w.r.t. every variable: the frozen copies get exactly zero.
    graphdef, state = nnx.split(d)
    grads = jax.jit(jax.grad(lambda st: loss_fn(nnx.merge(graphdef, st))))(state)
    flat = {"/".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
    assert float(jnp.abs(flat["embed_tokens/embedding"]).sum()) == 0.0
    assert float(jnp.abs(flat["lm_head/kernel"]).sum()) == 0.0
    for p in ["fc/kernel", "hidden_norm/weight", "layers/0/self_attn/q_proj/kernel",
              "layers/0/self_attn/k_norm/weight", "layers/1/mlp/up_proj/kernel", "norm/weight",
              "markov_head/markov_w1/embedding", "markov_head/markov_w2/kernel",
              "markov_head/joint_proj/kernel", "confidence_head/proj/kernel",
              "confidence_head/proj/bias"]:
        assert float(jnp.abs(flat[p]).sum()) > 0, p
    # The trainer's filter (nnx.Param, also nnx.grad's default) leaves the frozen copies out.
    param_grads = nnx.state(grads, nnx.Param)
    param_paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(param_grads)}
    assert "fc/kernel" in param_paths
    assert not any(p.startswith(("embed_tokens", "lm_head")) for p in param_paths)
    assert not any(p.startswith(("embed_tokens", "lm_head")) for p, _ in
                   (("/".join(map(str, q)), v) for q, v in nnx.to_flat_state(nnx.state(d, nnx.Param))))
    # The trainer's optimizer (wrt=nnx.Param) holds no state for them and leaves them untouched.
    emb0, head0, fc0 = (np.asarray(d.embed_tokens.embedding[...]), np.asarray(d.lm_head.kernel[...]),
                        np.asarray(d.fc.kernel[...]))
    opt = nnx.Optimizer(d, optax.sgd(0.1), wrt=nnx.Param)
    opt.update(d, param_grads)
    np.testing.assert_array_equal(d.embed_tokens.embedding[...], emb0)
    np.testing.assert_array_equal(d.lm_head.kernel[...], head0)
    assert not np.allclose(d.fc.kernel[...], fc0)


def test_a_bfloat16_drafter_carries_its_q_rounded_and_draws_from_it(target):
    """A drafter computing in bfloat16 returns q in bfloat16 (`sampling.draft_probs`: half the bytes
    from draft to verify) and its tokens are drawn from that rounded q: under top-k = 1 the one kept
    token is drawn with certainty from bfloat16 rows; a float32 drafter's q stays float32."""
    d16 = make_block_drafter(target, TCFG, _cfg("vanilla"), nnx.Rngs(3), dtype="bfloat16", param_dtype="bfloat16")
    _scramble(d16, 13)
    b = 2
    ids, taps = _data(target, b, 12)
    a = jnp.array([5, 8], jnp.int32)
    anchor = ids[jnp.arange(b), a]
    keys = jax.random.split(jax.random.key(1), b)
    for d, dtype in ((d16, jnp.bfloat16), (_drafter(target, "vanilla"), jnp.float32)):
        state = d.commit(d.init_state(b, 12), _update(ids, taps, jnp.zeros(b), a, 8))
        blk = d.propose(state, anchor, a, SamplingArrays.broadcast(b, temperature=1.0), keys)
        assert blk.q.dtype == dtype
        q = np.asarray(blk.q, np.float32)
        assert np.all(np.take_along_axis(q, np.asarray(blk.tokens)[..., None], -1) > 0)
        if dtype == jnp.bfloat16:
            assert np.abs(q.sum(-1) - 1.0).max() > 1e-4  # rounded: rows no longer sum to one exactly
        top1 = d.propose(state, anchor, a, SamplingArrays.broadcast(b, temperature=1.0, top_k=1), keys)
        q1 = np.asarray(top1.q, np.float32)
        np.testing.assert_array_equal(np.asarray(top1.tokens), q1.argmax(-1))
