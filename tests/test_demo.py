"""`make demo`'s report (serve.demo): how many target passes verified drafts, and the sentence that
says so when none did (a scheduler that judged plain steps cheaper), so "identical greedy outputs"
is never read as proof of lossless speculation when nothing was speculated."""
from __future__ import annotations

from types import SimpleNamespace

from serve.demo import DemoRun, verification_note


def _output(drafts: int, rounds: int, accepted_per_pos: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=[1] * (rounds + 1), metrics={
        "num_drafts": drafts, "num_rounds": rounds, "num_accepted_tokens": sum(accepted_per_pos),
        "num_accepted_tokens_per_pos": accepted_per_pos})


def test_rounds_and_acceptance_sum_over_requests():
    run = DemoRun("dspark", [_output(3, 10, [2, 1]), _output(1, 5, [1, 0, 0])], seconds=1.0)
    assert run.rounds() == (4, 15)
    tau, per_pos = run.acceptance()
    assert tau == 1.0 + 4 / 4
    assert per_pos == [3 / 4, 1 / 4, 0.0]


def test_note_counts_verified_rounds():
    note = verification_note("dspark", "confidence_async", 4, 15)
    assert note == "4 of 15 target passes verified drafts."


def test_note_explains_a_run_that_verified_nothing():
    note = verification_note("dspark", "confidence_async", 0, 15)
    assert note.startswith("0 of 15 target passes verified drafts")
    assert "decoded plainly" in note and "confidence_async" in note
    # negative control: a run that verified drafts is not described as plain decoding
    assert "decoded plainly" not in verification_note("dspark", "confidence_async", 1, 15)
    assert "no draft was proposed" in verification_note("ngram", "fixed", 0, 15)


def test_timed_runs_alternate_the_engines_and_keep_each_ones_faster_pass():
    """Passes run plain, speculative, plain, speculative; each engine keeps its faster pass (here the
    second for one engine, the first for the other: neither always the first nor always the last)."""
    import time

    from serve.demo import timed_runs
    calls = []

    class Fake:
        def __init__(self, name, delays):
            self.name, self.delays = name, list(delays)

        def chat(self, message, sp):
            calls.append(self.name)
            time.sleep(self.delays.pop(0))
            return [SimpleNamespace(token_ids=[1, 2, 3], metrics={})]
    llms = {"plain": Fake("plain", [0.05, 0.0]), "spec": Fake("spec", [0.0, 0.05])}
    runs = timed_runs(llms, ["m"], None, repeats=2)
    assert calls == ["plain", "spec", "plain", "spec"]
    assert runs["plain"].seconds < 0.04 and runs["spec"].seconds < 0.04
