"""bench.count_reference: n-gram tables with backoff, the rank-r bigram table, scoring and the report."""
from __future__ import annotations

import numpy as np
import pytest

from bench import count_reference as cr


def test_ngram_table_names_the_most_frequent_continuation_and_backs_off():
    rows = [np.array([1, 2, 3, 1, 2, 3, 1, 2, 4]), np.array([5, 2, 4, 5, 2, 4])]
    t = cr.NgramTable(rows, order=3, vocab=8)
    # after (1, 2): 3 twice, 4 once -> 3; after (5, 2): 4; after 2 alone: 3 twice vs 4 three times -> 4
    seq = np.array([1, 2, 0, 5, 2, 0, 7, 2, 0])
    pred = t.predict(seq, 2)
    assert pred[0] == 3          # seq[2] from (1, 2)
    assert pred[3] == 4          # seq[5] from (5, 2)
    assert pred[6] == 4          # seq[8] from (7, 2): unseen pair, backs off to the bigram of 2
    # an unseen token backs off to the unigram: 2, the most frequent token
    assert t.predict(np.array([6, 0]), 1)[0] == 2
    # negative control: a bigram-only table cannot tell (1, 2) from (5, 2)
    b = cr.NgramTable(rows, order=2, vocab=8).predict(seq, 2)
    assert b[0] == 4 and b[3] == 4


def test_ngram_table_ties_go_to_the_lowest_id_and_bad_input_is_refused():
    t = cr.NgramTable([np.array([0, 5, 0, 3])], order=2, vocab=8)
    assert t.predict(np.array([0, 0]), 1)[0] == 3  # after 0: 5 once, 3 once -> 3
    with pytest.raises(ValueError, match="order"):
        cr.NgramTable([np.array([1, 2])], order=5, vocab=8)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        cr.NgramTable([np.array([1, 9])], order=2, vocab=8)
    with pytest.raises(ValueError, match="no tokens"):
        cr.NgramTable([np.array([], np.int64)], order=2, vocab=8)
    with pytest.raises(ValueError, match="start"):
        t.predict(np.array([1, 2]), 0)


def test_score_counts_every_generated_token_after_the_first():
    conts = [([7, 7], [1, 2, 3]), ([7], [4])]  # the second has no token after its first
    hits, total = cr.score(lambda seq, start: seq[start:], conts)
    assert (hits, total) == (2, 2)
    hits, total = cr.score(lambda seq, start: np.zeros(seq.size - start, np.int64), conts)
    assert (hits, total) == (0, 2)


def test_lowrank_bigram_table_is_exact_at_full_rank_and_loses_a_permutation_at_rank_one():
    rng = np.random.default_rng(0)
    n = 24
    perm = rng.permutation(n)
    row = [int(rng.integers(n))]
    for _ in range(3000):
        row.append(int(perm[row[-1]]) if rng.random() < 0.9 else int(rng.integers(n)))
    rows = [np.array(row)]
    draft_ids = np.arange(n) * 2 + 1  # draft ids are target ids 1, 3, 5, ...
    seq = draft_ids[np.array(row[:400])]
    exact = cr.lowrank_bigram_scores([draft_ids[r] for r in rows], draft_ids, n)
    acc_full = np.mean(cr.lowrank_predict(exact, draft_ids, seq, 1) == seq[1:])
    low = cr.lowrank_bigram_scores([draft_ids[r] for r in rows], draft_ids, 1)
    acc_low = np.mean(cr.lowrank_predict(low, draft_ids, seq, 1) == seq[1:])
    assert acc_full > 0.85
    assert acc_low < 0.5  # a rank-1 table cannot hold a permutation
    # a previous token outside the draft vocabulary reads row N
    out = cr.lowrank_predict(exact, draft_ids, np.array([0, draft_ids[0]]), 1)
    assert out.shape == (1,)


def test_report_names_the_best_count_model_and_the_shipped_dspark():
    per = {n: 0.1 for n in cr.EVAL_SETS}
    res = {"corpus": {"conversations": {"used": 10, "held out": 1, "evaluation prompt": 0, "no user turn": 2},
                      "replies": 12, "tokens": 3456},
           "positions": {n: 63 for n in cr.EVAL_SETS}, "cap": 8, "max_tokens": 64,
           "count_models": {"unigram": per | {"pooled": 0.05}, "bigram": per | {"pooled": 0.18},
                            "trigram (backoff)": per | {"pooled": 0.235},
                            "bigram at rank 32 (draft vocabulary)": per | {"pooled": 0.07}},
           "ngram_drafter": per | {"pooled": 0.12},
           "drafters": {"dspark": per | {"pooled": 0.232}, "mtp1": per | {"pooled": 0.25}}}
    md = cr.report(res, "python -m bench.count_reference")
    assert md.startswith("# ") and "Command: `python -m bench.count_reference`" in md
    assert "23.5%" in md and "23.2%" in md and "rank 32 7.0%" in md and "18.0%" in md
    assert "315 positions" in md
