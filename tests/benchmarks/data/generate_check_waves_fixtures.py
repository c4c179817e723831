# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Regenerate the `vllm bench serve` result files used by test_check_waves.py.

The fixtures must be in the exact format the real client writes, so this
script runs the installed `vllm bench serve` (vllm 0.33.0) against a tiny
OpenAI-compatible completions server started here on 127.0.0.1. No model, GPU
or network is needed: the tokenizer is a 53-word word-level tokenizer built
on the fly, and the server streams one letter per token, 16 tokens per SSE
event (as vLLM does with `--stream-interval 16`), then a usage chunk.

To mimic the HiSparse + MNNVL all-reduce crash, the server can treat a request
(picked by the index at the end of its `x-request-id`) in one of these ways:

* `cut`: after N tokens send the error event vLLM sends when the engine dies
  (`{"error": {..., "code": 500}}`), then `data: [DONE]`, and no usage chunk.
  The client counts this request as *successful*; this is the bug's disguise.
* `http500`: answer HTTP 500 at once, as a server with a dead engine does.
* `drop`: after N tokens close the connection mid-stream, as when the server
  process dies.

Files written next to this script, each one wave of `vllm bench serve
--save-result --save-detailed --ignore-eos` with 1024 output tokens asked:

* `wave_clean.json`: every request complete.
* `wave_short.json`: request 2 cut after 37 tokens.
* `wave_failed.json`: request 1 cut at 37 tokens, request 2 HTTP 500,
  request 3 dropped at 37 tokens.
* `wave_not_detailed.json`: a clean wave saved without `--save-detailed`.

Run from anywhere with the Python that has vllm installed (about a minute)::

    python tests/benchmarks/data/generate_check_waves_fixtures.py
"""

import asyncio
import itertools
import json
import shutil
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

DATA_DIR = Path(__file__).resolve().parent
REPO_ROOT = DATA_DIR.parents[2]
MODEL = "tiny-fake"
TOKENIZER = "tiny-tokenizer"
TOKENS_PER_EVENT = 16
OUTPUT_LEN = 1024
CUT_AT = 37
BENCH_ARGS = [
    "--model",
    MODEL,
    "--tokenizer",
    TOKENIZER,
    "--dataset-name",
    "random",
    "--random-input-len",
    "16",
    "--random-output-len",
    str(OUTPUT_LEN),
    "--num-prompts",
    "4",
    "--max-concurrency",
    "4",
    "--temperature",
    "0",
    "--seed",
    "0",
    "--disable-tqdm",
]
ENGINE_DEAD_EVENT = {
    "error": {
        "message": "The server had an error while processing your request.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}

# Request index -> (action, tokens before it); the server's one mutable state.
PLAN_KEY = web.AppKey[dict[int, tuple[str, int]]]("plan")


def build_tokenizer(path: Path) -> None:
    """A word-level tokenizer over a-z, A-Z: re-encoding output is exact."""
    vocab = {"[UNK]": 0}
    for letter in string.ascii_letters:
        vocab[letter] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", model_max_length=4096
    )
    tokenizer.save_pretrained(str(path))


def _event(payload: dict[str, Any]) -> bytes:
    """One server-sent event, framed like vLLM's completion stream."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def _chunk(request_id: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A streamed completion chunk with the fields vLLM fills in."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
    }


async def completions(request: web.Request) -> web.StreamResponse:
    """Stream `max_tokens` letters, or misbehave as the plan says."""
    body = await request.json()
    header_id = request.headers.get("x-request-id", "")
    index = int(header_id.rsplit("-", 1)[-1]) if header_id else -1
    action, cut_at = request.app[PLAN_KEY].get(index, ("ok", 0))
    if action == "http500":
        return web.json_response(ENGINE_DEAD_EVENT, status=500)
    max_tokens = int(body["max_tokens"])
    prompt_tokens = len(str(body["prompt"]).split())
    stop_at = cut_at if action in ("cut", "drop") else max_tokens
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    request_id = f"cmpl-{header_id or index}"
    letters = itertools.cycle(string.ascii_lowercase)
    sent = 0
    while sent < stop_at:
        n = min(TOKENS_PER_EVENT, stop_at - sent)
        sent += n
        text = "".join(f" {next(letters)}" for _ in range(n))
        finish = "length" if sent == max_tokens else None
        await asyncio.sleep(0.002)
        await response.write(_event(_chunk(request_id, text, finish)))
    if action == "drop":
        assert request.transport is not None
        request.transport.close()
        return response
    if action == "cut":
        await response.write(_event(ENGINE_DEAD_EVENT))
    else:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": sent,
            "total_tokens": prompt_tokens + sent,
        }
        await response.write(
            _event({"id": request_id, "model": MODEL, "choices": [], "usage": usage})
        )
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def models_list(request: web.Request) -> web.Response:
    """Enough of /v1/models for clients that ask which model is served."""
    return web.json_response(
        {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
    )


async def run(cmd: list[str], cwd: Path) -> int:
    """Run a client command, echoing its output for whoever regenerates."""
    print("$", " ".join(cmd), flush=True)
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=cwd)
    return await proc.wait()


async def main() -> None:
    """Start the server, make each fixture, copy it next to this script."""
    app = web.Application()
    app[PLAN_KEY] = {}
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models_list)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    bench = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    bench += ["--port", str(port), *BENCH_ARGS]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            build_tokenizer(work / TOKENIZER)
            saved = ["--save-result", "--result-dir", str(work)]
            detailed = [*saved, "--save-detailed", "--ignore-eos"]
            for name, actions, out in (
                ("clean", {}, detailed),
                ("short", {2: ("cut", CUT_AT)}, detailed),
                ("not_detailed", {}, saved),
                (
                    "failed",
                    {1: ("cut", CUT_AT), 2: ("http500", 0), 3: ("drop", CUT_AT)},
                    detailed,
                ),
            ):
                app[PLAN_KEY].clear()
                app[PLAN_KEY].update(actions)
                rc = await run(
                    [*bench, *out, "--result-filename", f"{name}.json"], work
                )
                print(f"vllm bench serve exit status for {name}: {rc}")
                shutil.copy(work / f"{name}.json", DATA_DIR / f"wave_{name}.json")
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
