"""`c2w bench --serve`: many concurrent synthetic streams through one StreamServer.

Per concurrency N: N client threads arrive staggered (fixed offsets or Poisson), each runs a
whole session (prompt, a 28-token first chunk, `steady_chunks` chunks of `chunk_tokens`, a final
chunk): the first chunk is submitted once the prompt is set up, each next one as soon as the
previous one's PCM is back (closed loop: the GPU is never idle) or, with `token_rate`, not before
the LLM would have produced its tokens (paced: after the first chunk, `token_rate` tokens per
second per stream; a chunk after the first brings N - 3 new tokens, its first 3 being the
previous chunk's lookahead, so 25 is real time). With `ahead` K a client keeps K more chunks
submitted than the one it waits for (the LLM's tokens are there before the audio: the server
never waits for a client's round trip). Time to first audio counts from `open_stream`.
Reports time to first audio, chunk latencies, listener stalls (a listener who starts playing at
the first chunk's arrival and plays each chunk as it comes waits whenever a chunk arrives after
the audio before it has played out), aggregate and steady-phase audio-s/s, the batch sizes the
server ran, the engine hit rate and the slot pool's memory; checks that every stream got each of
its chunks once, with the right length, and that sampled streams equal their solo runs.

Two references are measured in the same process: one stream stepped directly with
`Runtime.step` (the server's overhead at N=1), and the largest equal-shape batch stepped directly
(what perfect batching would give). Latencies are wall-clock from submit to the PCM on the host.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from pathlib import Path

import torch

from c2w.runtime.units import rel_l2

FIRST_TOKENS = 28
TAIL_TOKENS = 13
SAMPLES_PER_TOKEN = 960          # 2 mel frames x 480 samples
SAMPLE_RATE = 24000


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(xs: list[float]) -> dict:
    return {"p50": _pct(xs, 0.5), "p95": _pct(xs, 0.95), "p99": _pct(xs, 0.99), "n": len(xs)}


def session_inputs(cfg, seed: int, P: int, chunk_tokens: int, steady_chunks: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (P // cfg.up_rate,), generator=g)
    pmel, spk = torch.randn(P, cfg.mel_bins, generator=g), torch.randn(cfg.spk_embed_dim, generator=g)
    sizes = [FIRST_TOKENS] + [chunk_tokens] * steady_chunks
    chunks = [(torch.randint(0, cfg.vocab_size, (n,), generator=g), False) for n in sizes]
    return prompt, pmel, spk, chunks + [(torch.randint(0, cfg.vocab_size, (TAIL_TOKENS,), generator=g), True)]


def expected_samples(cfg, n: int, last: bool, first: bool) -> int:
    """PCM samples a chunk of n tokens returns: its frames' samples, less the 3840 a non-final
    chunk holds back for the cross-fade, plus the 3840 the previous chunk held back."""
    held = cfg.hift_source_cache
    frames = cfg.up_rate * (n if last else n - cfg.encoder.pre_lookahead)
    return frames * cfg.hift.samples_per_frame + (0 if first else held) - (0 if last else held)


def direct_reference(rt, B: int, P: int, chunk_tokens: int, reps: int) -> dict:
    """B streams at equal shapes stepped with Runtime.step: first chunk and steady chunk wall ms
    (PCM on the host), and steady audio-s/s."""
    cfg = rt.model.cfg
    ins = [session_inputs(cfg, 10_000 + i, P, chunk_tokens, 3 + reps) for i in range(B)]
    stack = lambda j: torch.stack([x[3][j][0] for x in ins])  # noqa: E731
    state = rt.setup(torch.stack([x[0] for x in ins]), torch.stack([x[1] for x in ins]),
                     torch.stack([x[2] for x in ins]))
    sync = (lambda: torch.cuda.synchronize()) if rt.driver._device().type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    rt.step(state, stack(0)).cpu()
    first = (time.perf_counter() - t0) * 1e3
    for j in range(1, 3):                                 # to the saturated cache lengths
        rt.step(state, stack(j)).cpu()
    steady = []
    for j in range(3, 3 + reps):
        sync()
        t0 = time.perf_counter()
        rt.step(state, stack(j)).cpu()
        steady.append((time.perf_counter() - t0) * 1e3)
    audio_s = B * cfg.up_rate * (chunk_tokens - cfg.encoder.pre_lookahead) / 50
    return {"B": B, "chunk_tokens": chunk_tokens, "first_ms": first, "steady_ms": _summary(steady),
            "steady_audio_s_per_s": audio_s / (_pct(steady, 0.5) / 1e3)}


async def _client(server, ins, arrive_at: float, t_start: float, log: dict, token_rate: float = 0.0,
                  in_loop: bool = False, lookahead: int = 3, ahead: int = 0) -> None:
    """One synthetic session. in_loop: the client shares an event loop with the others (awaits the
    server's futures); else it has a thread and a loop of its own and blocks on them. lookahead:
    a non-final chunk's last tokens, which the next chunk starts with (cfg.encoder.pre_lookahead).
    ahead: chunks the client keeps submitted beyond the one whose audio it waits for (0: the next
    chunk goes in once the last one's audio is back; 1: it is already queued, as when the LLM's
    tokens are there before the audio). A chunk is done when its future resolves (timed there)."""
    async def pause(seconds: float) -> None:
        await asyncio.sleep(seconds) if in_loop else time.sleep(seconds)

    async def result(fut):
        return await asyncio.wrap_future(fut) if in_loop else fut.result()

    await pause(max(0.0, t_start + arrive_at - time.perf_counter()))
    t_open = time.perf_counter()
    h = server.open_stream(*ins[:3])
    await result(h.ready)                       # the prompt is set up (or copied from the voice cache)
    log["setup_ms"] = (time.perf_counter() - t_open) * 1e3
    pending = deque()                           # (i, tokens, last, t_submit, future, [t_done])

    async def collect() -> None:
        j, tok, last, t0, fut, done = pending.popleft()
        pcm = await result(fut)
        # a thread blocked on fut.result() can wake before the future runs its callbacks: then
        # the result was set just now
        t_done = done[0] if done else time.perf_counter()
        log["chunks"].append({"i": j, "t_submit": t0, "t_done": t_done, "samples": int(pcm.shape[0]),
                              "tokens": int(tok.shape[0]), "last": last})
        if j == 0:
            log["ttfa_ms"] = (t_done - t_open) * 1e3
        log["pcm"].append(pcm)

    t_first, new_tokens = time.perf_counter(), 0
    for j, (tok, last) in enumerate(ins[3]):
        if token_rate and j:                    # paced: its tokens exist only from then on
            new_tokens += int(tok.shape[0]) - lookahead
            await pause(max(0.0, t_first + new_tokens / token_rate - time.perf_counter()))
        while len(pending) > ahead:
            await collect()
        done: list[float] = []
        t0 = time.perf_counter()
        fut = server.submit(h, tok, last=last)
        fut.add_done_callback(lambda f, done=done: done.append(time.perf_counter()))
        pending.append((j, tok, last, t0, fut, done))
    while pending:
        await collect()


CLIENTS = ("threads", "asyncio")


def run_level(rt, server, N: int, *, P: int, chunk_tokens: int, steady_chunks: int, stagger_ms: float,
              arrival: str, seed: int, check_streams: int, voices: int = 0, token_rate: float = 0.0,
              clients: str = "threads", ahead: int = 0) -> dict:
    """One concurrency level. clients: "threads" (a thread per client, blocking on its futures)
    or "asyncio" (every client a coroutine of one event loop, as in an asyncio server); ahead:
    chunks each client keeps queued beyond the one it waits for (`_client`)."""
    cfg = rt.model.cfg
    rng = random.Random(seed + N)
    offsets, t = [], 0.0
    for i in range(N):
        offsets.append(t)
        t += (rng.expovariate(1.0 / stagger_ms) if arrival == "poisson" else stagger_ms) / 1e3
    ins = [session_inputs(cfg, seed * 1000 + N * 100 + i, P, chunk_tokens, steady_chunks) for i in range(N)]
    if voices:                     # stream i speaks with voice i % voices: a prompt the server may know
        prompts = [session_inputs(cfg, 77_000 + seed * 1000 + v, P, chunk_tokens, 0)[:3] for v in range(voices)]
        ins = [prompts[i % voices] + x[3:] for i, x in enumerate(ins)]
    logs = [{"chunks": [], "pcm": []} for _ in range(N)]
    before_units, before_srv = rt.stats(), server.stats()
    t_start = time.perf_counter() + 0.05
    sessions = [_client(server, ins[i], offsets[i], t_start, logs[i], token_rate, in_loop=clients == "asyncio",
                        lookahead=cfg.encoder.pre_lookahead, ahead=ahead) for i in range(N)]
    if clients == "asyncio":
        async def together():
            await asyncio.gather(*sessions)
        asyncio.run(together())
    else:
        threads = [threading.Thread(target=asyncio.run, args=(session,)) for session in sessions]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    after_units, after_srv = rt.stats(), server.stats()
    return summarize_level(cfg, N, ins, logs, t_start, before_units, after_units, before_srv, after_srv,
                           chunk_tokens, rt, check_streams)


def steady_window(logs, saturated: int) -> tuple[float, float, list[dict]]:
    """(start, end, chunks done within): the steady phase of one level. It opens once every
    stream has its first chunk at the saturated cache length (chunk `saturated`, the third) back,
    and closes when the first stream submits its final chunk. Opening it at that chunk's
    submission instead counted, for clients that keep chunks queued ahead (`--ahead`), the calls
    still running the chunks before it (each stream's second chunk) as steady ones."""
    a = max(next(c["t_done"] for c in log["chunks"] if c["i"] == saturated) for log in logs)
    b = min(next(c["t_submit"] for c in log["chunks"] if c["last"]) for log in logs)
    return a, b, [c for log in logs for c in log["chunks"] if c["i"] > saturated and not c["last"] and a < c["t_done"] <= b]


def summarize_level(cfg, N, ins, logs, t_start, before_units, after_units, before_srv, after_srv,
                    chunk_tokens, rt, check_streams) -> dict:
    chunk_audio = cfg.up_rate * (chunk_tokens - cfg.encoder.pre_lookahead) / 50
    lost = dup = wrong_len = 0
    steady, first, audio = [], [], 0.0
    stalls = [listener_stalls(log["chunks"]) for log in logs]
    for x, log in zip(ins, logs):
        got = [c["i"] for c in log["chunks"]]
        lost += len(x[3]) - len(set(got))
        dup += len(got) - len(set(got))
        for c in log["chunks"]:
            want = expected_samples(cfg, c["tokens"], c["last"], c["i"] == 0)
            wrong_len += c["samples"] != want
            audio += c["samples"] / SAMPLE_RATE
            ms = (c["t_done"] - c["t_submit"]) * 1e3
            (first if c["i"] == 0 else steady if not c["last"] else []).append(ms)
    a, b, in_window = steady_window(logs, saturated=min(2, len(ins[0][3]) - 2))
    wall = max(c["t_done"] for log in logs for c in log["chunks"]) - t_start
    hits = misses = 0
    for comp, per in after_units.items():
        for kid, c in per.items():
            old = before_units.get(comp, {}).get(kid, {"hits": 0, "misses": 0, "failures": 0})
            hits += c["hits"] - old["hits"]
            misses += c["misses"] + c["failures"] - old["misses"] - old["failures"]
    calls = {k: v - before_srv["calls"].get(k, 0) for k, v in after_srv["calls"].items()
             if v - before_srv["calls"].get(k, 0)}
    row = {"N": N, "chunks": sum(len(log["chunks"]) for log in logs), "lost": lost, "duplicated": dup,
           "wrong_length": wrong_len, "ttfa_ms": _summary([log["ttfa_ms"] for log in logs]),
           "setup_ms": _summary([log["setup_ms"] for log in logs]),
           "first_chunk_ms": _summary(first), "steady_chunk_ms": _summary(steady),
           "stalled_chunks": sum(n for n, _ in stalls), "stall_ms": sum(ms for _, ms in stalls),
           "stalled_streams": sum(1 for n, _ in stalls if n),
           "audio_s_per_s": audio / wall, "wall_s": wall,
           "steady_audio_s_per_s": (len(in_window) * chunk_audio / (b - a)) if b > a and in_window else None,
           "rtf": (_pct(steady, 0.5) / 1e3 / chunk_audio) if steady else None,
           "batches": calls, "engine_hit_rate": hits / max(1, hits + misses), "unit_calls": hits + misses,
           "pool_bytes": after_srv["pool_bytes"], "failed_chunks": after_srv.get("failed_chunks", 0)
           - before_srv.get("failed_chunks", 0),
           **{k: after_srv.get(k, 0) - before_srv.get(k, 0)
              for k in ("voice_hits", "in_place_calls", "flushed_rows", "overlapped_batches")},
           # per key: whole-solve graphs captured, solves replayed from one, solves declined one
           "solve_graphs": {kid: {n: v - before_srv.get("solve_graphs", {}).get(kid, {}).get(n, 0)
                                  for n, v in c.items() if n != "held"}
                            for kid, c in after_srv.get("solve_graphs", {}).items()}}
    row["solo_check"] = solo_check(rt, ins[:check_streams], [log["pcm"] for log in logs[:check_streams]])
    return row


def listener_stalls(chunks: list[dict]) -> tuple[int, float]:
    """(chunks that came late, ms the listener waited) for one stream's log: playback starts when
    the first chunk arrives and plays each chunk as soon as it has both arrived and the audio
    before it has played out."""
    chunks = sorted(chunks, key=lambda c: c["i"])
    late, waited, play_end = 0, 0.0, None
    for c in chunks:
        seconds = c["samples"] / SAMPLE_RATE
        if play_end is None:
            play_end = c["t_done"] + seconds
        elif c["t_done"] > play_end:
            late, waited = late + 1, waited + (c["t_done"] - play_end) * 1e3
            play_end = c["t_done"] + seconds
        else:
            play_end += seconds
    return late, waited


def solo_check(rt, ins, served) -> dict:
    """Each sampled stream replayed alone with Runtime.step on the same runtime: the worst PCM
    rel-L2 of the served audio against it (cross-stream mixing would show as O(1))."""
    worst = 0.0
    for x, pcm in zip(ins, served):
        st = rt.setup(x[0][None], x[1][None], x[2][None])
        for (tok, last), got in zip(x[3], pcm):
            worst = max(worst, rel_l2(got, rt.step(st, tok[None], last=last)[0].float().cpu()))
    return {"streams": len(ins), "worst_pcm_rel_l2": worst}


def bench_serving(artifact_dir: Path, *, concurrency: list[int], chunk_tokens: int = 28, steady_chunks: int = 8,
                  stagger_ms: float = 20.0, arrival: str = "fixed", max_wait_ms: float = 2.0, voices: int = 0,
                  lanes: int = 1, token_rate: float = 0.0, check_streams: int = 2, reps: int = 10, seed: int = 0,
                  save=lambda res: None, cuda_graphs: bool | None = None, clients: str = "threads",
                  ahead: int = 0) -> dict:
    from c2w import runtime
    from c2w.exporter.bench.engines import _commit
    rt = runtime.load(artifact_dir, cuda_graphs=cuda_graphs)
    P = int(rt.schedule.get("prompt_frames", 300))
    dev = rt.driver._device()
    res = {"artifact_dir": str(artifact_dir), "commit": _commit(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "chunk_tokens": chunk_tokens, "steady_chunks": steady_chunks, "arrival": arrival,
           "stagger_ms": stagger_ms, "max_wait_ms": max_wait_ms, "voices": voices, "lanes": lanes,
           "token_rate": token_rate, "clients": clients, "ahead": ahead, "prompt_frames": P, "levels": []}
    largest = max(concurrency)
    cfg = rt.model.cfg
    steady = (cfg.up_rate * (chunk_tokens - cfg.encoder.pre_lookahead), P + 100)     # the steady CFM (T, L)
    batch_ref = min(largest, max((k.dim("B") for k in rt.cache.keys
                                  if k.component == "cfm" and (k.dim("T"), k.dim("L")) == steady), default=1))
    res["direct_B1"] = direct_reference(rt, 1, P, chunk_tokens, reps)
    if batch_ref > 1:            # with no larger steady engine (or N = 1 alone) the B=1 reference is it
        res[f"direct_B{batch_ref}"] = direct_reference(rt, batch_ref, P, chunk_tokens, reps)
    res["batch_reference"] = batch_ref
    save(res)
    with rt.serve(max_streams=largest, max_prompt_frames=P, max_wait_ms=max_wait_ms, lanes=lanes) as server:
        res["pool_copy_ms"] = {f"B={b}": pool_copy_ms(server.pool, b, reps) for b in sorted({1, batch_ref})}
        save(res)
        for N in concurrency:
            row = run_level(rt, server, N, P=P, chunk_tokens=chunk_tokens, steady_chunks=steady_chunks,
                            stagger_ms=stagger_ms, arrival=arrival, seed=seed, check_streams=min(check_streams, N),
                            voices=voices, token_rate=token_rate, clients=clients, ahead=ahead)
            res["levels"].append(row)
            save(res)
            print(f"  N={N}: ttfa p95 {row['ttfa_ms']['p95']:.1f} ms, steady p95 {row['steady_chunk_ms']['p95']:.1f} ms, "
                  f"{row['audio_s_per_s']:.1f} audio-s/s (steady {row['steady_audio_s_per_s'] or 0:.1f}), "
                  f"hit rate {row['engine_hit_rate']:.2f}, batches {row['batches']}"
                  + (f", solve graphs {row['solve_graphs']}" if row["solve_graphs"] else ""), flush=True)
    rt.release()
    return res


def pool_copy_ms(pool, B: int, reps: int) -> dict:
    """Wall ms of the server's per-batch state traffic at the steady cache lengths: a gather of B
    slots into a batch and the scatter back (median over reps, the device synchronized)."""
    dev = pool.pools["spk"].device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    slots = list(range(min(B, pool.capacity)))
    gather, scatter = [], []
    with torch.inference_mode():
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            state = pool.gather(slots, pool.limits, 0, [None] * len(slots))
            sync()
            t1 = time.perf_counter()
            pool.scatter(slots, state)
            sync()
            gather.append((t1 - t0) * 1e3)
            scatter.append((time.perf_counter() - t1) * 1e3)
    state_bytes = sum(t.numel() * t.element_size() for t in vars(state).values() if isinstance(t, torch.Tensor))
    return {"gather": _pct(gather[1:], 0.5), "scatter": _pct(scatter[1:], 0.5), "state_bytes": state_bytes}


def to_markdown(res: dict) -> str:
    ref1, refb = res["direct_B1"], res.get(f"direct_B{res['batch_reference']}")
    lines = [f"# c2w serving benchmark ({res['device']}, commit {res['commit']}, torch {res['torch']})", "",
             f"{res['chunk_tokens']}-token chunks ({res['steady_chunks']} per stream after a 28-token first chunk, "
             f"then a {TAIL_TOKENS}-token final chunk), prompt {res['prompt_frames']} frames, arrivals "
             f"{res['arrival']} every {res['stagger_ms']} ms, max wait {res['max_wait_ms']} ms, "
             f"{res.get('lanes', 1)} lane(s), "
             + (f"clients paced at {res['token_rate']:g} tokens/s after the first chunk, " if res.get("token_rate")
                else "closed-loop clients, ")
             + ("all in one asyncio event loop, " if res.get("clients") == "asyncio" else "a thread each, ")
             + (f"each keeping {res['ahead']} chunk(s) queued beyond the one it waits for (its latencies include "
                "that wait), " if res.get("ahead") else "")
             + (f"{res['voices']} voices shared by the streams." if res.get("voices") else "a prompt of its own per stream."),
             "",
             f"Direct `Runtime.step`, B=1: first chunk {ref1['first_ms']:.1f} ms, steady p50 "
             f"{ref1['steady_ms']['p50']:.1f} ms."]
    if refb:
        lines.append(f"Direct equal-shape batch B={refb['B']}: steady p50 {refb['steady_ms']['p50']:.1f} ms = "
                     f"{refb['steady_audio_s_per_s']:.0f} audio-s/s.")
    for b, c in res.get("pool_copy_ms", {}).items():
        lines.append(f"Slot pool at {b}, steady cache lengths: gather {c['gather']:.2f} ms + scatter {c['scatter']:.2f} ms "
                     f"for {c['state_bytes'] / 2**20:.0f} MiB of stream state.")
    lines += ["", "| N | TTFA p50/p95/p99 ms | set-up p95 ms | first chunk p95 ms | steady p50/p95 ms "
              "| listener stalls (streams / chunks / ms) | audio-s/s | steady audio-s/s "
              "| RTF | engine hits | voice hits | batches | pool MiB | lost/dup/wrong | solo rel-L2 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for r in res["levels"]:
        t, s = r["ttfa_ms"], r["steady_chunk_ms"]
        lines.append(f"| {r['N']} | {f(t['p50'])}/{f(t['p95'])}/{f(t['p99'])} | {f(r['setup_ms']['p95'])} "
                     f"| {f(r['first_chunk_ms']['p95'])} "
                     f"| {f(s['p50'])}/{f(s['p95'])} "
                     f"| {r.get('stalled_streams', '-')} / {r.get('stalled_chunks', '-')} / {f(r.get('stall_ms'), 0)} "
                     f"| {f(r['audio_s_per_s'])} | {f(r['steady_audio_s_per_s'])} "
                     f"| {f(r['rtf'], 3)} | {r['engine_hit_rate']:.2f} | {r.get('voice_hits', 0)} | "
                     + ", ".join(f"{k}: {v}" for k, v in r["batches"].items())
                     + (f" ({r['overlapped_batches']} overlapped)" if r.get("overlapped_batches") else "")
                     + f" | {r['pool_bytes'] / 2**20:.0f} | {r['lost']}/{r['duplicated']}/{r['wrong_length']} "
                     f"| {r['solo_check']['worst_pcm_rel_l2']:.1e} |")
    lines += ["", *ratios(res)]
    return "\n".join(lines) + "\n"


def ratios(res: dict) -> list[str]:
    """Each level against the direct references of the same run: the server's overhead and
    latency against one stream stepped alone, its steady throughput against perfect batching."""
    ref1, refb = res["direct_B1"], res.get(f"direct_B{res['batch_reference']}")
    out = ["| N | steady p50 / direct B=1 p50 | steady p95 / direct B=1 p50 | first-chunk p95 / direct B=1 first "
           f"| steady audio-s/s / direct B={res['batch_reference']} |", "|---|---|---|---|---|"]
    for r in res["levels"]:
        s, fc = r["steady_chunk_ms"], r["first_chunk_ms"]
        batch = (r["steady_audio_s_per_s"] / refb["steady_audio_s_per_s"]
                 if refb and r["steady_audio_s_per_s"] else None)
        out.append(f"| {r['N']} | {s['p50'] / ref1['steady_ms']['p50']:.2f} | {s['p95'] / ref1['steady_ms']['p50']:.2f} "
                   f"| {fc['p95'] / ref1['first_ms']:.2f} | {'-' if batch is None else f'{batch:.2f}'} |")
    return out
