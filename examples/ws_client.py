"""Client of examples/ws_server.py: runs streams concurrently and reports time to first audio.

    python examples/ws_client.py ws://127.0.0.1:8765 --streams 4
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
from websockets.asyncio.client import connect


async def run_session(url: str, prompt_tokens, prompt_mel, spk, chunks, seed: int = 0) -> list[np.ndarray]:
    """chunks: [(token ids, last)]; all are sent at once, the audio comes back chunk by chunk.
    Returns one float32 PCM array per chunk."""
    async with connect(url, max_size=2 ** 24) as ws:
        await ws.send(json.dumps({"prompt_tokens": list(map(int, prompt_tokens)),
                                  "prompt_mel": np.asarray(prompt_mel, np.float32).tolist(),
                                  "spk": np.asarray(spk, np.float32).tolist(), "seed": seed}))
        for tokens, last in chunks:
            await ws.send(json.dumps({"tokens": list(map(int, tokens)), "last": bool(last)}))
        out = []
        for _ in chunks:
            message = await ws.recv()
            if isinstance(message, str):
                raise RuntimeError(json.loads(message).get("error", message))
            out.append(np.frombuffer(message, dtype="<f4"))
        return out


def random_session(seed: int, prompt_frames: int = 100, n_chunks: int = 2, vocab: int = 6561):
    rng = np.random.default_rng(seed)
    chunks = [(rng.integers(0, vocab, 28), False) for _ in range(n_chunks)] + [(rng.integers(0, vocab, 13), True)]
    return (rng.integers(0, vocab, prompt_frames // 2), rng.standard_normal((prompt_frames, 80)),
            rng.standard_normal(192), chunks)


async def main(url: str, streams: int, prompt_frames: int) -> None:
    async def one(i):
        t0 = time.perf_counter()
        pcm = await run_session(url, *random_session(i, prompt_frames))
        return i, time.perf_counter() - t0, sum(len(p) for p in pcm)
    for i, seconds, samples in await asyncio.gather(*(one(i) for i in range(streams))):
        print(f"stream {i}: {samples / 24000:.2f} s of audio in {seconds:.2f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-frames", type=int, default=100)
    args = ap.parse_args()
    asyncio.run(main(args.url, args.streams, args.prompt_frames))
