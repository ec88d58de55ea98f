"""A small streaming Code2Wav server: one StreamServer behind a WebSocket on 127.0.0.1.

    python examples/ws_server.py artifacts/cpu --port 8765

Protocol, one WebSocket connection per stream:
  client -> {"prompt_tokens": [P/2 ids], "prompt_mel": [[80 floats] x P], "spk": [192 floats], "seed": 0}
  client -> {"tokens": [ids], "last": false}   (any number; the last one with "last": true)
  server -> one binary message per chunk, in order: little-endian float32 PCM at 24 kHz
  server -> {"error": "..."} (text) and a close, if the stream's input is refused
Chunks may be sent ahead of their audio: each is queued as it arrives and answered in order.
"""
from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import torch
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from c2w import runtime


def _tensor(values, dtype) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=dtype))


async def handle(server: runtime.StreamServer, ws) -> None:
    handle_ = None
    pending: asyncio.Queue = asyncio.Queue()

    async def send_in_order():
        while (fut := await pending.get()) is not None:
            pcm = await asyncio.wrap_future(fut)
            await ws.send(pcm.numpy().astype("<f4").tobytes())

    sender = asyncio.create_task(send_in_order())
    try:
        opening = json.loads(await ws.recv())
        handle_ = server.open_stream(_tensor(opening["prompt_tokens"], np.int64),
                                     _tensor(opening["prompt_mel"], np.float32),
                                     _tensor(opening["spk"], np.float32), seed=opening.get("seed"))
        async for message in ws:
            chunk = json.loads(message)
            last = bool(chunk.get("last", False))
            pending.put_nowait(server.submit(handle_, _tensor(chunk["tokens"], np.int64), last=last))
            if last:
                break
        pending.put_nowait(None)
        await sender
    except (runtime.C2WUserError, KeyError, ValueError) as e:
        sender.cancel()
        await ws.send(json.dumps({"error": str(e)}))
        await ws.close(code=1008, reason="refused input")
    except ConnectionClosed:
        sender.cancel()                         # the client left: its stream is closed below
    finally:
        if handle_ is not None:
            server.close(handle_)


async def main(artifacts: str, host: str, port: int, max_streams: int) -> None:
    rt = runtime.load(artifacts)
    with rt.serve(max_streams=max_streams) as server:
        async with serve(lambda ws: handle(server, ws), host, port, max_size=2 ** 24) as ws_server:
            bound = ws_server.sockets[0].getsockname()[1]
            print(f"listening on ws://{host}:{bound}", flush=True)
            await asyncio.Future()              # until the process is stopped


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", help="artifact directory written by c2w export")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed on start)")
    ap.add_argument("--max-streams", type=int, default=16)
    args = ap.parse_args()
    asyncio.run(main(args.artifacts, args.host, args.port, args.max_streams))
