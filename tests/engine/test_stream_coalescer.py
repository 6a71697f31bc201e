"""StreamCoalescer: under load a stream's tokens go out a few per response, never its first token, its final
output or the interactive tier; every released token reaches the sink once, in order. The loop test runs the
real engine: the same greedy ids arrive with and without coalescing, in fewer responses."""
from __future__ import annotations

import threading

import pytest

from python_backends.engine.engine import StepOutput
from python_backends.engine.loop import CallbackSink, EngineLoop
from python_backends.engine.sequence import Priority, SamplingParams, Sequence
from python_backends.engine.stream_coalescer import StreamCoalescer


def _seqs(n: int, priority: int = Priority.STANDARD) -> list[Sequence]:
    return [Sequence([1, 2, 3], SamplingParams(max_tokens=100), priority=priority) for _ in range(n)]


def _step(seqs: list[Sequence], token: int, finished: set[int] = frozenset()) -> list[StepOutput]:
    """One step's outputs, one token each, released as the engine releases them (num_emitted counts them)."""
    for s in seqs:
        s.num_emitted += 1
    return [StepOutput(s, [token], "length" if s.seq_id in finished else "") for s in seqs]


def test_holds_under_load_up_to_the_interval_but_never_the_first_or_final_tokens():
    co = StreamCoalescer(interval=3, min_rows=4)
    seqs = _seqs(4)
    first = co.release(_step(seqs, 10))
    assert [o.token_ids for o in first] == [[10]] * 4, "first tokens go out at once (TTFT)"
    assert co.release(_step(seqs, 11)) == []
    assert co.release(_step(seqs, 12)) == []
    third = co.release(_step(seqs, 13))
    assert [o.token_ids for o in third] == [[11, 12, 13]] * 4
    assert co.release(_step(seqs, 14)) == []
    last = co.release(_step(seqs, 15, finished={s.seq_id for s in seqs}))
    assert [(o.token_ids, o.finish_reason) for o in last] == [([14, 15], "length")] * 4


def test_light_load_and_the_interactive_tier_stream_every_token():
    co = StreamCoalescer(interval=4, min_rows=4)
    light = _seqs(3)
    for t in range(5):
        assert [o.token_ids for o in co.release(_step(light, t))] == [[t]] * 3
    co = StreamCoalescer(interval=4, min_rows=4)
    mixed = _seqs(1, Priority.INTERACTIVE) + _seqs(3)
    co.release(_step(mixed, 0))
    out = co.release(_step(mixed, 1))
    assert [(o.seq.priority, o.token_ids) for o in out] == [(Priority.INTERACTIVE, [1])]


def test_held_tokens_are_flushed_when_the_load_drops_or_the_sequence_sits_a_step_out():
    co = StreamCoalescer(interval=8, min_rows=4)
    seqs = _seqs(4)
    co.release(_step(seqs, 0))
    assert co.release(_step(seqs, 1)) == []
    # the load drops below min_rows: the two still running send what they held plus the new token, and the
    # two that sat this step out (preempted, say) send what they held rather than wait
    out = co.release(_step(seqs[:2], 2))
    assert sorted((o.seq.seq_id, tuple(o.token_ids)) for o in out) == sorted(
        [(seqs[0].seq_id, (1, 2)), (seqs[1].seq_id, (1, 2)), (seqs[2].seq_id, (1,)), (seqs[3].seq_id, (1,))])


def test_the_chunk_grows_with_the_rows_up_to_the_maximum():
    co = StreamCoalescer(interval=4, min_rows=8, max_interval=16)
    assert [co.chunk(r) for r in (1, 7, 8, 15, 16, 24, 32, 200)] == [1, 1, 4, 4, 8, 12, 16, 16]
    assert StreamCoalescer(interval=4, min_rows=8).chunk(200) == 4, "no maximum: a fixed interval"
    seqs = _seqs(32)
    co.release(_step(seqs, 0))
    for t in range(1, 16):
        assert co.release(_step(seqs, t)) == [], f"32 rows hold up to 16 tokens (step {t})"
    assert [o.token_ids for o in co.release(_step(seqs, 16))] == [list(range(1, 17))] * 32


def test_interval_one_passes_outputs_through_and_a_bad_interval_is_refused():
    co = StreamCoalescer(interval=1, min_rows=1)
    outs = _step(_seqs(9), 5)
    assert co.release(outs) is outs
    co = StreamCoalescer(interval=1, min_rows=8, max_interval=16)     # 1 means one token per response, at any load
    outs = _step(_seqs(40), 5)
    assert co.chunk(40) == 1 and co.release(outs) is outs
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        StreamCoalescer(interval=0)


def _run(build, prompts: list[list[int]], max_tokens: int) -> dict[int, list[list[int]]]:
    """Responses per stream (each a list of ids) from a real EngineLoop."""
    loop = EngineLoop(build).start()
    got: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    left = threading.Semaphore(0)
    try:
        for i, prompt in enumerate(prompts):
            def send(out, i=i):
                got[i].append(list(out.token_ids))
                if out.finished:
                    left.release()
            loop.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), CallbackSink(send))
        for _ in prompts:
            assert left.acquire(timeout=180), "a stream did not finish"
    finally:
        loop.stop()
    return got


def test_engine_loop_sends_the_same_ids_in_fewer_responses(make_engine):
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(8)]
    plain = _run(lambda: make_engine(stream_interval=1), prompts, 12)
    coalesced = _run(lambda: make_engine(stream_interval=4, stream_interval_min_rows=8), prompts, 12)
    for i in range(len(prompts)):
        assert [t for r in coalesced[i] for t in r] == [t for r in plain[i] for t in r], f"stream {i}"
        assert len(coalesced[i][0]) == 1, "the first token is not held"
        assert all(len(r) <= 4 for r in coalesced[i])
    assert sum(map(len, coalesced.values())) < sum(map(len, plain.values())) / 2
