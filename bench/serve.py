"""``tokenwire bench serve``: online load against a gRPC or OpenAI-compatible HTTP endpoint.

Fixed concurrency (``--concurrency``) or Poisson arrivals (``--request-rate``), the
``bench/workloads.py`` workloads sent as token ids with ``ignore_eos`` so every request
produces exactly its output length. Metrics and JSON keys follow ``vllm bench serve``; the
same tool measures vLLM. The fleet workloads (``multiturn``, ``shared-prefix``:
bench/fleet_workloads.py) send each conversation's turns in order with its ``x-session-id``,
and with ``--replica-metrics`` report the prefix-cache hit rate read from every replica
behind a gateway.
Everything here takes a frozen ``ServeBenchConfig``; ``bench/cli.py`` builds it from the flags.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from tokenwire.bench.configs import ServeBenchConfig
from tokenwire.bench.fleet_workloads import FLEET_WORKLOADS, Conversation, make_fleet_workload
from tokenwire.bench.replica_metrics import hit_summary, read_counters
from tokenwire.bench.serve_metrics import RequestResult, summarize
from tokenwire.bench.workloads import bench_tokenizer, make_workload
from tokenwire.clients.channel import TlsOptions

# (prompt token ids, output length, session id or None) -> the request's timings.
Sender = Callable[[list[int], int, str | None], Awaitable[RequestResult]]
SESSION_HEADER = "x-session-id"  # the routing key a gateway's affinity policy reads


@dataclass
class _Timer:
    """Collects token arrival times of one streamed request (perf_counter seconds)."""

    start: float = field(default_factory=time.perf_counter)
    chunks: list[tuple[float, int]] = field(default_factory=list)

    def tokens(self, count: int) -> None:
        if count:
            self.chunks.append((time.perf_counter(), count))

    def result(
        self, prompt_len: int, error: str | None = None, reported: int | None = None
    ) -> RequestResult:
        return RequestResult(
            self.start, time.perf_counter(), prompt_len, self.chunks, error, reported
        )


def _read_line(line: str, timer: _Timer, reported: list[int]) -> None:
    """One SSE line of a streamed completion: a text chunk is a token arrival (exact counts
    come from the usage chunk, appended to ``reported``)."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = json.loads(line[6:])
    choices = chunk.get("choices") or []
    if choices and choices[0].get("text"):
        timer.tokens(1)
    if chunk.get("usage"):
        reported.append(chunk["usage"]["completion_tokens"])


def grpc_sender(
    target: str, api_key: str | None, cache_salt: str, tls: TlsOptions | None = None
) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    import grpc

    from tokenwire.clients.channel import open_aio_channel
    from tokenwire.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    options = (
        [("grpc.ssl_target_name_override", tls.server_name)] if tls and tls.server_name else []
    )
    channel = open_aio_channel(target, list(options), tls)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(prompt: list[int], output_len: int, session: str | None) -> RequestResult:
        timer = _Timer()
        metadata = (*auth, (SESSION_HEADER, session)) if session else auth
        request = generation_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingOptions(temperature=0.0),
            stopping=common_pb2.StoppingOptions(max_tokens=output_len, ignore_eos=True),
            cache_salt=cache_salt,
        )
        try:
            async for event in stub.GenerateStream(request, metadata=metadata or None):
                if event.WhichOneof("event") == "delta":
                    timer.tokens(len(event.delta.token_ids))
        except grpc.aio.AioRpcError as err:
            return timer.result(len(prompt), f"{err.code().name}: {err.details()}")
        return timer.result(len(prompt))

    return send, channel.close


def openai_sender(
    base_url: str,
    model: str,
    api_key: str | None,
    cache_salt: str,
    tls: TlsOptions | None = None,
    as_text: Callable[[list[int]], str] | None = None,
) -> tuple[Sender, Callable[[], Awaitable[None]]]:
    """``as_text``: send each prompt as this text instead of token ids (gateways such as SMG
    accept only text prompts on /v1/completions)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    verify: str | bool = tls.ca_certs if tls and tls.ca_certs else True
    cert = (tls.certfile, tls.keyfile) if tls and tls.certfile and tls.keyfile else None
    client = httpx.AsyncClient(
        base_url=base_url.rstrip("/"), headers=headers, timeout=None, verify=verify, cert=cert
    )

    async def send(prompt: list[int], output_len: int, session: str | None) -> RequestResult:
        timer = _Timer()
        session_headers = {SESSION_HEADER: session} if session else {}
        body = {
            "model": model,
            "prompt": prompt if as_text is None else as_text(prompt),
            "max_tokens": output_len,
            "stream": True,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "cache_salt": cache_salt,  # vLLM's extension field; tokenwire's shim accepts it
        }
        reported: list[int] = []
        for attempt in (1, 2):
            try:
                async with client.stream(
                    "POST", "/v1/completions", json=body, headers=session_headers
                ) as response:
                    if response.status_code != 200:
                        return timer.result(len(prompt), f"HTTP {response.status_code}")
                    async for line in response.aiter_lines():
                        _read_line(line, timer, reported)
                break
            except httpx.RemoteProtocolError as err:
                # A pooled keep-alive connection the server had closed (llama-server does):
                # nothing was answered yet, so send once more on a fresh one.
                if attempt == 2 or timer.chunks or reported:
                    return timer.result(len(prompt), type(err).__name__)
            except httpx.HTTPError as err:
                return timer.result(len(prompt), type(err).__name__)
        return timer.result(len(prompt), reported=reported[-1] if reported else None)

    return send, client.aclose


async def _run_load(
    send: Sender,
    prompts: list[list[int]],
    output_lens: list[int],
    concurrency: int,
    request_rate: float | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), desc="bench serve", unit="req")

    async def one(prompt: list[int], out_len: int) -> RequestResult:
        async with limit:
            result = await send(prompt, out_len, None)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for prompt, out_len in zip(prompts, output_lens, strict=True):
        tasks.append(asyncio.create_task(one(prompt, out_len)))
        if request_rate is not None:  # Poisson process: exponential gaps between arrivals
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    bar.close()
    return list(results), time.perf_counter() - start


async def _run_conversations(
    send: Sender, conversations: list[Conversation], concurrency: int
) -> tuple[list[RequestResult], float]:
    """Conversations in parallel (at most ``concurrency`` at once), each one's turns in order."""
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=sum(len(c.turns) for c in conversations), desc="bench serve", unit="req")

    async def one(conversation: Conversation) -> list[RequestResult]:
        results = []
        async with limit:
            for turn in conversation.turns:
                results.append(await send(turn.prompt, turn.output_len, conversation.session_id))
                bar.update(1)
        return results

    start = time.perf_counter()
    done = await asyncio.gather(*(one(c) for c in conversations))
    bar.close()
    return [r for rs in done for r in rs], time.perf_counter() - start


def serve_bench_summary(config: ServeBenchConfig) -> dict[str, Any]:
    """Run the load and return the JSON record (vLLM's result keys)."""
    if config.workload in FLEET_WORKLOADS:
        conversations = make_fleet_workload(
            config.workload, config.vocab_size, config.fleet, config.num_requests
        )

        def fleet(send: Sender) -> Awaitable[tuple[list[RequestResult], float]]:
            return _run_conversations(send, conversations, config.concurrency)

        return asyncio.run(_main(config, fleet, [0] * 16))
    tokenizer = bench_tokenizer(config.tokenizer) if config.workload == "edit" else None
    workload = make_workload(config.workload, config.vocab_size, config.num_requests, tokenizer)

    def load(send: Sender) -> Awaitable[tuple[list[RequestResult], float]]:
        return _run_load(
            send,
            workload.prompts,
            workload.output_lens,
            config.concurrency,
            config.request_rate,
            config.seed,
        )

    return asyncio.run(_main(config, load, workload.prompts[0]))


def run_serve_bench(config: ServeBenchConfig) -> int:
    summary = serve_bench_summary(config)
    _print_table(summary)
    print(json.dumps(summary))
    return 0 if summary["failed"] == 0 else 1


Load = Callable[[Sender], Awaitable[tuple[list[RequestResult], float]]]


async def _main(config: ServeBenchConfig, load: Load, first_prompt: list[int]) -> dict[str, Any]:
    salt = config.cache_salt if config.cache_salt is not None else uuid.uuid4().hex
    if config.backend == "grpc":
        send, close = grpc_sender(config.target, config.api_key, salt, config.tls)
        target = f"grpc{'s' if config.tls else ''}://{config.target}"
    else:
        as_text = None
        if config.text_prompts:
            tokenizer = bench_tokenizer(config.tokenizer)
            as_text = lambda ids: str(tokenizer.decode(ids))  # noqa: E731
        send, close = openai_sender(
            config.base_url, config.model, config.api_key, salt, config.tls, as_text
        )
        target = config.base_url
    try:
        # Warm-up: connection set-up stays out of the figures (its 16 tokens enter no prefix
        # of the run: a fresh salt, or the same 16 tokens every run).
        await send(first_prompt[:16], 2, None)
        before = await read_counters(config.replica_metrics, config.api_key)
        results, duration = await load(send)
        after = await read_counters(config.replica_metrics, config.api_key)
    finally:
        await close()
    summary: dict[str, Any] = summarize(results, duration)
    summary.update(
        {
            "bench": "serve",
            "backend": config.backend,
            "target": target,
            "workload": config.workload,
            "concurrency": config.concurrency,
            "request_rate": config.request_rate,
        }
    )
    if config.replica_metrics:
        summary.update(hit_summary(before, after))
    return summary


def _print_table(s: dict[str, Any]) -> None:
    print(f"\n{'=' * 14} Serving Benchmark Result {'=' * 14}")
    rows = [
        ("Backend / target", f"{s['backend']} {s['target']}"),
        ("Workload / concurrency", f"{s['workload']} / {s['concurrency']}"),
        ("Successful / failed requests", f"{s['completed']} / {s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration']:.2f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            rows.append(
                (f"{stat.capitalize()} {metric.upper()} (ms)", f"{s[f'{stat}_{metric}_ms']:.2f}")
            )
    if "prefix_cache_hit_rate" in s:
        rows.append(("Prefix-cache hit rate (replicas)", f"{s['prefix_cache_hit_rate']:.3f}"))
        rows.append(("Prompt tokens per replica", " ".join(map(str, s["replica_prompt_tokens"]))))
    for name, value in rows:
        print(f"{name:<40s}{value:>20s}")
    print("=" * 54)
