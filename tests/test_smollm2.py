"""The embedded default target (SmolLM2-135M-Instruct GGUF) through `LLM`: greedy decoding equals
transformers' on the same file, token for token."""
from __future__ import annotations

import pytest

from specjax import default_target

pytestmark = [pytest.mark.real_target,
              pytest.mark.skipif(not default_target.is_installed(),
                                 reason=f"{default_target.PACKAGE} not installed ({default_target.INSTALL_COMMAND})")]

CHATS = ("Explain how a bicycle works to a ten-year-old.",)  # a long answer: 64 tokens before eos
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_greedy():
    """transformers' own GGUF loader and greedy generate (float32) on each chat prompt."""
    import os

    import torch
    import transformers
    path = default_target.gguf_path()
    d, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, num_beams=1, pad_token_id=tok.eos_token_id)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    del model
    return out


def test_llm_greedy_equals_transformers_on_the_gguf(hf_greedy):
    import specjax
    from specjax import checkpoints
    from specjax.decoding.engine import EngineConfig
    path = default_target.gguf_path()
    model, cfg = checkpoints.load_target(path)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30 and cfg.tie_word_embeddings
    ec = EngineConfig(max_slots=1, max_len=256, policy="plain", max_prefill=128, slots_buckets=(1,),
                      prefill_buckets=(128,), prefill_batch_buckets=(1,))
    llm = specjax.LLM(target=(model, cfg), tokenizer=path, engine_config=ec)
    sp = specjax.SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for chat, (hf_prompt, hf_tokens) in zip(CHATS, hf_greedy):
        ours = llm.chat([{"role": "user", "content": chat}], sp)[0]
        assert ours.prompt_token_ids == hf_prompt  # the same chat template from the file
        assert len(hf_tokens) == NEW_TOKENS  # long answers: 64 tokens compared, no early eos
        assert ours.token_ids == hf_tokens
        assert ours.text and len(set(ours.token_ids)) > 8  # a real answer, not a repeated token
