"""`c2w bench --serve` (exporter/bench/serving.py): the benchmark on the stream server's artifacts
(tests/conftest.py `serve_dir`, built once for this file), paced clients, listener stalls and the
samples each chunk returns."""
import asyncio
import time
import types

import pytest
import torch

from c2w.runtime.model.config import TINY
from tests.conftest import PCM_TOL


@pytest.mark.slow
def test_serving_benchmark_counts_every_chunk_and_paces_clients(serve_dir):
    """`c2w bench --serve` on the tiny artifacts, clients paced at 200 tokens/s: every chunk
    arrives once with its length and sampled streams equal their solo runs."""
    from c2w.exporter.bench.serving import bench_serving, to_markdown
    res = bench_serving(serve_dir, concurrency=[2], steady_chunks=1, stagger_ms=5, token_rate=200.0,
                        check_streams=1, reps=1)
    assert [r["N"] for r in res["levels"]] == [2] and res["token_rate"] == 200.0
    for r in res["levels"]:
        assert r["chunks"] == r["N"] * 3 and (r["lost"], r["duplicated"], r["wrong_length"], r["failed_chunks"]) == (0,) * 4
        assert r["engine_hit_rate"] > 0.5 and r["solo_check"]["worst_pcm_rel_l2"] <= PCM_TOL
    assert "paced at 200 tokens/s" in to_markdown(res)


@pytest.mark.slow
def test_serving_benchmark_with_asyncio_clients_counts_every_chunk(serve_dir):
    """`c2w bench --serve --clients asyncio`: every client a coroutine of one event loop (the
    server's submit_async path): every chunk arrives once with its length, sampled streams equal
    their solo runs, and the report says how the clients ran."""
    from c2w.exporter.bench.serving import bench_serving, to_markdown
    res = bench_serving(serve_dir, concurrency=[2], steady_chunks=1, stagger_ms=5, check_streams=1, reps=1,
                        clients="asyncio")
    r = res["levels"][0]
    assert res["clients"] == "asyncio" and r["chunks"] == 6
    assert (r["lost"], r["duplicated"], r["wrong_length"], r["failed_chunks"]) == (0,) * 4
    assert r["solo_check"]["worst_pcm_rel_l2"] <= PCM_TOL and "one asyncio event loop" in to_markdown(res)


def test_serving_benchmark_of_one_stream_keeps_its_b1_reference(serve_dir):
    """With N = 1 alone the batch reference is the B=1 one: the report names it, and neither is
    lost (the B=1 reference used to be overwritten with None, and the report then raised)."""
    from c2w.exporter.bench.serving import bench_serving, to_markdown
    res = bench_serving(serve_dir, concurrency=[1], steady_chunks=1, check_streams=0, reps=1)
    assert res["batch_reference"] == 1 and res["direct_B1"]["steady_ms"]["p50"] > 0
    assert "Direct `Runtime.step`, B=1" in to_markdown(res) and res["levels"][0]["chunks"] == 3


@pytest.mark.parametrize("in_loop", [False, True], ids=["thread", "asyncio"])
def test_paced_client_submits_no_chunk_before_its_tokens_exist(in_loop):
    """A paced client (token_rate r) submits chunk j >= 1 no earlier than r tokens per second
    after its first chunk allows, counting the tokens each chunk adds (its length less the 3
    lookahead tokens the chunk before it already carried); the first chunk goes as soon as the
    prompt is ready. The same for a client of its own thread and one of a shared event loop."""
    from concurrent.futures import Future
    from c2w.exporter.bench.serving import _client

    def done(value):
        f = Future()
        f.set_result(value)
        return f

    class Server:
        def __init__(self):
            self.t = []

        def open_stream(self, *prompt):
            return types.SimpleNamespace(ready=done(None))

        def submit(self, handle, tokens, last=False):
            self.t.append(time.perf_counter())
            return done(torch.zeros(10))

    sizes, rate = [28, 28, 28, 13], 400.0
    ins = (None, None, None, [(torch.zeros(n, dtype=torch.long), i == 3) for i, n in enumerate(sizes)])
    srv, log = Server(), {"chunks": [], "pcm": []}
    asyncio.run(_client(srv, ins, 0.0, time.perf_counter(), log, token_rate=rate, in_loop=in_loop))
    assert [c["i"] for c in log["chunks"]] == [0, 1, 2, 3] and len(log["pcm"]) == 4
    new = [n - 3 for n in sizes]
    for j in range(1, len(sizes)):
        assert srv.t[j] - srv.t[0] >= sum(new[1:j + 1]) / rate - 1e-3, j
    assert srv.t[1] - srv.t[0] < new[1] / rate + 0.05           # and not much later (loose: a loaded CPU)


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_a_client_keeps_ahead_chunks_queued_beyond_the_one_it_waits_for(ahead):
    """With `ahead` K, a client never has more than K + 1 chunks submitted and not yet resolved,
    and has exactly that many while the server holds its results back; a chunk counts as done
    when its future resolves, not when the client gets round to it."""
    import threading
    from concurrent.futures import Future
    from c2w.exporter.bench.serving import _client

    class Server:
        def __init__(self):
            self.open, self.most, self.resolved = [], 0, {}

        def open_stream(self, *prompt):
            f = Future()
            f.set_result(None)
            return types.SimpleNamespace(ready=f)

        def submit(self, handle, tokens, last=False):
            f = Future()
            self.open.append(f)
            self.most = max(self.most, sum(not g.done() for g in self.open))
            threading.Timer(0.03, self.resolve, (f, len(self.open) - 1)).start()
            return f

        def resolve(self, f, i):
            self.resolved[i] = time.perf_counter()
            f.set_result(torch.zeros(10))

    n = 6
    ins = (None, None, None, [(torch.zeros(28, dtype=torch.long), i == n - 1) for i in range(n)])
    srv, log = Server(), {"chunks": [], "pcm": []}
    asyncio.run(_client(srv, ins, 0.0, time.perf_counter(), log, ahead=ahead))
    assert [c["i"] for c in log["chunks"]] == list(range(n)) and len(log["pcm"]) == n
    assert srv.most == ahead + 1
    for c in log["chunks"]:                  # timed when resolved (the timer thread), within a loaded CPU's slack
        assert srv.resolved[c["i"]] <= c["t_done"] < srv.resolved[c["i"]] + 0.02


def test_listener_stalls_count_chunks_that_arrive_after_the_audio_before_them_played_out():
    """One second of audio per chunk: a chunk arriving within the audio already delivered is on
    time; one arriving 0.3 s after the audio ran out is a 300 ms stall, and playback resumes from
    its arrival."""
    from c2w.exporter.bench.serving import SAMPLE_RATE, listener_stalls
    chunk = lambda i, t: {"i": i, "t_done": t, "samples": SAMPLE_RATE}  # noqa: E731
    assert listener_stalls([chunk(0, 10.0), chunk(1, 10.5), chunk(2, 11.9)]) == (0, 0.0)
    late, ms = listener_stalls([chunk(0, 10.0), chunk(1, 11.3), chunk(2, 12.2), chunk(3, 13.5)])
    assert late == 2 and ms == pytest.approx(300.0 + 200.0)


@pytest.mark.parametrize("n, last, first, want", [
    (28, False, True, 2 * 25 * 480 - 3840),           # first chunk: 50 frames, 3840 samples held back
    (28, False, False, 2 * 25 * 480),                 # steady: the previous chunk's 3840 come out now
    (13, True, False, 2 * 13 * 480 + 3840),           # final: no lookahead, nothing held back
    (13, True, True, 2 * 13 * 480),                   # a one-chunk stream
])
def test_expected_samples_of_a_chunk(n, last, first, want):
    """What the benchmark counts as a chunk of the right length: 2 frames of 480 samples per new
    token (less the 3 lookahead tokens of a non-final chunk), less the 3840 samples a non-final
    chunk holds back for the cross-fade, plus the 3840 the chunk before it held back."""
    from c2w.exporter.bench.serving import expected_samples
    assert expected_samples(TINY, n, last, first) == want


def test_the_steady_window_opens_once_every_stream_has_its_saturated_chunk_back():
    """Two streams keeping one chunk queued ahead: chunk 2 (the saturated one) is submitted while
    chunk 1, a slow call, still runs. The window opens when the later stream's chunk 2 is back,
    so chunk 1 and chunk 2 count in neither stream, and it closes at the first final chunk's
    submission (1.4 s): both streams' chunk 3 and the first stream's chunk 4 fall in it."""
    from c2w.exporter.bench.serving import steady_window

    def log(shift):
        # (i, t_submit, t_done): chunk 1 takes 1 s; chunks 2-5 are back every 0.1 s after it
        times = [(0, 0.0, 0.1), (1, 0.0, 1.1), (2, 0.1, 1.2), (3, 1.1, 1.3), (4, 1.2, 1.4), (5, 1.3, 1.5)]
        chunks = [{"i": i, "t_submit": s + shift, "t_done": d + shift, "last": False} for i, s, d in times]
        return {"chunks": chunks + [{"i": 6, "t_submit": 1.4 + shift, "t_done": 1.6 + shift, "last": True}]}
    a, b, chunks = steady_window([log(0.0), log(0.05)], saturated=2)
    assert (a, b) == pytest.approx((1.25, 1.4))
    assert sorted((c["i"], round(c["t_done"], 2)) for c in chunks) == [(3, 1.3), (3, 1.35), (4, 1.4)]
