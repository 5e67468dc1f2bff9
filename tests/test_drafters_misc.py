"""Eagle3, MTP and standalone drafters: protocol, train/infer equivalence, caches, frozen parts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.config import ConfigError, TargetConfig
from specjax.models import cache as kvc
from specjax.sampling import SamplingArrays
from specjax.drafters.base import ContextUpdate, Drafter
from specjax.drafters.common import Frozen
from specjax.drafters.eagle3 import (Eagle3Config, Eagle3Drafter, attend_causal_plus_diagonal,
                                     make_eagle3_drafter)
from specjax.drafters.mtp import MTPConfig, MTPDrafter, make_mtp_drafter
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.standalone import StandaloneDrafter
from specjax.models.layers import gqa_attention
from specjax.models.decoder import CausalLM

V, H = 64, 32
TAPS = (0, 1)
GAMMA = 3
TCFG = TargetConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
KINDS = ("eagle3", "mtp", "standalone")


def _scramble(module: nnx.Module, seed: int, std: float = 0.3) -> None:
    """Redraw every trainable Param (norm weights too) so that bugs show up in the outputs."""
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [1.0 + std * jax.random.normal(k, x.shape) if x.ndim == 1 else
           std * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
    nnx.update(module, jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def target() -> CausalLM:
    t = CausalLM(TCFG, rngs=nnx.Rngs(0))
    _scramble(t, 1, std=0.2)
    return t


def _make(kind: str, target: CausalLM):
    if kind == "eagle3":
        d = make_eagle3_drafter(target, Eagle3Config.from_target(TCFG, target_layer_ids=TAPS, gamma=GAMMA),
                                rngs=nnx.Rngs(5))
    elif kind == "mtp":
        d = make_mtp_drafter(target, rngs=nnx.Rngs(6))
    else:
        small = TargetConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8, rope_theta=10000.0)
        d = StandaloneDrafter.from_config(small, GAMMA, rngs=nnx.Rngs(7))
    _scramble(d, 11)
    return d


@pytest.fixture(scope="module")
def drafters(target):
    return {k: _make(k, target) for k in KINDS}


def _ids(seed: int, b: int, s: int) -> jnp.ndarray:
    return jax.random.randint(jax.random.key(seed), (b, s), 0, V, dtype=jnp.int32)


_FWD: dict[int, tuple] = {}


def _target_out(target, ids):
    """The target's full forward (taps at TAPS), jitted once per target."""
    fn = _FWD.get(id(target))
    if fn is None:
        graph, params = nnx.split(target)

        @jax.jit
        def run(params, ids):
            b, s = ids.shape
            pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            return nnx.merge(graph, params).forward(ids, pos, tap_layers=TAPS)

        fn = lambda i: run(params, i)
        _FWD[id(target)] = (target, fn)  # keeps the target alive, so its id stays unique
    else:
        fn = fn[1]
    return fn(ids)


def _update(target, ids, start: int, width: int, n_valid, drafter) -> ContextUpdate:
    """ContextUpdate for ids[:, start:start+width] (positions start..), with what `drafter` needs
    (target features from one causal forward over all of `ids`)."""
    out = _target_out(target, ids)
    b, s = ids.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    sl = slice(start, start + width)
    taps = jnp.concatenate(out.taps, axis=-1)[:, sl] if drafter.tap_layers else None
    assert not drafter.tap_layers or tuple(drafter.tap_layers) == TAPS
    hidden = out.hidden[:, sl] if drafter.needs_hidden else None
    return ContextUpdate(tokens=ids[:, sl], positions=pos[:, sl], taps=taps, hidden=hidden,
                         n_valid=jnp.asarray(n_valid, jnp.int32))


_JIT: dict[int, tuple] = {}


def _jitted(d):
    """(commit, propose_with_logits), jitted once per drafter object."""
    if id(d) in _JIT:
        return _JIT[id(d)][1]
    graph, params = nnx.split(d)

    @jax.jit
    def commit(params, state, upd):
        return nnx.merge(graph, params).commit(state, upd)

    @jax.jit
    def propose(params, state, anchor, pos, sa, keys):
        return nnx.merge(graph, params).propose_with_logits(state, anchor, pos, sa, keys)

    fns = (lambda state, upd: commit(params, state, upd), lambda *a: propose(params, *a))
    _JIT[id(d)] = (d, fns)  # keeps d alive, so its id stays unique
    return fns


def _keys(seed: int, b: int):
    return jax.random.split(jax.random.key(seed), b)


# ------------------------------------------------------------------------------------------------
# protocol


@pytest.mark.parametrize("kind", KINDS)
def test_propose_shapes_q_greedy_determinism_and_row_isolation(kind, target, drafters):
    d = drafters[kind]
    assert isinstance(d, Drafter)
    commit, propose = _jitted(d)
    slots, b, t = 3, 2, 8
    state0 = d.init_state(slots, 32)
    ids = _ids(0, b, 2 * t)
    n = np.array([8, 5])
    state = commit(state0, _update(target, ids, 0, t, n, d))
    # rows past B are untouched by commit
    for x0, x1 in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(x0[b:]), np.asarray(x1[b:]))
    anchor = jnp.asarray([3, 9], jnp.int32)
    pos = jnp.asarray(n, jnp.int32)
    block, z = propose(state, anchor, pos, SamplingArrays.broadcast(b, 1.0), _keys(1, b))
    g = d.gamma
    assert block.tokens.shape == (b, g) and block.tokens.dtype == jnp.int32
    assert block.q.shape == (b, g, V) and block.q.dtype == jnp.float32
    assert z.shape == (b, g, V)
    q = np.asarray(block.q)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    tok = np.asarray(block.tokens)
    assert np.all(np.take_along_axis(q, tok[..., None], -1) > 0)
    assert np.all(np.isfinite(np.asarray(z)))
    # q is exactly softmax(z) at temperature 1
    np.testing.assert_allclose(q, np.asarray(jax.nn.softmax(z, axis=-1)), atol=1e-6)
    # greedy proposals never depend on the key and are one-hot at the argmax of z
    greedy = SamplingArrays.broadcast(b, 0.0)
    g1, z1 = propose(state, anchor, pos, greedy, _keys(2, b))
    g2, _ = propose(state, anchor, pos, greedy, _keys(3, b))
    np.testing.assert_array_equal(np.asarray(g1.tokens), np.asarray(g2.tokens))
    np.testing.assert_array_equal(np.asarray(g1.q).max(-1), 1.0)
    np.testing.assert_array_equal(np.asarray(g1.q).argmax(-1), np.asarray(g1.tokens))
    np.testing.assert_array_equal(np.asarray(z1).argmax(-1), np.asarray(g1.tokens))
    # a row with nothing to commit (n_valid 0) keeps its context: its proposal is unchanged
    upd = _update(target, ids, t, t, [0, 3], d)._replace(
        positions=jnp.asarray([[8 + i for i in range(t)], [5 + i for i in range(t)]], jnp.int32))
    after = commit(state, upd)
    g3, z3 = propose(after, anchor, pos, greedy, _keys(2, b))
    np.testing.assert_array_equal(np.asarray(z3[0]), np.asarray(z1[0]))
    assert not np.allclose(np.asarray(z3[1]), np.asarray(z1[1]))  # row 1 did move on
    np.testing.assert_array_equal(np.asarray(after.lengths[0]), np.asarray(state.lengths[0]))
    assert int(after.lengths[1]) == int(state.lengths[1]) + 3


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_commit_equals_one_shot(kind, target, drafters):
    d = drafters[kind]
    commit, propose = _jitted(d)
    w, total, first_n = 12, 12, 7
    ids = _ids(4, 1, 2 * w)  # only the first `total` tokens are committed; the rest is padding
    one = commit(d.init_state(1, 16), _update(target, ids, 0, w, [total], d))
    # chunk 1: 7 real tokens, the tail of the chunk is padding (perturbed: it must not matter)
    first = _update(target, ids, 0, w, [first_n], d)
    tail = jnp.arange(w) >= first_n
    first = first._replace(
        tokens=jnp.where(tail, 7, first.tokens),
        taps=None if first.taps is None else jnp.where(tail[:, None], first.taps + 0.5, first.taps),
        hidden=None if first.hidden is None else jnp.where(tail[:, None], -first.hidden, first.hidden))
    two = commit(d.init_state(1, 16), first)
    two = commit(two, _update(target, ids, first_n, w, [total - first_n], d))
    np.testing.assert_array_equal(np.asarray(one.lengths), np.asarray(two.lengths))
    n = int(one.lengths[0])
    assert n == (total if kind == "standalone" else total - 1)  # the last feature is pending
    c1, c2 = (s if isinstance(s, kvc.KVCache) else s.cache for s in (one, two))
    for a, b_ in zip(c1.kv, c2.kv):  # [2 (keys, values), slots, nkv, max_len, hd]
        np.testing.assert_allclose(np.asarray(a[..., :n, :]), np.asarray(b_[..., :n, :]), atol=1e-5)
    anchor, pos = jnp.asarray([5], jnp.int32), jnp.asarray([total], jnp.int32)
    sa = SamplingArrays.broadcast(1, 0.0)
    b1, z1 = propose(one, anchor, pos, sa, _keys(0, 1))
    b2, z2 = propose(two, anchor, pos, sa, _keys(0, 1))
    np.testing.assert_allclose(np.asarray(z1), np.asarray(z2), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(b1.tokens), np.asarray(b2.tokens))


# ------------------------------------------------------------------------------------------------
# standalone


def test_standalone_copy_of_target_proposes_target_greedy_continuation(target):
    d = StandaloneDrafter(nnx.clone(target), gamma=4)
    d.check_target(TCFG)
    commit, propose = _jitted(d)
    ids = _ids(8, 2, 9)
    n = np.array([9, 6])
    state = commit(d.init_state(2, 24), ContextUpdate(
        tokens=ids, positions=jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9)), taps=None,
        hidden=None, n_valid=jnp.asarray(n, jnp.int32)))
    anchors, oracle = [], []
    for r in range(2):  # greedy decoding with the target (causal: right padding never matters)
        buf = np.zeros((1, 16), np.int32)
        buf[0, :n[r]] = np.asarray(ids[r, :n[r]])
        length = int(n[r])
        for _ in range(1 + d.gamma):  # the anchor, then gamma greedy continuations
            logits = _target_out(target, jnp.asarray(buf)).logits
            buf[0, length] = int(jnp.argmax(logits[0, length - 1]))
            length += 1
        anchors.append(int(buf[0, n[r]]))
        oracle.append(buf[0, n[r] + 1:length].tolist())
    block, _ = propose(state, jnp.asarray(anchors, jnp.int32), jnp.asarray(n, jnp.int32),
                       SamplingArrays.broadcast(2, 0.0), _keys(0, 2))
    np.testing.assert_array_equal(np.asarray(block.tokens), np.asarray(oracle))


def test_standalone_rejects_bad_arguments(target):
    with pytest.raises(ValueError, match="gamma"):
        StandaloneDrafter(nnx.clone(target), gamma=0)
    with pytest.raises(ValueError, match="model must be a CausalLM"):
        StandaloneDrafter(object(), gamma=2)  # type: ignore[arg-type]
    other = TargetConfig(vocab_size=V + 1, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match="vocab_size"):
        StandaloneDrafter.from_config(other, 2).check_target(TCFG)


# ------------------------------------------------------------------------------------------------
# Eagle3


def test_ttt_attention_equals_dense_mask_over_chunks():
    b, t, nh, nkv, hd, steps = 2, 5, 4, 2, 8, 3
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, t, nh, hd))
    kc = jax.random.normal(ks[1], (steps, b, t, nkv, hd))
    vc = jax.random.normal(ks[2], (steps, b, t, nkv, hd))
    got = jax.jit(lambda q, kc, vc: attend_causal_plus_diagonal(q, kc[0], vc[0], list(kc[1:]),
                                                                list(vc[1:])))(q, kc, vc)
    qi = np.arange(t)[:, None]
    kj = np.arange(steps * t)[None, :]
    chunk, kpos = kj // t, kj % t
    mask = ((chunk == 0) & (kpos <= qi)) | ((chunk > 0) & (kpos == qi))
    k_all = jnp.concatenate(list(kc), axis=1)
    v_all = jnp.concatenate(list(vc), axis=1)
    want = jax.jit(gqa_attention)(q, k_all, v_all, jnp.broadcast_to(jnp.asarray(mask), (b, t, steps * t)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_eagle3_ttt_matches_inference_proposals(target, drafters):
    """Step-0 TTT logits at row a equal the first proposal logits after committing 0..a; with the
    sequence continued by the greedy proposals, every TTT step k at row a equals proposal step k."""
    d = drafters["eagle3"]
    commit, propose = _jitted(d)
    s = 12
    ids = _ids(9, 1, s)
    graph, params = nnx.split(d)
    ttt_fn = jax.jit(lambda p, i, tp: nnx.merge(graph, p).ttt_forward(tp, i, horizon=GAMMA))
    taps = jnp.concatenate(_target_out(target, ids).taps, axis=-1)
    ttt = ttt_fn(params, ids, taps)
    assert ttt.shape == (GAMMA, 1, s, V) and ttt.dtype == jnp.float32
    greedy = SamplingArrays.broadcast(1, 0.0)
    for a in (0, 3, 7):  # commit positions 0..a (the rest of the row is padding)
        state = commit(d.init_state(1, 16), _update(target, ids, 0, s, [a + 1], d))
        anchor, pos = ids[:, a + 1], jnp.asarray([a + 1], jnp.int32)
        block, z = propose(state, anchor, pos, greedy, _keys(0, 1))
        np.testing.assert_allclose(np.asarray(z[0, 0]), np.asarray(ttt[0, 0, a]), atol=1e-5)
        # continue the sequence with the drafts: every TTT step then sees what inference saw
        ids2 = ids.at[:, a + 2:a + 2 + GAMMA].set(block.tokens)
        taps2 = jnp.concatenate(_target_out(target, ids2).taps, axis=-1)
        ttt2 = ttt_fn(params, ids2, taps2)
        np.testing.assert_allclose(np.asarray(z[0]), np.asarray(ttt2[:, 0, a]), atol=1e-5)


def test_eagle3_config_errors():
    with pytest.raises(ConfigError, match="target_layer_ids"):
        Eagle3Config.from_target(TCFG, target_layer_ids=(0, 5))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        Eagle3Config.from_target(TCFG, target_layer_ids=())
    with pytest.raises(ConfigError, match="gamma"):
        Eagle3Config.from_target(TCFG, target_layer_ids=TAPS, gamma=0)
    bad = TargetConfig(vocab_size=V + 2, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="vocab_size"):
        Eagle3Config.from_target(TCFG, target_layer_ids=TAPS).check_target(bad)


def test_eagle3_commit_needs_taps(drafters):
    d = drafters["eagle3"]
    upd = ContextUpdate(tokens=jnp.zeros((1, 4), jnp.int32), positions=jnp.zeros((1, 4), jnp.int32),
                        taps=None, hidden=None, n_valid=jnp.asarray([4], jnp.int32))
    with pytest.raises(ValueError, match="taps"):
        d.commit(d.init_state(1, 8), upd)
    with pytest.raises(ValueError, match="num_taps"):
        d.ttt_forward(jnp.zeros((1, 4, H)), jnp.zeros((1, 4), jnp.int32))


def test_eagle3_checkpoint_names(drafters):
    paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(drafters["eagle3"]))}
    for name in ("fc.kernel", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.self_attn.q_proj.kernel", "midlayer.mlp.down_proj.kernel", "norm.weight",
                 "lm_head.kernel", "embed_tokens.embedding"):
        assert name in paths, name
    assert drafters["eagle3"].midlayer.self_attn.q_proj.kernel.shape == (2 * H, 4 * 8)


# ------------------------------------------------------------------------------------------------
# MTP


def test_mtp_train_forward_matches_inference(target, drafters):
    d = drafters["mtp"]
    assert d.gamma == 1 and d.needs_hidden and d.tap_layers == ()
    commit, propose = _jitted(d)
    s = 12
    ids = _ids(12, 1, s)
    hidden = _target_out(target, ids).hidden
    graph, params = nnx.split(d)
    logits = jax.jit(lambda p, h, i: nnx.merge(graph, p).train_forward(h, i))(params, hidden, ids)
    assert logits.shape == (1, s, V) and logits.dtype == jnp.float32
    sa = SamplingArrays.broadcast(1, 0.0)
    for t in (0, 1, 5, s - 2):
        state = commit(d.init_state(1, 16), _update(target, ids, 0, s, [t + 1], d))
        _, z = propose(state, ids[:, t + 1], jnp.asarray([t + 1], jnp.int32), sa, _keys(0, 1))
        np.testing.assert_allclose(np.asarray(z[0, 0]), np.asarray(logits[0, t]), atol=1e-5)


def test_mtp_commit_needs_hidden_and_copies_frozen_weights(target, drafters):
    d = drafters["mtp"]
    upd = ContextUpdate(tokens=jnp.zeros((1, 4), jnp.int32), positions=jnp.zeros((1, 4), jnp.int32),
                        taps=None, hidden=None, n_valid=jnp.asarray([4], jnp.int32))
    with pytest.raises(ValueError, match="hidden"):
        d.commit(d.init_state(1, 8), upd)
    np.testing.assert_array_equal(np.asarray(d.embed_tokens.embedding[...]),
                                  np.asarray(target.model.embed_tokens.embedding[...]))
    np.testing.assert_array_equal(np.asarray(d.shared_head.head.kernel[...]),
                                  np.asarray(target.lm_head.kernel[...]))
    e3 = drafters["eagle3"]
    np.testing.assert_array_equal(np.asarray(e3.lm_head.kernel[...]), np.asarray(target.lm_head.kernel[...]))
    with pytest.raises(ConfigError, match="hidden_size"):
        MTPConfig.from_target(TCFG, hidden_size=H * 2)


# ------------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("kind", ("eagle3", "mtp"))
def test_gradients_skip_frozen_embedding_and_lm_head(kind, target, drafters):
    d = drafters[kind]
    ids = _ids(13, 2, 6)
    out = _target_out(target, ids)
    taps = jnp.concatenate(out.taps, axis=-1)
    labels = _ids(14, 2, 6)

    def loss_fn(m):
        z = m.ttt_forward(taps, ids, horizon=2) if kind == "eagle3" else m.train_forward(out.hidden, ids)
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.broadcast_to(labels, z.shape[:-1])[..., None], -1))

    # Param-only view (what nnx.grad and an optimizer with wrt=nnx.Param see): no frozen copies.
    param_paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(d, nnx.Param))}
    frozen_paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(d, Frozen))}
    want_frozen = ({"embed_tokens.embedding", "lm_head.kernel"} if kind == "eagle3" else
                   {"embed_tokens.embedding", "shared_head.head.kernel"})
    assert frozen_paths == want_frozen
    assert not param_paths & frozen_paths
    # Gradient w.r.t. every variable: trainable parts get some, the frozen copies exactly zero.
    grads = nnx.jit(lambda m: nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.Variable))(m))(d)
    flat = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
    trainable = (["fc.kernel", "midlayer.self_attn.q_proj.kernel", "midlayer.hidden_norm.weight",
                  "midlayer.input_layernorm.weight", "midlayer.mlp.up_proj.kernel", "norm.weight"]
                 if kind == "eagle3" else
                 ["eh_proj.kernel", "enorm.weight", "hnorm.weight", "self_attn.k_proj.kernel",
                  "mlp.down_proj.kernel", "shared_head.norm.weight"])
    for name in trainable:
        assert name in param_paths, name
        assert np.abs(flat[name]).max() > 0, name
    for name in want_frozen:
        assert np.all(flat[name] == 0), name
    assert isinstance(d, (Eagle3Drafter, MTPDrafter))


def test_every_kind_is_one_table_entry():
    """`registry.KINDS` holds each kind's (config, build, load, save, objective); the kinds with
    files dispatch by architecture and by drafter class."""
    from specjax.drafters import registry

    assert set(registry.KINDS) == {"dspark", "dflash", "eagle3", "mtp", "standalone", "ngram"}
    for name, kind in registry.KINDS.items():
        assert kind.name == name and callable(kind.load) and callable(kind.save)
        if kind.config is not None:
            assert callable(kind.build) and callable(kind.objective)
        for arch in kind.architectures:
            assert registry.kind_of_architecture({"architectures": [arch]}) == name
    assert registry.kind_of_drafter(NGramDrafter(V)).name == "ngram"
    with pytest.raises(ConfigError, match="unsupported drafter architecture 'Nope'"):
        registry.kind_of_architecture({"architectures": ["Nope"]})


def test_slot_axes_name_the_slot_axis_of_every_state_leaf():
    """KV buffers of a KVCache (also inside a drafter's state) index slots on axis 1, every other
    leaf on axis 0; prefill's per-slot gather and set use them (negative control: axis 0 for a KV
    buffer would take keys/values apart instead of slots)."""
    from specjax.drafters.common import PairCacheState
    cache = kvc.KVCache.init(num_layers=2, slots=3, max_len=4, kv_heads=1, head_dim=2)
    state = PairCacheState(cache, pending=jnp.zeros((3, 5)), has_pending=jnp.zeros((3,), bool))
    axes = kvc.slot_axes({"pair": state, "history": jnp.zeros((3, 7), jnp.int32)})
    assert axes["pair"].cache.kv == (1, 1) and axes["pair"].cache.lengths == 0
    assert axes["pair"].pending == 0 and axes["history"] == 0
    kv = jnp.arange(2 * 3 * 4 * 2, dtype=jnp.float32).reshape(2, 3, 1, 4, 2)
    row = jnp.take(kv, jnp.asarray([2]), axis=kvc.KV_SLOT_AXIS)
    np.testing.assert_array_equal(row[:, 0], kv[:, 2])  # slot 2's keys and values
    assert jnp.take(kv, jnp.asarray([1]), axis=0).shape != row.shape
