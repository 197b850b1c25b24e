"""What a Generate call sends: the stream items of a request -> ``Choice`` messages (unary)
and ``GenerateStreamResponse`` events (streaming), with the output readers (reasoning, tool
calls) applied."""

from __future__ import annotations

from tokenwire.runtime.front.request_stream import RequestFailed, RequestFinished, RequestStream
from tokenwire.runtime.outputs import ChoiceDelta, CompletionOutput, RequestOutput
from tokenwire.server.grpc import convert
from tokenwire.server.grpc.tools import tool_call_proto, tool_delta_proto
from tokenwire.server.tenants.limits import Lease
from tokenwire.server.tool_parsers.output import ChoiceParser, OutputParsing
from tokenwire.v1 import generation_pb2


def choice_message(
    c: CompletionOutput, num_top: int | None, parsing: OutputParsing | None
) -> generation_pb2.Choice:
    """One finished choice of a unary Generate, its text read by ``parsing`` (reasoning,
    tool calls) when given."""
    choice = convert.choice_proto(c, num_top)
    if parsing is not None:
        parsed = parsing.parse(c.text)
        choice.text = parsed.content
        choice.reasoning_content = parsed.reasoning
        choice.tool_calls.extend(tool_call_proto(t) for t in parsed.tool_calls)
    return choice


def delta_events(
    item: ChoiceDelta,
    num_top: int | None,
    completion_tokens: int,
    parser: ChoiceParser | None = None,
) -> list[generation_pb2.GenerateStreamResponse]:
    """A TokenDelta when it carries output, then a ChoiceEnd when the choice finished. With
    a ``parser``, the delta's text is split into content, reasoning and tool-call pieces."""
    events = []
    delta = convert.token_delta(item, num_top)
    if parser is not None:
        parsed = parser.step(item.text, final=item.finish_reason is not None)
        delta.text, delta.reasoning_text = parsed.content, parsed.reasoning
        delta.tool_calls.extend(tool_delta_proto(p) for p in parsed.tool_calls)
    if delta.text or delta.token_ids or delta.tool_calls or delta.reasoning_text:
        events.append(generation_pb2.GenerateStreamResponse(delta=delta))
    if item.finish_reason is not None:
        events.append(
            generation_pb2.GenerateStreamResponse(
                end=generation_pb2.ChoiceEnd(
                    index=item.index,
                    finish_reason=convert.finish_reason(item.finish_reason),
                    completion_tokens=completion_tokens,
                    **convert.stop_fields(item.stop_reason),
                )
            )
        )
    return events


async def final_output(stream: RequestStream, lease: Lease) -> RequestOutput:
    """Drain a unary call's stream, charging its tokens as they come; the final output."""
    async for item in stream:
        if isinstance(item, ChoiceDelta):
            lease.charge(len(item.token_ids))  # as produced, like a stream
        elif isinstance(item, RequestFinished):
            return item.output
        if isinstance(item, RequestFailed):
            raise item.error
    raise RuntimeError("stream ended without a final output")
