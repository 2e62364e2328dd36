"""The messages between API servers and the engine core process (ZeroMQ frames, msgspec).

An API server's DEALER socket sends [kind, payload] to the core's ROUTER, which sees
[client identity, kind, payload] and answers the same client. Kinds:

  client -> core   ADD    (call_id, request_id, prompt_ids, SamplingParams, priority, arrival_time)
                   ABORT  (request_ids, reason, stop_reason)   no answer; reason "abort" or "stop"
                   CALL   (call_id, method, args)              UTILITY_METHODS below
  core -> client   REPLY  (call_id, ok, result or (error class, message))
                   OUTPUT [CoreOutput, ...]                    one message per step per client
                   DEAD   message                              the core's loop failed; it exits

Times are time.monotonic(): CLOCK_MONOTONIC is one clock for every process on the host.
"""
from __future__ import annotations

from typing import Any

import msgspec

from vtool import VtoolError
from vtool.runtime.engine.async_engine import EngineDeadError  # noqa: F401 - one class for both engines
from vtool.runtime.engine.request import CoreOutput
from vtool.runtime.engine.validation import RequestError
from vtool.runtime.sampling.params import SamplingParams, SamplingParamsError

ADD, ABORT, CALL = b"add", b"abort", b"call"
REPLY, OUTPUT, DEAD = b"reply", b"output", b"dead"

# What CALL may ask of the core, by name (never arbitrary code: the core is another process).
UTILITY_METHODS = ("ping", "stats", "metrics_text", "reset_prefix_cache")

# (call id, request id, prompt ids, params, priority, arrival, parent: (id, n) of parallel sampling)
AddMessage = tuple[int, str, list[int], SamplingParams, int, float, "tuple[str, int] | None"]
AbortMessage = tuple[list[str], str, "str | int | None"]
CallMessage = tuple[int, str, list[Any]]
ReplyMessage = tuple[int, bool, Any]

encoder = msgspec.msgpack.Encoder()
add_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[int], SamplingParams, int, float, tuple[str, int] | None])
abort_decoder = msgspec.msgpack.Decoder(tuple[list[str], str, str | int | None])
call_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[Any]])
reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, Any])
output_decoder = msgspec.msgpack.Decoder(list[CoreOutput])
dead_decoder = msgspec.msgpack.Decoder(str)


def error_payload(err: BaseException) -> tuple[str, str]:
    """An exception as it crosses to the API server: (kind, message)."""
    if isinstance(err, (RequestError, SamplingParamsError)):
        return "request", str(err)
    if isinstance(err, VtoolError):
        return "vtool", str(err)
    if isinstance(err, ValueError):
        return "value", str(err)
    return "internal", f"{type(err).__name__}: {err}"


def error_from_payload(payload: Any) -> BaseException:
    """The exception an API server raises for a refused call: request refusals stay 400s."""
    kind, message = payload
    if kind == "request":
        return RequestError(message)
    if kind == "vtool":
        return VtoolError(message)
    if kind == "value":
        return ValueError(message)
    return RuntimeError(f"the engine core failed: {message}")
