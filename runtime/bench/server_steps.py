"""The served engine's own step durations around a bench run, when the server is vtool's.

`vtool serve` keeps `vtool:engine_step_seconds{kind}` (a histogram per step kind: decode,
mixed, prefill) on /metrics. Scraped before and after each concurrency level, the difference
says how many steps of each kind the level took and how long they were: a slow level shows
whether its decode steps or the steps that admitted prompts were slow. Any other server (no
/metrics, or no such metric) gives None and the bench goes on as before.
"""
from __future__ import annotations

from typing import Any

import httpx

from vtool.runtime.bench.client import api_base

STEP_METRIC = "vtool:engine_step_seconds"
KINDS = ("decode", "mixed", "prefill")

Snapshot = dict[str, tuple[float, float]]  # kind -> (steps, seconds)


async def scrape(url: str, api_key: str | None) -> Snapshot | None:
    """The server's step counts and seconds by kind now; None when it does not keep them."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.get(f"{api_base(url)}/metrics", headers=headers)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):  # no server there, or not Prometheus text
        return None
    totals = {kind: [0.0, 0.0] for kind in KINDS}
    found = False
    for family in families:
        if family.name != STEP_METRIC:
            continue
        for sample in family.samples:
            kind = sample.labels.get("kind")
            if kind not in totals:
                continue
            if sample.name == f"{STEP_METRIC}_count":
                totals[kind][0] += sample.value
                found = True
            elif sample.name == f"{STEP_METRIC}_sum":
                totals[kind][1] += sample.value
    return {kind: (n, s) for kind, (n, s) in totals.items()} if found else None


def between(before: Snapshot | None, after: Snapshot | None) -> dict[str, dict[str, Any]] | None:
    """Per kind: steps taken and their mean milliseconds between two snapshots; None when
    either is missing or the counters went back (the server restarted in between)."""
    if before is None or after is None or any(after[k][0] < before[k][0] for k in KINDS):
        return None
    out = {}
    for kind in KINDS:
        steps = int(round(after[kind][0] - before[kind][0]))
        seconds = after[kind][1] - before[kind][1]
        out[kind] = {"steps": steps, "mean_ms": round(1e3 * seconds / steps, 3) if steps > 0 else None}
    return out


def describe(steps: dict[str, dict[str, Any]] | None) -> str | None:
    """One line for the console: "server steps: 120 decode (7.41 ms), 3 mixed (19.2 ms), ..."."""
    if steps is None:
        return None
    parts = [f"{v['steps']} {kind} ({v['mean_ms']:g} ms)" for kind, v in steps.items() if v["steps"]]
    return "server steps: " + (", ".join(parts) if parts else "none")
