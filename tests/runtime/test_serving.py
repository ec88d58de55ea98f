"""The stream server on ONNX Runtime artifacts (B=1 keys plus B=3 steady keys): streams at
different positions share exact-shape batches and get the audio they would get alone; faults,
cancellation and a full server stay per stream; threads and asyncio are both served.

The model is smaller than random:tiny (SERVE_CFG in tests/conftest.py, with the module-scoped
`serve_dir` its artifacts: fewer repeated layers, 2 Euler steps instead of
10) with random:tiny's widths, so every unit keeps its inputs, outputs and cache shapes (the CFM's
caches still stack over Euler steps) and the server, which never looks inside a unit, batches,
pads, gathers and scatters exactly the same tensors; a chunk costs about a quarter of random:tiny's."""
import asyncio
import dataclasses
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path
from collections import Counter

import numpy as np
import pytest
import torch

from c2w import runtime
from c2w.runtime.errors import C2WUserError
from c2w.runtime.ring import RingCache
from c2w.runtime.serving import plan_batches
from c2w.runtime.slots import ServerFullError
from c2w.runtime.units import SPECS, EagerRunner, ShapeKey, rel_l2
from tests.conftest import PCM_TOL, SETUP_B1

pytestmark = pytest.mark.slow

MEL_TOL = 1e-5     # per-chunk mel, batched vs alone (fp32): GEMM blocking differs by batch, ~5e-7


@pytest.fixture(scope="module")
def rt(serve_dir):
    r = runtime.load(serve_dir)
    yield r
    r.release()


class MelRecorder:
    """Wraps a runner; records each chunk's CFM mel per stream, streams told apart by their
    (unique, bit-exactly gathered) speaker embedding. Padding rows repeat row 0 and are skipped;
    prompt set-ups (L=0) are not chunks and are not recorded."""

    def __init__(self, runner):
        self.runner, self.mels = runner, {}

    def run(self, key, inputs, trim=None):
        out = self.runner.run(key, inputs, trim)
        if key.component == "cfm" and key.dim("L") > 0:
            seen = set()
            for row, spk in enumerate(inputs[1]):
                tag = spk[:4].tolist().__repr__()
                if tag not in seen:
                    seen.add(tag)
                    self.mels.setdefault(tag, []).append(out[0][row].clone())
        return out

    def __getattr__(self, name):
        return getattr(self.runner, name)


def make_stream(cfg, seed: int, chunks: int, last_tokens: int = 13):
    g = torch.Generator().manual_seed(1000 + seed)
    prompt = torch.randint(0, cfg.vocab_size, (50,), generator=g)
    pmel, spk = torch.randn(100, 80, generator=g), torch.randn(192, generator=g)
    toks = [(torch.randint(0, cfg.vocab_size, (28,), generator=g), False) for _ in range(chunks)]
    return prompt, pmel, spk, toks + [(torch.randint(0, cfg.vocab_size, (last_tokens,), generator=g), True)]


def alone(rt, stream):
    """The stream served alone: Runtime.step at B=1 on the same engines. Returns (pcm, mel) lists."""
    prompt, pmel, spk, toks = stream
    rec = MelRecorder(rt.cache)
    drv = dataclasses.replace(rt.driver, runner=rec, _window={})
    st = drv.setup(prompt[None], pmel[None], spk[None])
    pcm = [drv.step(st, t[None], last=last)[0] for t, last in toks]
    return pcm, next(iter(rec.mels.values()))


def served_with_recorder(rt):
    rec = MelRecorder(rt.cache)
    rt.driver.runner = rec
    return rec


@pytest.fixture
def recorded(rt):
    rec = served_with_recorder(rt)
    yield rec
    rt.driver.runner = rt.cache


def tag_of(stream):
    return stream[2][:4].tolist().__repr__()


def test_staggered_streams_batch_and_match_alone(rt, recorded):
    """12 streams, four opening per round, 2-4 chunks each: every chunk's mel and PCM match the
    stream served alone; steady groups ran as B=3 engine calls (padded when 2 were ready)."""
    cfg = rt.model.cfg
    streams = [make_stream(cfg, i, 1 + i % 3) for i in range(12)]
    before = rt.stats()
    got = {i: [] for i in range(12)}
    with rt.serve(max_streams=12, max_wait_ms=50) as srv:
        handles, pos = {}, {}
        for rnd in range(12):
            for i in range(4 * rnd, 4 * rnd + 4):
                if i < 12:
                    handles[i] = srv.open_stream(*streams[i][:3])
                    pos[i] = 0
            for h in handles.values():
                h.ready.result(timeout=120)
            live = [i for i in handles if pos[i] < len(streams[i][3])]
            if not live:
                break
            futs = srv.submit_many([(handles[i], *streams[i][3][pos[i]]) for i in live])
            for i, f in zip(live, futs):
                got[i].append(f.result(timeout=120))
                pos[i] += 1
        stats = srv.stats()
    assert stats["open_streams"] == 0 and stats.get("failed_chunks", 0) == 0
    assert stats["chunks"] == sum(len(s[3]) for s in streams)
    assert any(k.startswith("engine B=3") for k in stats["calls"]) and stats["padded_rows"] > 0
    for i, s in enumerate(streams):
        pcm, mel = alone(rt, s)
        served_mel = recorded.mels[tag_of(s)]
        assert len(got[i]) == len(pcm) == len(served_mel)
        for a, b in zip(served_mel, mel):
            assert rel_l2(a, b) <= MEL_TOL
        for a, b in zip(got[i], pcm):
            assert a.shape == b.shape and rel_l2(a, b) <= PCM_TOL
    # every unit call of a key with an engine hit it; every other key was served eagerly
    built = {k.id for k in rt.cache.keys}
    after = rt.stats()
    for comp, per_key in after.items():
        for kid, c in per_key.items():
            old = before.get(comp, {}).get(kid, {"hits": 0, "misses": 0})
            hits, misses = c["hits"] - old["hits"], c["misses"] - old["misses"]
            assert c["failures"] == 0
            assert (misses == 0) if kid in built else (hits == 0), (kid, hits, misses)
    assert after["cfm"]["cfm-B3-T50-L200-float32"]["hits"] > before.get("cfm", {}).get(
        "cfm-B3-T50-L200-float32", {"hits": 0})["hits"]


def test_one_stream_served_alone_is_bit_exact(rt):
    """Through the server at B=1 (gather, step, scatter) a stream gets exactly Runtime.step's audio."""
    s = make_stream(rt.model.cfg, 99, 3)
    with rt.serve(max_streams=2) as srv:
        h = srv.open_stream(*s[:3])
        got = [srv.submit(h, t, last=last).result(timeout=120) for t, last in s[3]]
    want, _ = alone(rt, s)
    for a, b in zip(got, want):
        assert torch.equal(a, b.float().cpu())


def test_prompt_set_up_runs_on_its_engines(rt):
    """The set-up keys (encoder C=0, CFM L=0) are served by engines, and the state they leave
    matches the eager set-up within the units' float32 tolerance."""
    prompt, pmel, spk, _ = make_stream(rt.model.cfg, 98, 1)
    before = {k.id: rt.stats()[k.component].get(k.id, {"hits": 0})["hits"] for k in SETUP_B1}
    state = rt.setup(prompt[None], pmel[None], spk[None])
    for k in SETUP_B1:
        assert rt.stats()[k.component][k.id]["hits"] == before[k.id] + 1
    eager = dataclasses.replace(rt.driver, runner=EagerRunner(rt.model), _window={})
    want = eager.setup(prompt[None], pmel[None], spk[None])
    for name in ("conformer_cnn", "conformer_att", "estimator_cnn", "estimator_att"):
        got, ref = getattr(state, name), getattr(want, name)
        assert got.shape == ref.shape and rel_l2(got, ref) <= 1e-4, name


def test_voice_cache_reuses_a_prompts_set_up(rt):
    """A stream opened with a prompt the server has set up before is ready at once and gets the
    same audio as with its own set-up; the cache keeps the most recently used voices."""
    cfg = rt.model.cfg
    a, a2, b = make_stream(cfg, 900, 2), make_stream(cfg, 901, 2), make_stream(cfg, 902, 1)
    a2 = a[:3] + a2[3:]                               # A's voice, other chunks
    with rt.serve(max_streams=4, voice_cache=1) as srv:
        srv.open_stream(*a[:3]).ready.result(timeout=120)
        h = srv.open_stream(*a2[:3])
        assert h.ready.done() and srv.stats()["voice_hits"] == 1
        got = [srv.submit(h, t, last=last).result(timeout=120) for t, last in a2[3]]
        srv.open_stream(*b[:3]).ready.result(timeout=120)              # evicts A (voice_cache=1)
        srv.open_stream(*a[:3]).ready.result(timeout=120)              # set up again: no hit
        assert srv.stats()["voice_hits"] == 1 and srv.stats()["voices"] == 1
    want, _ = alone(rt, a2)
    for x, y in zip(got, want):
        assert torch.equal(x, y.float().cpu())
    with rt.serve(max_streams=2, voice_cache=0) as srv:
        srv.open_stream(*a[:3]).ready.result(timeout=120)
        srv.open_stream(*a[:3]).ready.result(timeout=120)
        assert srv.stats().get("voice_hits", 0) == 0 and srv.stats()["voices"] == 0


def serve_lockstep_with_a_gap(rt, chunks: int = 5, gap: int = 3):
    """Two streams in lockstep, the second (one chunk shorter) sitting out round `gap` and
    rejoining after. Returns the streams, their pcm per chunk and the server's stats."""
    cfg = rt.model.cfg
    a, b = make_stream(cfg, 950, chunks), make_stream(cfg, 951, chunks - 1)   # each and its last chunk
    got = {0: [], 1: []}
    with rt.serve(max_streams=2, max_wait_ms=50) as srv:
        ha, hb = srv.open_stream(*a[:3]), srv.open_stream(*b[:3])
        for c in range(chunks + 1):
            pairs = [(0, ha, a[3][c])] + ([] if c == gap else [(1, hb, b[3][c if c < gap else c - 1])])
            futs = srv.submit_many([(h, t, last) for _, h, (t, last) in pairs])
            for (i, _, _), f in zip(pairs, futs):
                got[i].append(f.result(timeout=120))
        stats = srv.stats()
    return (a, b), got, stats


def test_resident_batches_run_in_place_and_hand_streams_back(rt, recorded):
    """Two streams in lockstep run their batch in place (no gather or scatter); when one skips a
    round and later rejoins, rows are written back to the slots and gathered again. Every
    chunk still matches the stream served alone."""
    streams, got, stats = serve_lockstep_with_a_gap(rt)
    assert stats["in_place_calls"] >= 2 and stats["flushed_rows"] >= 2, stats
    for i, s in enumerate(streams):
        pcm, mel = alone(rt, s)
        assert len(got[i]) == len(pcm) == len(recorded.mels[tag_of(s)])
        assert all(rel_l2(x, y) <= MEL_TOL for x, y in zip(recorded.mels[tag_of(s)], mel))
        assert all(x.shape == y.shape and rel_l2(x, y) <= PCM_TOL for x, y in zip(got[i], pcm))


class InPlaceCFM:
    """Wraps a runner; hands the estimator cache back as AOTI's in-place Euler replay does
    (runtime.engines.aoti.EulerReplay, form "in_place"), with the values the wrapped runner
    computes: given a ring with exactly T free slots, the chunk's frames go into those slots of
    the same buffer and the trim only shortens the order; otherwise the cache is laid out anew
    ([the chunk's T slots | the frames in order]). Before it writes, it checks that the slots it
    writes hold no frame of the ring it was handed."""

    def __init__(self, runner):
        self.runner, self.in_place, self.laid_out = runner, 0, 0

    def run(self, key, inputs, trim=None):
        if key.component != "cfm" or key.dim("L") == 0:
            return self.runner.run(key, inputs, trim)
        ring, T = inputs[5], key.dim("T")
        assert isinstance(ring, RingCache), type(ring)            # the driver hands the cache as a ring
        before = ring.logical().clone()
        mel, cnn, att = self.runner.run(key, [*inputs[:5], ring.logical()])   # [chunk T | cache L], untrimmed
        free = ring.free()
        if len(free) == T:
            assert not set(free) & set(ring.order)
            ring.buffer.index_copy_(-2, torch.tensor(free), att[..., :T, :])
            new, self.in_place = RingCache(ring.buffer, [*free, *ring.order]), self.in_place + 1
        else:
            new, self.laid_out = RingCache.of(att), self.laid_out + 1
        assert torch.equal(ring.logical(), before)               # the input's cache is unchanged
        return mel, cnn, trim.apply(new) if trim is not None else new

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_a_server_keeps_an_in_place_cache_where_the_engine_wrote_it(rt):
    """With a CFM that updates its cache in place (InPlaceCFM), resident batches carry the ring
    from chunk to chunk, a stream that leaves its batch is written back to its slot from the
    ring's runs, and every chunk's audio is bit-identical to the same schedule served with
    plain tensors. The prompt is 100 frames and a chunk 50, so the trim first drops frames at
    round 2 (the first stream alone, its partner written back); they run together from round 3
    (gathered: laid out anew), in place from round 4 until the shorter last chunk."""
    _, want, _ = serve_lockstep_with_a_gap(rt, chunks=7, gap=2)
    ring = InPlaceCFM(rt.cache)
    rt.driver.runner = ring
    try:
        _, got, stats = serve_lockstep_with_a_gap(rt, chunks=7, gap=2)
    finally:
        rt.driver.runner = rt.cache
    assert ring.in_place >= 2 and ring.laid_out >= 2 and stats["flushed_rows"] >= 2, (ring.in_place, stats)
    for i in want:
        assert len(got[i]) == len(want[i]) and all(torch.equal(x, y) for x, y in zip(got[i], want[i])), i


class SolveGraphedCFM:
    """Wraps a runner; serves the CFM's chunks with a cache (L > 0) as the AOTI backend serves a
    B=32 key on CUDA: the eager in-place Euler step (runtime.units.CFMStepUnit) replayed by
    EulerReplay with solve graphs, on the fake GPU of tests/runtime/engines/test_graphs.py, so a
    resident batch's ring handed back is solved by one captured graph of the whole solve."""

    def __init__(self, runner, model, cuda):
        unit = SPECS["cfm"].export_variant.build(model).eval()
        self.step = cuda.kernel(lambda *a: torch.no_grad()(unit)(*a))
        self.runner, self.steps, self.replays = runner, model.cfg.n_timesteps, {}

    def run(self, key, inputs, trim=None):
        if key.component != "cfm" or key.dim("L") == 0:
            return self.runner.run(key, inputs, trim)
        from c2w.runtime.engines.aoti import EulerReplay
        if key not in self.replays:
            self.replays[key] = EulerReplay(self.step, self.steps, torch.device("cpu"), "in_place", solve_graphs=2)
        *rest, att = inputs
        return list(self.replays[key](*[t.contiguous() for t in rest], att, trim=trim))

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_a_server_solves_its_resident_rings_from_solve_graphs(rt, monkeypatch):
    """The serving path of a B=32 AOTI CFM engine on CUDA, on the CPU: resident batches hand the
    replay back the ring it returned, the first such chunk captures the whole solve over that
    ring's buffer and the later ones replay it, on the serving thread; every chunk's audio
    matches the same schedule served by the directory's own engines (the in-place step attends
    to its keys in another order: rounding only, PCM_TOL)."""
    from tests.runtime.engines.test_graphs import fake_cuda
    _, want, _ = serve_lockstep_with_a_gap(rt, chunks=7, gap=2)
    graphed = SolveGraphedCFM(rt.cache, rt.model, fake_cuda(monkeypatch))
    rt.driver.runner = graphed
    try:
        _, got, stats = serve_lockstep_with_a_gap(rt, chunks=7, gap=2)
    finally:
        rt.driver.runner = rt.cache
    graphs = [r.graphs for r in graphed.replays.values()]
    held = [g.held(e.ref()) for g in graphs for e in g._buffers.values() if e.ref() is not None]
    replays = sorted(c.graph.replays for c in held if c is not None)
    assert stats["in_place_calls"] >= 2 and sum(g.captures for g in graphs) >= 1 and replays and replays[-1] >= 2, \
        (stats, replays)
    for i in want:
        assert len(got[i]) == len(want[i]) and all(rel_l2(x, y) <= PCM_TOL for x, y in zip(got[i], want[i])), i


def serve_two_cohorts(rt, lanes: int):
    """Two streams, then two more one chunk behind: every round submits both cohorts at once,
    two groups at different positions. Returns ({stream: [pcm]}, server stats)."""
    cfg = rt.model.cfg
    streams = [make_stream(cfg, 970 + i, 2) for i in range(4)]
    got = {i: [] for i in range(4)}
    with rt.serve(max_streams=4, max_wait_ms=0, lanes=lanes) as srv:
        handles = {i: srv.open_stream(*streams[i][:3]) for i in range(2)}
        for rnd in range(len(streams[0][3]) + 1):
            if rnd == 1:
                handles.update({i: srv.open_stream(*streams[i][:3]) for i in range(2, 4)})
            for h in handles.values():
                h.ready.result(timeout=120)
            live = [i for i in handles if 0 <= rnd - (i >= 2) < len(streams[i][3])]
            futs = srv.submit_many([(handles[i], *streams[i][3][rnd - (i >= 2)]) for i in live])
            for i, f in zip(live, futs):
                got[i].append(f.result(timeout=120))
        stats = srv.stats()
    return got, stats


def test_two_lanes_run_groups_at_once_with_the_same_audio(rt):
    """lanes=2: groups at different positions run at the same time in two worker threads, each
    with engines of its own (EngineCache.replica, counted in the same stats). The batches are
    the same as through one lane, so every stream's audio is bit-identical; engines served the
    same calls."""
    before = rt.stats()
    one, stats1 = serve_two_cohorts(rt, lanes=1)
    mid = rt.stats()
    two, stats2 = serve_two_cohorts(rt, lanes=2)
    after = rt.stats()
    assert stats1["lanes"] == 1 and stats2["lanes"] == 2
    assert stats1.get("overlapped_batches", 0) == 0 and stats2["overlapped_batches"] >= 1, stats2
    assert stats1["calls"] == stats2["calls"]
    for i in one:
        assert len(one[i]) == len(two[i]) == 3
        assert all(torch.equal(a, b) for a, b in zip(one[i], two[i])), i

    def hits(a, b):
        return {kid: c["hits"] - a.get(comp, {}).get(kid, {"hits": 0})["hits"]
                for comp, per in b.items() for kid, c in per.items()}
    assert hits(before, mid) == hits(mid, after) and sum(hits(before, mid).values()) > 0


def test_threads_each_driving_a_stream(rt):
    cfg = rt.model.cfg
    streams = [make_stream(cfg, 200 + i, 1) for i in range(4)]
    got, errors = {}, []
    with rt.serve(max_streams=4, max_wait_ms=20) as srv:
        def client(i):
            try:
                h = srv.open_stream(*streams[i][:3])
                got[i] = [srv.submit(h, t, last=last).result(timeout=120) for t, last in streams[i][3]]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = srv.stats()
    assert not errors
    assert stats["chunks"] == 4 * 2 and sum(int(k.split("=")[1]) * n for k, n in stats["calls"].items()
                                            if not k.startswith("setup")) == 4 * 2 + stats["padded_rows"]
    for i, s in enumerate(streams):
        want, _ = alone(rt, s)
        assert all(rel_l2(a, b) <= PCM_TOL for a, b in zip(got[i], want))


def test_asyncio_clients(rt):
    cfg = rt.model.cfg
    streams = [make_stream(cfg, 300 + i, 1) for i in range(3)]

    async def client(srv, s):
        h = srv.open_stream(*s[:3])
        return [await srv.submit_async(h, t, last=last) for t, last in s[3]]

    async def main(srv):
        return await asyncio.gather(*(client(srv, s) for s in streams))

    with rt.serve(max_streams=3) as srv:
        results = asyncio.run(main(srv))
    for s, got in zip(streams, results):
        want, _ = alone(rt, s)
        assert all(rel_l2(a, b) <= PCM_TOL for a, b in zip(got, want))


def test_bad_input_fails_only_that_stream(rt):
    cfg = rt.model.cfg
    good, bad = make_stream(cfg, 400, 1), make_stream(cfg, 401, 1)
    with rt.serve(max_streams=4) as srv:
        hg, hb = srv.open_stream(*good[:3]), srv.open_stream(*bad[:3])
        f_dtype = srv.submit(hb, bad[3][0][0].float())
        f_vocab = srv.submit(hb, torch.full((28,), cfg.vocab_size))
        f_short = srv.submit(hb, torch.zeros(2, dtype=torch.int64))
        f_good = srv.submit(hg, good[3][0][0])
        with pytest.raises(C2WUserError, match="dtype torch.float32"):
            f_dtype.result(timeout=60)
        with pytest.raises(C2WUserError, match=rf"token ids in \[{cfg.vocab_size}, {cfg.vocab_size}\]"):
            f_vocab.result(timeout=60)
        with pytest.raises(C2WUserError, match=r"N >= 4"):
            f_short.result(timeout=60)
        last = srv.submit(hb, bad[3][-1][0], last=True)
        after = srv.submit(hb, bad[3][0][0])
        with pytest.raises(C2WUserError, match="after the chunk marked last=True"):
            after.result(timeout=60)
        assert last.result(timeout=60).shape[0] > 0
        got = [f_good.result(timeout=60)] + [srv.submit(hg, t, last=la).result(timeout=60) for t, la in good[3][1:]]
        with pytest.raises(C2WUserError, match="NaN or infinite"):
            srv.open_stream(good[0], good[1], torch.full((192,), float("nan")))
        with pytest.raises(C2WUserError, match="a list"):
            srv.open_stream(good[0].tolist(), good[1], good[2])
        h_np = srv.open_stream(good[0].numpy(), good[1].numpy(), good[2].numpy())   # numpy is accepted
        assert srv.submit(h_np, good[3][0][0].numpy()).result(timeout=60).shape == got[0].shape
    want, _ = alone(rt, good)
    assert all(rel_l2(a, b) <= PCM_TOL for a, b in zip(got, want))


def test_a_batch_that_raises_is_retried_per_stream(rt, monkeypatch):
    """A fault inside a batch (here: a poisoned token row in a steady B=3 batch) fails that stream
    only; its batch partner is retried alone and gets its normal audio; an engine that raises
    falls back to eager and is counted."""
    cfg = rt.model.cfg
    ok, poisoned = make_stream(cfg, 500, 3), make_stream(cfg, 501, 3)
    real_step = rt.driver.step

    def step(state, tokens, last=False, **kw):
        if bool((tokens[:, 0] == 4242).any()):
            raise RuntimeError("simulated device fault")
        return real_step(state, tokens, last=last, **kw)
    monkeypatch.setattr(rt.driver, "step", step)
    with rt.serve(max_streams=4, max_wait_ms=1000) as srv:
        h1, h2 = srv.open_stream(*ok[:3]), srv.open_stream(*poisoned[:3])
        got = []
        for c in range(2):                                   # to the steady position (L = P + 100)
            f1, f2 = srv.submit_many([(h1, ok[3][c][0], False), (h2, poisoned[3][c][0], False)])
            got.append(f1.result(timeout=60)), f2.result(timeout=60)
        t2 = poisoned[3][2][0].clone()
        t2[0] = 4242
        f1, f2 = srv.submit_many([(h1, ok[3][2][0], False), (h2, t2, False)])
        with pytest.raises(RuntimeError, match="simulated device fault"):
            f2.result(timeout=60)
        got.append(f1.result(timeout=60))
        with pytest.raises(C2WUserError, match="after the stream failed"):
            srv.submit(h2, poisoned[3][3][0], last=True).result(timeout=60)
        got.append(srv.submit(h1, ok[3][3][0], last=True).result(timeout=60))
        stats = srv.stats()
    assert stats["retried_batches"] == 1 and stats["failed_chunks"] == 1 and stats["calls"]["engine B=3"] >= 1
    monkeypatch.undo()
    want, _ = alone(rt, ok)
    assert all(rel_l2(a, b) <= PCM_TOL for a, b in zip(got, want))

    key = ShapeKey("cfm", (1, 50, 100), "float32")
    engine = rt.cache._engine(key)
    monkeypatch.setattr(engine, "run", lambda inputs, trim=None: (_ for _ in ()).throw(RuntimeError("engine fault")))
    before = rt.stats()["cfm"].get(key.id, {"failures": 0})["failures"]
    with rt.serve(max_streams=1) as srv:
        h = srv.open_stream(*ok[:3])
        pcm = srv.submit(h, ok[3][0][0]).result(timeout=60)
    assert rt.stats()["cfm"][key.id]["failures"] == before + 1
    assert rel_l2(pcm, want[0]) <= PCM_TOL


def test_full_server_close_cancel_and_slot_reuse(rt):
    cfg = rt.model.cfg
    s = [make_stream(cfg, 600 + i, 1) for i in range(3)]
    with rt.serve(max_streams=2, max_wait_ms=0) as srv:
        a, b = srv.open_stream(*s[0][:3]), srv.open_stream(*s[1][:3])
        with pytest.raises(ServerFullError, match="at most max_streams=2"):
            srv.open_stream(*s[2][:3])
        queued = [srv.submit(b, t, last=la) for t, la in s[1][3]]
        srv.close(b).result(timeout=60)                          # returns once b's slot is free
        results = Counter()
        for f in queued:
            try:
                f.result(timeout=60)
                results["done"] += 1
            except Exception as e:  # noqa: BLE001 - counted
                results[type(e).__name__] += 1
        assert results["CancelledError"] >= 1 and sum(results.values()) == len(queued)
        with pytest.raises(C2WUserError, match="a chunk for a closed stream"):
            srv.submit(b, s[1][3][0][0]).result(timeout=60)
        c = srv.open_stream(*s[2][:3])                           # b's slot is free again
        for t, la in s[0][3]:
            srv.submit(a, t, last=la).result(timeout=60)           # a finishes: its slot is freed
        d = srv.open_stream(*s[1][:3])
        got = [srv.submit(d, t, last=la).result(timeout=60) for t, la in s[1][3]]
        srv.close(c).result(timeout=60)
        assert srv.stats()["open_streams"] == 0
    want, _ = alone(rt, s[1])
    assert all(rel_l2(x, y) <= PCM_TOL for x, y in zip(got, want))


def test_a_lone_stream_does_not_wait_for_company(rt):
    """max_wait bounds how long a partial batch waits, but with no idle stream that could join,
    a chunk runs at once: a 60 s max_wait must not delay a single stream."""
    s = make_stream(rt.model.cfg, 700, 1)
    with rt.serve(max_streams=2, max_wait_ms=60_000) as srv:
        h = srv.open_stream(*s[:3])
        assert srv.submit(h, s[3][0][0]).result(timeout=30).shape[0] > 0


def test_a_new_streams_first_chunk_goes_before_chunks_of_streams_ahead_of_their_listeners(rt, monkeypatch):
    """Earliest deadline first: stream A has a second of audio delivered and its next chunk queued;
    stream B then opens and asks for its first chunk. B's set-up and first chunk run before A's
    queued chunk (A's listener still has audio), although A asked first. FIFO would run A first."""
    cfg = rt.model.cfg
    a, b = make_stream(cfg, 900, 3), make_stream(cfg, 901, 1)
    step, entered, gate, order = rt.driver.step, threading.Event(), threading.Event(), []

    def gated_step(state, tokens, last=False):
        if not gate.is_set():
            entered.set()
            gate.wait(60)
        order.append(next(name for name, st in (("a", a), ("b", b)) if any(torch.equal(tokens[0], t) for t, _ in st[3])))
        return step(state, tokens, last=last)

    with rt.serve(max_streams=2, max_wait_ms=0) as srv:
        ha = srv.open_stream(*a[:3])
        first = srv.submit(ha, a[3][0][0]).result(timeout=60)
        assert first.shape[0] / cfg.hift.sampling_rate > 0.5        # A's listener has audio to play
        monkeypatch.setattr(rt.driver, "step", gated_step)
        running = srv.submit(ha, a[3][1][0])                          # holds the lane at the gate
        assert entered.wait(60)
        queued = srv.submit(ha, a[3][2][0])                           # A asks first ...
        hb = srv.open_stream(*b[:3])
        b_first = srv.submit(hb, b[3][0][0])                          # ... then B, with nothing to play
        gate.set()
        for f in (running, queued, b_first):
            f.result(timeout=60)
    assert order == ["a", "b", "a"], order
    assert srv.stats()["chunks"] == 4


def gate_first_setup_and_record(rt, monkeypatch, streams: dict):
    """Patch the driver so that the first set-up waits at a gate and every set-up and chunk is
    recorded by stream name ("setup a", "chunk b", ...). Returns (entered, gate, order)."""
    setup, step, entered, gate, order = rt.driver.setup, rt.driver.step, threading.Event(), threading.Event(), []

    def gated_setup(tokens, mel, spk):
        if not gate.is_set():
            entered.set()
            gate.wait(60)
        order.append("setup " + next(n for n, st in streams.items() if torch.equal(tokens[0], st[0])))
        return setup(tokens, mel, spk)

    def recorded_step(state, tokens, last=False):
        order.append("chunk " + next(n for n, st in streams.items() if torch.equal(tokens[0], st[3][0][0])))
        return step(state, tokens, last=last)

    monkeypatch.setattr(rt.driver, "setup", gated_setup)
    monkeypatch.setattr(rt.driver, "step", recorded_step)
    return entered, gate, order


def test_a_streams_first_chunk_goes_before_the_set_up_of_a_stream_opened_after_it(rt, monkeypatch):
    """Time to first audio counts from open_stream, so a stream's set-up and first chunk share the
    deadline of its opening: A's first chunk runs before the set-up of B, opened after A, even
    though B's set-up was queued before A's chunk. (Were the chunk's deadline its own submission,
    arrivals faster than the set-ups would hold every first chunk back until the last set-up.)"""
    cfg = rt.model.cfg
    a, b = make_stream(cfg, 910, 1), make_stream(cfg, 911, 1)
    entered, gate, order = gate_first_setup_and_record(rt, monkeypatch, {"a": a, "b": b})
    with rt.serve(max_streams=2, max_wait_ms=0, voice_cache=0) as srv:
        ha = srv.open_stream(*a[:3])                    # A's set-up holds the lane at the gate
        assert entered.wait(60)
        hb = srv.open_stream(*b[:3])                    # B's set-up is queued ...
        a_first = srv.submit(ha, a[3][0][0])            # ... before A's first chunk
        b_first = srv.submit(hb, b[3][0][0])
        gate.set()
        for f in (a_first, b_first):
            f.result(timeout=60)
    assert order == ["setup a", "chunk a", "setup b", "chunk b"], order


def test_a_stream_just_set_up_gets_its_first_chunk_in_before_the_next_set_up(rt, monkeypatch):
    """A's client submits its first chunk only once A is set up, while B's set-up is already
    queued. The lane holds B's set-up (a later deadline) for up to max_wait for A, which was just
    served and is about to ask, instead of starting it the moment A's set-up returns."""
    cfg = rt.model.cfg
    a, b = make_stream(cfg, 920, 1), make_stream(cfg, 921, 1)
    entered, gate, order = gate_first_setup_and_record(rt, monkeypatch, {"a": a, "b": b})
    with rt.serve(max_streams=2, max_wait_ms=5_000, voice_cache=0) as srv:
        ha = srv.open_stream(*a[:3])
        assert entered.wait(60)
        hb = srv.open_stream(*b[:3])                    # queued behind A's set-up
        gate.set()
        ha.ready.result(timeout=60)
        a_first = srv.submit(ha, a[3][0][0])            # A asks right after its set-up
        hb.ready.result(timeout=60)
        b_first = srv.submit(hb, b[3][0][0])
        for f in (a_first, b_first):
            f.result(timeout=60)
    assert order == ["setup a", "chunk a", "setup b", "chunk b"], order


@pytest.mark.parametrize("n, built, want", [
    (1, [1, 3], [(1, 1)]),
    (2, [1, 3], [(3, 2)]),                  # pad one inert row rather than two calls
    (3, [1, 3], [(3, 3)]),
    (4, [1, 3], [(3, 3), (1, 1)]),
    (9, [1, 8, 32], [(8, 8), (1, 1)]),
    (20, [1, 8, 32], [(32, 20)]),
    (3, [], [(3, 3)]),                      # no engine: one eager batch
])
def test_plan_batches(n, built, want):
    assert sorted(plan_batches(n, built)) == sorted(want)


def test_pool_gather_scatter_round_trip(rt):
    """Slots hold exactly what a batch leaves behind, whatever their order, and padding rows are
    dropped."""
    with rt.serve(max_streams=4) as srv, torch.inference_mode():
        pool = srv.pool
        st = pool.gather([2, 0, 2], {"conformer_att": 7, "estimator_att": 5, "hift_mel": 8, "hift_source": 3840,
                                     "hift_speech": 3840}, 100, [None] * 3)
        assert st.estimator_att.shape[2] == 6 and st.estimator_att.shape[4] == 5
        for f in ("estimator_att", "conformer_att", "spk", "hift_source"):
            t = getattr(st, f)
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype))
        lengths = pool.scatter([2, 0], st)
        back = pool.gather([0, 2], lengths, 100, [None] * 2)
        B = 3
        halves = st.estimator_att.unflatten(2, (2, B))
        assert torch.equal(back.estimator_att.unflatten(2, (2, 2))[:, :, :, 0], halves[:, :, :, 1])
        assert torch.equal(back.estimator_att.unflatten(2, (2, 2))[:, :, :, 1], halves[:, :, :, 0])
        assert torch.equal(back.spk, st.spk[[1, 0]])
        assert np.isfinite(back.conformer_att.numpy()).all()


def test_websocket_example_serves_four_clients_at_once(serve_dir, rt):
    """examples/ws_server.py in a subprocess on the tiny artifacts; four clients of
    examples/ws_client.py at once each get the audio their stream gets alone."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("ws_client", root / "examples" / "ws_client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    proc = subprocess.Popen([sys.executable, str(root / "examples" / "ws_server.py"), str(serve_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
    try:
        first = []
        reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=300)
        assert first and first[0].startswith("listening on ws://127.0.0.1:"), proc.stderr.read() if proc.poll() else first
        url = first[0].split()[-1]
        sessions = [client.random_session(i, 100, 1, rt.model.cfg.vocab_size) for i in range(4)]

        async def all_clients():
            return await asyncio.gather(*(client.run_session(url, *s) for s in sessions))
        results = asyncio.run(asyncio.wait_for(all_clients(), timeout=300))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for (prompt, mel, spk, chunks), got in zip(sessions, results):
        stream = (torch.as_tensor(prompt), torch.as_tensor(mel, dtype=torch.float32),
                  torch.as_tensor(spk, dtype=torch.float32), [(torch.as_tensor(t), last) for t, last in chunks])
        want, _ = alone(rt, stream)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert rel_l2(torch.from_numpy(a.copy()), b.float()) <= PCM_TOL


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the bug this test plants
def test_a_scheduler_bug_fails_waiting_callers_instead_of_hanging_them(rt, monkeypatch):
    s = make_stream(rt.model.cfg, 800, 1)
    srv = rt.serve(max_streams=1)
    try:
        h = srv.open_stream(*s[:3])
        h.ready.result(timeout=60)
        monkeypatch.setattr(srv, "_next_batch", lambda lane, now: 1 / 0)
        fut = srv.submit(h, s[3][0][0])
        with pytest.raises(RuntimeError, match="stream server stopped: ZeroDivisionError"):
            fut.result(timeout=60)
        with pytest.raises(C2WUserError, match="after shutdown"):
            srv.submit(h, s[3][0][0]).result(timeout=60)
    finally:
        srv.shutdown()
