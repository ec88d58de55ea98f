"""Serve many independent streams from one runtime: exact-shape dynamic batching.

    server = runtime.load("artifacts/h200").serve(max_streams=64)
    h = server.open_stream(prompt_tokens, prompt_mel, spk)     # (P/2,), (P, 80), (192,)
    pcm = server.submit(h, tokens).result()                   # (samples,) float32 on the CPU
    pcm = await server.submit_async(h, tail, last=True)       # from asyncio
    server.close(h); server.shutdown()

Streams start, advance and end independently. Worker threads ("chunk lanes", `lanes` of them)
own the chunks: each groups the ready chunks whose three unit keys are equal (they follow from a
stream's prompt length, cache lengths, chunk length and last flag), runs a group as one batch
through the same driver as `Runtime.step` (extra lanes over engine instances of their own), and
resolves each stream's future with its own PCM. New streams' prompts are set up in batches too,
on the set-up keys' engines in a chunk lane, or eagerly in a lane of their own so that a new
stream never holds up the others; a prompt set up before (a voice) is copied, not set up again.
Stream state lives in a preallocated `SlotPool` (runtime/slots.py) between chunks.

Policies: groups are taken earliest deadline first. A stream's deadline is when its listener
runs out of audio: for its set-up and first chunk, the moment the stream was opened (nothing plays
yet, and time to first audio counts from there: a stream's first chunk goes before the set-up of a
stream opened after it, so that arrivals faster than the GPU sets them up do not hold every first
chunk back until the last set-up); for a later chunk, the moment its first audio was delivered
plus the seconds of audio delivered since (playback assumed to start on delivery). A stream far
ahead of its listener thus lets a new stream's first chunk pass, and none starves: a deadline is
fixed once set, and every later request gets a later one. A group runs at once when it
fills the largest batch the artifact directory has an engine for; a partial group waits only for
streams that could join it: idle streams at the same position whose last result came within a
merge window (in lockstep serving they are about to submit again; the window is `max_wait_ms` or
a quarter of the call about to run, whichever is longer), or any idle stream at the same position
while its oldest chunk is younger than `max_wait_ms`. A lone stream never waits. A group also
waits, at most `max_wait_ms`, for a stream with an earlier deadline that has just been served
and has not asked again yet (a client about to submit: a new stream's first chunk right after
its set-up, above all), rather than start a call that stream would queue behind. A
group is cut into engine calls by `plan_batches` (pad to a built batch size with inert rows, or
split). A stream's output does not depend on its batch beyond rounding: rows are independent,
and each stream draws its HiFT noise from its own generator. A batch that raises is retried
stream by stream, so only the faulty stream fails.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import math
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from c2w.runtime.errors import C2WUserError
from c2w.runtime.slots import ServerFullError, SlotPool
from c2w.runtime.stream import as_tensor, check_features, check_tokens
from c2w.runtime.units import EagerRunner

DEFAULT_MAX_WAIT_MS = 2.0
# Streams that just got their chunk back are about to submit the next one at the same position.
# A partial group waits for them up to this fraction of the call it is about to make (at least
# max_wait): a row that joins saves a whole later call, and a cohort that merged stays merged.
MERGE_FRACTION = 0.25


def engine_cost(batch: int) -> float:
    """Relative cost of one engine call at `batch` (a B=1 call ~ 1): GPU solves are nearly flat in
    B at small batches (H200, CFM T=50: 14.8 / 25.1 / 50.5 ms at B = 1 / 8 / 32)."""
    return 1.0 + batch / 16


def eager_cost(batch: int) -> float:
    """Relative cost of an eager call at `batch`: host-bound, so nearly flat in B (H200: ~10x a
    B=1 engine call at B=1 and ~11x at B=32)."""
    return 10.0 + batch / 8


def plan_batches(n: int, built: list[int], *, engine=engine_cost, eager=eager_cost,
                 max_eager: int | None = None) -> list[tuple[int, int]]:
    """Cheapest way to serve n rows: a list of (batch size run, rows served). An engine call at a
    built size s serves up to s rows (the rest are padding); an eager call serves exactly its
    batch, at most `max_eager` rows (0: no eager calls; `built` must then be non-empty). Minimum total cost by dynamic programming over n."""
    max_eager = n if max_eager is None else max_eager
    best = [0.0] + [math.inf] * n
    choice: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for m in range(1, n + 1):
        for s in built:
            rows = min(s, m)
            c = engine(s) + best[m - rows]
            if c < best[m]:
                best[m], choice[m] = c, (s, rows)
        for rows in range(1, min(m, max_eager) + 1):
            c = eager(rows) + best[m - rows]
            if c < best[m]:
                best[m], choice[m] = c, (-rows, rows)       # negative: eager
    plan, m = [], n
    while m:
        s, rows = choice[m]
        plan.append((abs(s), rows))
        m -= rows
    return plan


@dataclass(eq=False)
class _Request:
    kind: str                              # "setup" | "chunk"
    future: Future
    tokens: torch.Tensor | None = None     # (N,) chunk or (P/2,) prompt tokens, int64, CPU
    last: bool = False
    prompt_mel: torch.Tensor | None = None
    spk: torch.Tensor | None = None
    voice: bytes = b""                     # digest of the prompt (set-up requests)
    t_submit: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Resident:
    """A batch's state left where its last call put it (the driver's output tensors), so that the
    same streams running together again skip the gather and scatter. Row i belongs to rows[i]: a
    stream, or None (a padding row, or a stream that has left)."""
    state: object                          # runtime.stream.StreamState
    rows: list


@dataclass(eq=False)
class _Stream:
    id: int
    slot: int
    prompt_frames: int
    generator: torch.Generator
    queue: deque = field(default_factory=deque)
    lengths: dict = field(default_factory=dict)  # growing cache sizes (runtime.slots.LENGTH_FIELDS)
    ready: bool = False                          # prompt set up
    busy: bool = False                           # in the batch being run
    last_submitted: bool = False
    finished: bool = False
    closed: bool = False
    error: BaseException | None = None
    idle_since: float = 0.0                      # when its last result was delivered
    opened: float = field(default_factory=time.monotonic)   # when open_stream was called
    playback_start: float | None = None          # when its first audio was delivered
    audio_s: float = 0.0                         # seconds of audio delivered
    resident: _Resident | None = None            # its state is a row there, not in its slot
    released: Future = field(default_factory=Future)    # resolves when the slot is free again

    def state_signature(self) -> tuple:
        return (self.prompt_frames,) + tuple(sorted(self.lengths.items()))

    def idle(self) -> bool:
        """Set up, between chunks, and able to ask for another (read under the server's lock)."""
        return (self.ready and not self.busy and not self.queue and not self.last_submitted and not self.closed
                and self.error is None)

    def deadline(self) -> float:
        """When the listener of this stream runs out of audio, if its next request waits (the
        module docstring): before its first audio, the moment the stream was opened."""
        if self.playback_start is None:
            return self.opened
        return self.playback_start + self.audio_s


@dataclass(frozen=True)
class StreamHandle:
    """What `open_stream` returns; pass it to submit/close. `ready` resolves when the prompt is set up."""
    id: int
    ready: Future = field(compare=False, repr=False)
    _stream: _Stream = field(compare=False, repr=False, default=None)


class StreamServer:
    """Dynamic batching of independent streams over one Runtime (see the module docstring).

    max_streams: open streams at most; their slots are preallocated on the device and
    `open_stream` beyond them raises ServerFullError. max_prompt_frames: the longest prompt (mel
    frames) a stream may have; the pools hold caches of that plus the 100 frames kept after
    trimming. max_wait_ms: how long a partial batch may wait for streams that could join it (see
    the module docstring). max_batch: the largest batch for groups with no engine (default: the
    largest batch size the artifact directory has engines for, or 8). voice_cache: prompts
    (voices) whose set-up state is kept in slots of its own, least recently used first out: a
    stream opened with a known prompt copies that state instead of being set up (0: off). seed:
    each stream's HiFT noise seed unless `open_stream` names one (the same default as
    `Runtime.step`'s). lanes: batches that may run at the same time, each in a worker thread of
    its own with engine instances of its own (`EngineCache.replica`) and, on CUDA, a stream of
    its own, so that a new stream's small first chunk need not queue behind a large steady batch.
    Each extra lane holds another copy of the engines' CUDA-graph buffers.
    """

    def __init__(self, runtime, *, max_streams: int = 64, max_prompt_frames: int | None = None,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, max_batch: int | None = None, voice_cache: int = 8,
                 seed: int = 0, lanes: int = 1):
        driver = runtime.driver
        if not driver.trim_conformer:
            raise C2WUserError("stream server", "a runtime that does not trim the conformer cache",
                               "trim_conformer=True", "Its cache would grow without bound; load with trim_conformer=True.")
        if max_streams < 1 or voice_cache < 0 or lanes < 1:
            raise C2WUserError("stream server",
                               f"max_streams={max_streams}, voice_cache={voice_cache}, lanes={lanes}",
                               "max_streams >= 1, voice_cache >= 0 and lanes >= 1")
        self.runtime, self.driver, self.cache = runtime, driver, runtime.cache
        cfg = driver.cfg
        self.max_prompt_frames = int(max_prompt_frames or runtime.schedule.get("prompt_frames", 300))
        self.max_streams, self.voice_cache = max_streams, voice_cache
        self.max_wait = max_wait_ms / 1000.0
        built = [k.dim("B") for k in self.cache.keys]
        self.max_batch = max_batch or max(built, default=8)
        self.seed = seed
        self.device = driver._device()
        with torch.inference_mode():         # the pools' shapes and dtypes, from an eager toy set-up
            n = cfg.encoder.pre_lookahead + 1
            shaper = dataclasses.replace(driver, runner=EagerRunner(driver.model), _window={})
            template = shaper.setup(torch.zeros(1, n, dtype=torch.int64), torch.zeros(1, n * cfg.up_rate, cfg.mel_bins),
                                    torch.zeros(1, cfg.spk_embed_dim))
            self.pool = SlotPool(template, max_streams + voice_cache, self.max_prompt_frames, cfg.hift_mel_cache,
                                 cfg.hift_source_cache)
        self._streams: dict[int, _Stream] = {}
        self._voices: OrderedDict[bytes, tuple[int, dict]] = OrderedDict()   # digest -> (slot, lengths)
        self._ids = itertools.count()
        # One lock; each kind of lane waits on a condition of its own, so that a chunk submitted
        # wakes the chunk lanes only (a needless wake-up costs the one that matters ~0.1 ms).
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._wakeups = {"chunk": self._cv, "setup": threading.Condition(lock)}
        self._stopping = False
        self._counts = Counter()
        self._calls = Counter()            # (kind, batch size) -> calls
        self._built: dict[tuple, list[int]] = {}   # CFM (T, L) -> batch sizes with an engine
        self._seconds: dict[tuple, float] = {}     # (group signature, batch size) -> last call's wall time
        self._residents: list[_Resident] = []
        self._running = 0                  # batches running now, in all lanes
        # Worker threads: `lanes` chunk lanes (engine set-ups too), each with a driver over engines
        # of its own, and one lane for eager set-ups, so that their host-bound Python never holds
        # up the chunks of the streams already playing.
        drivers = [driver] + [dataclasses.replace(driver, runner=self.cache.replica(), _window={})
                              for _ in range(lanes - 1)]
        self._replicas = [d.runner for d in drivers[1:]]
        self._settle()                     # the pools' zero fill, before the lanes' streams write them
        self._workers = [threading.Thread(target=self._loop, args=("chunk", d), name=f"c2w-serve-chunk{i}", daemon=True)
                         for i, d in enumerate(drivers)]
        self._workers.append(threading.Thread(target=self._loop, args=("setup", driver), name="c2w-serve-setup",
                                              daemon=True))
        for w in self._workers:
            w.start()

    # ------------------------------------------------------------------ client API (any thread)
    def open_stream(self, prompt_tokens, prompt_mel, spk, *, seed: int | None = None) -> StreamHandle:
        """prompt_tokens: (P/2,) or (1, P/2) ids; prompt_mel: (P, 80) or (1, P, 80); spk: (192,)
        or (1, 192). A prompt the voice cache holds is copied into the stream's slot at once
        (`ready` is already resolved); any other is set up by the worker (batched with other new
        streams). Chunks may be submitted at once and run after it. Raises C2WUserError on bad
        input and ServerFullError when max_streams streams are open."""
        cfg = self.driver.cfg
        tokens = check_tokens(cfg, "prompt_tokens", _row("prompt_tokens", prompt_tokens), 1, 1)
        P = tokens.shape[1] * cfg.up_rate
        if P > self.max_prompt_frames:
            raise C2WUserError("prompt", f"{P} mel frames", f"at most max_prompt_frames={self.max_prompt_frames}",
                               "Start the server with a larger max_prompt_frames.")
        mel = check_features("prompt_mel", _row("prompt_mel", prompt_mel), (1, P, cfg.mel_bins)).float()
        spk = check_features("spk", _row("spk", spk), (1, cfg.spk_embed_dim)).float()
        tokens = tokens[0].to(torch.int64)
        voice = voice_digest(tokens, mel, spk)
        fut: Future = Future()
        with self._cv:
            self._check_running()
            if len(self._streams) >= self.max_streams:
                raise ServerFullError("stream server", f"{len(self._streams)} open streams",
                                      f"at most max_streams={self.max_streams}",
                                      "Close finished streams, retry later, or start the server with more max_streams.")
            gen = torch.Generator(device=self.device).manual_seed(self.seed if seed is None else seed)
            s = _Stream(next(self._ids), self.pool.acquire(), P, gen)
            self._streams[s.id] = s
            handle = StreamHandle(s.id, fut, s)
            if voice in self._voices:
                self._voices.move_to_end(voice)
                src, s.lengths = self._voices[voice]
                self.pool.copy(src, s.slot)
                self._settle()
                s.ready, s.idle_since = True, time.monotonic()     # its first chunk is about to come
                self._counts["voice_hits"] += 1
            else:
                s.queue.append(_Request("setup", fut, tokens, prompt_mel=mel, spk=spk, voice=voice))
            self._wake(self._lane(s, s.queue[0]) if s.queue else "chunk")
        if s.ready:
            fut.set_result(handle)
        return handle

    def submit(self, handle: StreamHandle, tokens, last: bool = False) -> Future:
        """A future of this chunk's PCM: (samples,) float32 on the CPU. tokens: (N,) or (1, N) ids;
        a non-final chunk ends with the 3 lookahead tokens. Bad input fails this future only."""
        return self.submit_many([(handle, tokens, last)])[0]

    def submit_many(self, chunks) -> list[Future]:
        """Submit [(handle, tokens, last), ...] at once (e.g. one LLM decoding step for many
        streams): they are queued together, so they can share a batch."""
        futures, requests = [], []
        for handle, tokens, last in chunks:
            fut: Future = Future()
            futures.append(fut)
            try:
                la = self.driver.cfg.encoder.pre_lookahead
                tok = check_tokens(self.driver.cfg, "tokens", _row("tokens", tokens), 1, 1 if last else la + 1)
                requests.append((handle, _Request("chunk", fut, tok[0].to(torch.int64), bool(last))))
            except C2WUserError as e:
                fut.set_exception(e)
        with self._cv:
            for handle, req in requests:
                s = handle._stream
                why = self._refuse(s)
                if why:
                    req.future.set_exception(why)
                    continue
                s.last_submitted = req.last
                s.queue.append(req)
            self._wake("chunk")
        return futures

    async def submit_async(self, handle: StreamHandle, tokens, last: bool = False) -> torch.Tensor:
        return await asyncio.wrap_future(self.submit(handle, tokens, last))

    def close(self, handle: StreamHandle) -> Future:
        """End a stream now: its queued chunks are cancelled and its slot is freed (after the batch
        it is in, if any). Returns a future that resolves once the slot is free. Closing a
        finished or closed stream does nothing."""
        with self._cv:
            s = self._streams.get(handle.id)
            if s is None:
                done: Future = Future()
                done.set_result(None)
                return done
            s.closed = True
            while s.queue:
                s.queue.popleft().future.cancel()
            if not s.busy:
                self._retire(s)
            self._wake()
        return s.released

    def stats(self) -> dict:
        """Counters since start, the slot pool, the engine cache's hits/misses per key, and the
        counts of its whole-solve graphs (EngineCache.solve_graphs, every lane's summed)."""
        with self._cv:
            return {"open_streams": len(self._streams), "max_streams": self.max_streams,
                    "lanes": len(self._workers) - 1, "voices": len(self._voices), "pool_bytes": self.pool.nbytes, **dict(self._counts),
                    "calls": {f"{kind} B={b}": n for (kind, b), n in sorted(self._calls.items())},
                    "units": self.cache.stats(), "solve_graphs": self._solve_graphs()}

    def _solve_graphs(self) -> dict:
        """EngineCache.solve_graphs of every lane's engines, summed per key."""
        out: dict = {}
        for cache in [self.cache, *self._replicas]:
            for kid, counts in cache.solve_graphs().items():
                total = out.setdefault(kid, dict.fromkeys(counts, 0))
                for name, n in counts.items():
                    total[name] += n
        return out

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; queued chunks are cancelled. The runtime stays usable."""
        with self._cv:
            self._stopping = True
            for s in self._streams.values():
                while s.queue:
                    s.queue.popleft().future.cancel()
            self._wake()
        if wait:
            for w in self._workers:
                w.join()
            for r in self._replicas:
                r.release()
            self._replicas = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ bookkeeping (under the lock)
    def _settle(self) -> None:
        """Wait until this thread's device work is done. Slots and resident batches are written
        on the writing lane's CUDA stream; another lane (another stream) may read them as soon as
        the lock is released, so every write is complete before that (a batch of chunks already
        waits for its PCM on the host)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _wake(self, lane: str | None = None) -> None:
        """Wake the workers of `lane` ("chunk" or "setup"; None: all of them), under the lock."""
        for name, cv in self._wakeups.items():
            if lane in (None, name):
                cv.notify_all()

    def _check_running(self) -> None:
        if self._stopping:
            raise C2WUserError("stream server", "a call after shutdown()", "a running server")

    def _refuse(self, s: _Stream) -> C2WUserError | None:
        if self._stopping:
            return C2WUserError("stream server", "a chunk after shutdown()", "a running server")
        if s.error is not None:
            return C2WUserError(f"stream {s.id}", f"a chunk after the stream failed ({s.error})",
                                "a healthy stream", "Close it and open a new one.")
        if s.closed:
            return C2WUserError(f"stream {s.id}", "a chunk for a closed stream", "an open stream",
                                "Open a new stream for a new utterance.")
        if s.last_submitted or self._streams.get(s.id) is not s:
            return C2WUserError(f"stream {s.id}", "a chunk after the chunk marked last=True",
                                "no more chunks", "Open a new stream for a new utterance.")
        return None

    def _retire(self, s: _Stream) -> None:
        self._leave(s)
        if self._streams.pop(s.id, None) is not None:
            self.pool.release(s.slot)
            s.released.set_result(None)

    def _leave(self, s: _Stream, flush: bool = False) -> None:
        """Take `s` out of the resident batch it is in (under the lock); flush: first write its
        row back into its slot."""
        R = s.resident
        if R is None:
            return
        i = R.rows.index(s)
        if flush:
            self.pool.scatter([s.slot], R.state, rows=[i])
            self._settle()
            self._counts["flushed_rows"] += 1
        R.rows[i], s.resident = None, None
        if not any(R.rows):
            self._residents.remove(R)

    def _lane(self, s: _Stream, r: _Request) -> str:
        """Chunks and set-ups with an engine share the chunk lane (the GPU is one queue anyway);
        eager set-ups get the set-up lane, so their host-bound Python never holds up a chunk."""
        return "chunk" if r.kind == "chunk" or self._built_sizes(s, r) else "setup"

    def _signature(self, s: _Stream, r: _Request) -> tuple:
        if r.kind == "setup":
            return ("setup", r.tokens.shape[0])
        return ("chunk", r.tokens.shape[0], r.last) + s.state_signature()

    def _built_sizes(self, s: _Stream, r: _Request) -> list[int]:
        """Batch sizes with a CFM engine for this request's exact (T, L): a chunk's, or for a
        set-up the prompt's (T=P, L=0)."""
        cfg = self.driver.cfg
        if r.kind == "setup":
            T, L = s.prompt_frames, 0
        else:
            T = cfg.up_rate * (r.tokens.shape[0] - (0 if r.last else cfg.encoder.pre_lookahead))
            L = s.lengths["estimator_att"]
        if (T, L) not in self._built:          # the directory's keys do not change while serving
            self._built[(T, L)] = sorted({k.dim("B") for k in self.cache.keys
                                          if k.component == "cfm" and (k.dim("T"), k.dim("L")) == (T, L)})
        return self._built[(T, L)]

    def _wait_for_company(self, sig: tuple, rows: list, target: int, now: float) -> float:
        """Seconds worth waiting before running a partial group: for the idle streams at the same
        position that got their last result recently (they are about to submit again) until the
        merge window is past (max_wait, or MERGE_FRACTION of the last call of this group at
        `target`, whichever is longer), and, while the group's oldest chunk is younger than
        max_wait, for any idle stream at the same position. 0: run now."""
        members = {id(s) for s, _ in rows}
        state = sig[3:]
        idle = [s for s in self._streams.values()
                if id(s) not in members and s.idle() and s.state_signature() == state]
        if not idle:
            return 0.0
        window = max(self.max_wait, MERGE_FRACTION * self._seconds.get((sig, target), 0.0))
        fresh = max(s.idle_since for s in idle) + window
        young = rows[0][1].t_submit + self.max_wait
        return max(fresh, young) - now

    def _next_batch(self, lane: str, now: float):
        """(rows, built sizes) of the `lane` group to run now, or (None, seconds to wait)."""
        groups: dict[tuple, list] = {}
        for s in list(self._streams.values()):
            while s.queue and s.queue[0].future.cancelled():
                if s.queue.popleft().kind == "setup":          # a stream never set up cannot go on
                    s.closed = True
            if s.closed and not s.busy:
                self._retire(s)
                continue
            if s.busy or not s.queue or s.error is not None or self._lane(s, s.queue[0]) != lane:
                continue
            r = s.queue[0]
            groups.setdefault(self._signature(s, r), []).append((s, r))
        # Streams that got a result less than max_wait ago and have not asked again yet: a client
        # about to submit its next chunk (a new stream's first chunk right after its set-up, above
        # all). A chunk-lane group with a later deadline waits for them rather than start a call
        # they would queue behind.
        about_to_ask = ([s for s in self._streams.values() if s.idle() and now - s.idle_since < self.max_wait]
                        if lane == "chunk" else [])
        timeout = None
        urgency = {sig: min((s.deadline(), r.t_submit) for s, r in rows) for sig, rows in groups.items()}
        for sig, rows in sorted(groups.items(), key=lambda kv: urgency[kv[0]]):
            rows.sort(key=lambda sr: sr[1].t_submit)
            due = urgency[sig][0]
            sooner = [s.idle_since + self.max_wait - now for s in about_to_ask if s.deadline() < due]
            if sooner:
                return None, min(sooner) if timeout is None else min(timeout, *sooner)
            built = self._built_sizes(*rows[0])
            if rows[0][1].kind == "setup":     # set-ups never wait: a new stream's first audio does
                return rows[:max(built, default=self.max_batch)], built
            target = max(built, default=self.max_batch)
            wait = 0.0 if len(rows) >= target else self._wait_for_company(sig, rows, target, now)
            if wait <= 0:
                return rows[:target], built
            timeout = wait if timeout is None else min(timeout, wait)
        return None, timeout

    # ------------------------------------------------------------------ the worker
    def _loop(self, lane: str, driver) -> None:
        try:
            with _own_stream(self.device):
                self._serve(lane, driver)
        except BaseException as exc:      # a bug here must fail the waiting callers, not hang them
            with self._cv:
                self._stopping = True
                for s in self._streams.values():
                    while s.queue:
                        f = s.queue.popleft().future
                        if f.set_running_or_notify_cancel():
                            f.set_exception(RuntimeError(f"c2w stream server stopped: {exc!r}"))
                self._wake()
            raise

    def _serve(self, lane: str, driver) -> None:
        while True:
            with self._cv:
                rows = None
                while rows is None:
                    if self._stopping:
                        return
                    rows, built_or_wait = self._next_batch(lane, time.monotonic())
                    if rows is None:
                        self._wakeups[lane].wait(built_or_wait)
                built, taken = built_or_wait, []
                for s, r in rows:
                    s.queue.popleft()
                    if r.future.set_running_or_notify_cancel():
                        s.busy = True
                        taken.append((s, r))
                    elif r.kind == "setup":
                        s.closed = True
                self._counts["overlapped_batches"] += self._running > 0
                self._running += 1
            outcomes: list[tuple[Future, object]] = []
            try:
                with torch.inference_mode():
                    setup = bool(taken) and taken[0][1].kind == "setup"
                    work = self._setup if setup else self._chunk
                    # an eager set-up costs ~50 engine set-ups (H200: ~270 ms against 5.6 ms)
                    eager_rows = 0 if setup and built else self.max_batch
                    for size, n in plan_batches(len(taken), built, max_eager=eager_rows):
                        part, taken = taken[:n], taken[n:]
                        self._guarded(part, lambda p, size=size: work(driver, p, size, size in built), outcomes)
            finally:
                with self._cv:                 # slots are free before any caller sees its result
                    self._running -= 1
                    now = time.monotonic()
                    for s, _ in rows:
                        s.busy, s.idle_since = False, now
                        if s.closed or s.finished or s.error is not None:
                            self._retire(s)
                    self._wake("chunk")        # idle streams and ready ones: groups may form
                for fut, value in outcomes:
                    if isinstance(value, BaseException):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)

    def _guarded(self, part: list, run, outcomes: list) -> None:
        """Run a batch; if it raises, run its streams one by one so that only a faulty one fails.
        Appends (future, result or exception) to `outcomes`."""
        gen_states = [s.generator.get_state() for s, _ in part]
        try:
            outcomes.extend(run(part))
            return
        except Exception as exc:                      # noqa: BLE001 - isolated per stream below
            for (s, _), st in zip(part, gen_states):
                s.generator.set_state(st)
            if len(part) == 1:
                return self._fail(part[0], exc, outcomes)
        with self._cv:
            self._counts["retried_batches"] += 1
        for row in part:
            self._guarded([row], run, outcomes)

    def _fail(self, row, exc: BaseException, outcomes: list) -> None:
        s, r = row
        with self._cv:
            self._counts["failed_chunks"] += 1
            s.error = exc
            outcomes.append((r.future, exc))
            later = C2WUserError(f"stream {s.id}", f"a chunk queued after the stream failed ({exc})",
                                 "a healthy stream", "Close it and open a new one.")
            outcomes.extend((q.future, later) for q in s.queue)
            s.queue.clear()

    def _setup(self, driver, part: list, size: int, engine: bool) -> list:
        """Set up the prompts of `part` as one batch of `size` rows (padding repeats the first
        row), each distinct prompt once; streams with the same prompt get a copy, and the voice
        cache keeps one."""
        firsts: dict[bytes, tuple] = {}
        for s, r in part:
            firsts.setdefault(r.voice, (s, r))
        rows = list(firsts.values())
        size = size if engine else len(rows)
        pad = [rows[0][1]] * (size - len(rows))
        reqs = [r for _, r in rows] + pad
        state = driver.setup(torch.stack([r.tokens for r in reqs]), torch.cat([r.prompt_mel for r in reqs]),
                                  torch.cat([r.spk for r in reqs]))
        lengths = self.pool.scatter([s.slot for s, _ in rows], state)
        self._settle()                        # the set-up itself, before taking the lock
        with self._cv:
            self._calls[("setup" if engine else "setup eager", size)] += 1
            for s, r in part:
                src = firsts[r.voice][0]
                if src is not s:
                    self.pool.copy(src.slot, s.slot)
                s.lengths, s.ready = lengths, True
            for voice, (s, _) in firsts.items():
                self._keep_voice(voice, s.slot, lengths)
            self._settle()
        return [(r.future, StreamHandle(s.id, r.future, s)) for s, r in part]

    def _keep_voice(self, voice: bytes, slot: int, lengths: dict) -> None:
        """Copy a freshly set-up prompt's state into the voice cache (under the lock)."""
        if not self.voice_cache or voice in self._voices:
            return
        if len(self._voices) >= self.voice_cache:
            _, (dst, _) = self._voices.popitem(last=False)      # least recently used
        else:
            dst = self.pool.acquire()
        self.pool.copy(slot, dst)
        self._voices[voice] = (dst, lengths)

    def _chunk(self, driver, part: list, size: int, engine: bool) -> list:
        """Run `part` (equal signatures) as one batch of `size` rows. If the streams all sit in
        one resident batch of that size, run it in place (streams of it not in `part` are written
        back to their slots first and their rows become padding); otherwise write any resident
        rows of `part` back, gather the slots, and pad with copies of the first row. Padding
        results are dropped (their noise comes from throwaway generators). The batch's output
        state stays resident for the next call."""
        n, (s0, r0) = len(part), part[0]
        t0 = time.monotonic()
        sig = self._signature(s0, r0)
        with self._cv:                        # flushes write slots that close() may free: locked
            R = s0.resident
            in_place = R is not None and len(R.rows) == size and all(s.resident is R for s, _ in part)
            members = {id(s) for s, _ in part}
            for s in ([o for o in R.rows if o is not None and id(o) not in members] if in_place
                      else [s for s, _ in part]):
                self._leave(s, flush=True)
            row_of = [R.rows.index(s) for s, _ in part] if in_place else list(range(n))
        gens, tokens = [None] * size, [r0.tokens] * size
        for (s, r), i in zip(part, row_of):
            gens[i], tokens[i] = s.generator, r.tokens
        gens = [torch.Generator(device=self.device) if g is None else g for g in gens]   # padding: throwaway noise
        tokens = torch.stack(tokens)
        if in_place:      # a shallow copy: the step replaces the state's tensors, never writes into them
            state = dataclasses.replace(R.state, generators=gens)
        else:
            slots = [s.slot for s, _ in part] + [s0.slot] * (size - n)
            state = self.pool.gather(slots, s0.lengths, s0.prompt_frames, gens)
        pcm = driver.step(state, tokens, last=r0.last)
        lengths = self.pool.lengths(state)
        pcm = pcm[row_of].float().cpu()
        with self._cv:
            if in_place:
                R.state = state
                self._residents.remove(R)             # most recently used last
                self._residents.append(R)
            else:
                R = _Resident(state, [s for s, _ in part] + [None] * (size - n))
                self._residents.append(R)
                for s, _ in part:
                    s.resident = R
            done, seconds = time.monotonic(), pcm.shape[1] / self.driver.cfg.hift.sampling_rate
            for s, r in part:
                s.lengths, s.finished = lengths, r.last
                if s.playback_start is None:
                    s.playback_start = done
                s.audio_s += seconds
                if r.last:
                    self._leave(s)
            self._trim_residents()
            self._seconds[(sig, size)] = done - t0
            self._calls[("engine" if engine else "eager", size)] += 1
            self._counts["chunks"] += n
            self._counts["padded_rows"] += size - n
            self._counts["in_place_calls"] += in_place
        return [(r.future, pcm[i]) for i, (_, r) in enumerate(part)]

    def _trim_residents(self) -> None:
        """Resident batches hold device memory beside the slots: at most max_streams + max_batch
        rows in all; the oldest are written back to their slots first (under the lock). A batch
        running in another lane is left alone: its rows are about to change."""
        rows = sum(len(R.rows) for R in self._residents)
        for R in [R for R in self._residents if not any(s is not None and s.busy for s in R.rows)]:
            if rows <= self.max_streams + self.max_batch:
                break
            rows -= len(R.rows)
            for s in [o for o in R.rows if o is not None]:
                self._leave(s, flush=True)


def _own_stream(device: torch.device):
    """A CUDA stream for the calling worker thread (a context); nothing on the CPU."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()


def voice_digest(tokens: torch.Tensor, mel: torch.Tensor, spk: torch.Tensor) -> bytes:
    """A prompt's identity for the voice cache: the bytes of its tokens, mel and speaker embedding."""
    h = hashlib.blake2b(digest_size=16)
    for t in (tokens, mel, spk):
        t = t.contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.digest()


def _row(name: str, x) -> torch.Tensor:
    """One stream's tensor, given with or without its leading batch axis of 1."""
    t = as_tensor(name, x)
    return t if t.dim() >= 2 and t.shape[0] == 1 else t.unsqueeze(0)
