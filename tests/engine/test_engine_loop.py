"""EngineLoop + Courier: outputs reach their sinks in order from the courier thread, and a sink whose send
fails gets its sequence aborted on the loop thread (its blocks freed) while other streams carry on."""
from __future__ import annotations

import threading

from common.processes import wait_until
from python_backends.engine.loop import CallbackSink, EngineLoop
from python_backends.engine.sequence import SamplingParams


def test_courier_delivers_in_order_and_a_failed_send_aborts_only_its_sequence(make_engine):
    loop = EngineLoop(make_engine).start()
    try:
        got: dict[str, list] = {"ok": [], "broken": []}
        threads: set[str] = set()
        done = threading.Event()

        def ok(out):
            threads.add(threading.current_thread().name)
            got["ok"].append(out)
            if out.finished:
                done.set()

        def broken(out):
            got["broken"].append(out)
            raise ConnectionError("client went away")

        params = SamplingParams(max_tokens=12, ignore_eos=True)
        loop.submit([1, 2, 3, 4, 5], params, CallbackSink(ok), request_id="ok")
        loop.submit([6, 7, 8, 9], params, CallbackSink(broken), request_id="broken")
        assert done.wait(120), "the healthy stream did not finish"
        ids = [t for out in got["ok"] for t in out.token_ids]
        assert len(ids) == 12 and got["ok"][-1].finish_reason == "length"
        assert all(not o.finished for o in got["ok"][:-1]), "the final output came last"
        assert threads == {"engine-courier"}
        # the broken stream is aborted on the loop thread a step or two after its first failed send (the
        # courier runs behind the loop): it ends cancelled, long before its 12 tokens
        assert got["broken"][-1].finish_reason == "cancelled"
        assert sum(len(o.token_ids) for o in got["broken"]) <= 3
        wait_until(lambda: loop.call(lambda e: not e.has_work() and e.kv.pool.num_used == 0), 30,
                   "the broken sequence aborted and every block released")
    finally:
        loop.stop()


def test_few_row_steps_run_on_the_small_thread_count(make_engine):
    import torch

    from python_backends.engine.sequence import SamplingParams as P
    eng = make_engine(threads=2, small_step_threads=1, small_step_max_rows=4)
    eng.add_request(list(range(10, 40)), P(max_tokens=3, ignore_eos=True))
    eng.step()                                   # a 30-token prefill: the full count
    assert torch.get_num_threads() == 2
    eng.step()                                   # one decode row: the small count
    assert torch.get_num_threads() == 1


def test_a_failed_build_is_raised_by_start():
    import pytest

    def build():
        raise ValueError("weights_dir /nowhere: no such directory")

    with pytest.raises(ValueError, match="no such directory"):
        EngineLoop(build).start()
