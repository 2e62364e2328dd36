"""The check both decode-in-two-calls tests share (test_chained_engine_cpu.py on a host build with
the entries forced, test_gpu_split_decode.py on a real CUDA build): a chained one-sequence step runs
decode_hidden, then (after the KV cache's fence) decode_logits, and its logits must equal what
`decode` gives the same sequence in a second runner, bit for bit, step after step."""
from __future__ import annotations

from typing import Any

import numpy as np


def assert_two_calls_give_decodes_logits(model: Any, prompt_len: int = 13, steps: int = 6, seed: int = 3) -> None:
    """Prompt `prompt_len` tokens into two runners of `model`, then `steps` decode steps: one runner
    through `decode` (a step whose token is on the host), the other through the chained path (the
    token already on the device), which takes the two calls when the library exports them. With 13
    + 6 tokens and 16-token pages the sequence's second page begins midway."""
    from test_cuda_graph_buckets import Harness

    from vtool.runtime.engine.chained_steps import PENDING_TOKEN, DeviceTokens
    from vtool.runtime.engine.runner import SPLIT_DECODE
    from vtool.runtime.engine.step_types import ScheduledSequence, SchedulerOutput

    host, device = Harness.make(model, 64, 4), Harness.make(model, 64, 4)
    assert device.runner.split_decode and set(SPLIT_DECODE) <= set(model.manifest["entry_points"])
    calls: list[str] = []
    real = model.function

    def counting(name):  # noqa: ANN001, ANN202
        calls.append(name)
        return real(name)

    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, model.vocab_size, size=prompt_len).tolist()
    host.prefill(0, prompt)
    device.prefill(0, prompt)
    model.function = counting
    try:
        for step_index in range(steps):
            token = int(rng.integers(1, model.vocab_size))
            want = host.decode({0: token})[0]
            step = SchedulerOutput((ScheduledSequence("r0", 0, (PENDING_TOKEN,), len(device.tokens[0]), 1, False,
                                                      return_logits=True),))
            drawn = model.upload(np.array([7, token], np.int32))
            result = device.runner.finish(device.runner.launch(step, DeviceTokens(drawn, (1,)))).results[0]
            device.tokens[0].append(token)
            np.testing.assert_array_equal(result.logits[-1], want, err_msg=f"step {step_index}")
    finally:
        del model.function
    assert calls.count(SPLIT_DECODE[0]) >= steps and calls.count(SPLIT_DECODE[1]) >= steps, calls
