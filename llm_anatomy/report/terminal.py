"""The terminal report: the anatomy of one call as a short technical breakdown (rich)."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..anatomy import Anatomy, Roofline
from ..probe.memory import census_rows
from . import startup_text


def gb(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def rate(line: Roofline) -> str:
    return f"{line.achieved_tflops:.1f} TFLOP/s, {line.achieved_gbps:.0f} GB/s"


def shorten(text: str, limit: int = 160) -> str:
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= limit else text[:limit] + "…"


def render(a: Anatomy, console: Console | None = None) -> None:
    c = console or Console()
    m, d = a.model, a.device
    c.rule(f"[bold]llm-anatomy[/bold] · one call, measured · {a.id}")
    header = Table.grid(padding=(0, 2))
    header.add_row("Model", f"{m.name}: {m.parameters / 1e9:.2f} B parameters, {m.dtype}, {gb(m.weight_bytes)} of weights")
    weights_style = "bold yellow" if a.weights.kind == "synthetic" else ""
    header.add_row("Weights", Text(a.weights.label, style=weights_style))
    header.add_row("Device", f"{d.name}, {gb(d.total_memory)} ({d.why})")
    ce = a.ceilings
    measured = (f"measured {ce.measured_at}: read {ce.read_gbps:.0f} GB/s, GEMV {ce.gemv_gbps:.0f} GB/s, matmul "
                f"{ce.matmul_tflops:.1f} TFLOP/s" if ce.read_gbps else "not calibrated (llm-anatomy calibrate)")
    sheet = (f"; datasheet {ce.datasheet_gbps:.0f} GB/s, {ce.datasheet_tflops:.0f} TFLOP/s ({ce.datasheet_source})"
             if ce.datasheet_gbps else "; no datasheet entry for this device")
    header.add_row("Ceilings", measured + sheet)
    startup = startup_text(a)
    if startup:
        header.add_row("Start-up", startup)
    out_n = len(a.output_token_ids)
    templ = "chat template" if a.request.get("messages") else "raw prompt"
    header.add_row("Request", f"{len(a.prompt_token_ids)} prompt tokens ({templ}) → {out_n} output tokens, "
                              f"finish: {a.finish_reason}")
    header.add_row("Output", Text(repr(shorten(a.text))))
    c.print(header)

    c.print()
    timeline = Table(title="Timeline (ms since the call began, one host clock; GPU events aligned to it)",
                     title_justify="left")
    for col in ("phase", "start", "end", "ms", "what"):
        timeline.add_column(col, justify="right" if col in ("start", "end", "ms") else "left")
    for p in a.phases:
        timeline.add_row(p.name, f"{p.start_ms:.3f}", f"{p.end_ms:.3f}", f"{p.end_ms - p.start_ms:.3f}", p.note)
    c.print(timeline)
    tpot = f"{a.tpot_ms:.3f} ms" if a.tpot_ms is not None else "n/a (one token)"
    itl = sorted(a.itl_ms)
    itl_text = (f"ITL p50 {statistics.median(itl):.3f} / p90 {itl[int(0.9 * (len(itl) - 1))]:.3f} ms" if itl
                else "no ITL")
    tps = f" · {a.decode.tokens_per_s:.1f} tok/s decode" if a.decode else ""
    c.print(f"[bold]Latency[/bold]  TTFT {a.ttft_ms:.3f} ms · TPOT {tpot} (vLLM's definition) · {itl_text} · "
            f"e2e {a.e2e_ms:.1f} ms{tps}")
    if a.host_ms:
        c.print("         host work: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in a.host_ms.items()))

    pf = a.prefill
    line = pf.roofline
    c.print()
    c.print(f"[bold]Prefill[/bold]  {pf.tokens} tokens in {pf.ms:.3f} ms on the device ({pf.host_ms:.3f} ms host work): "
            f"{pf.flops / 1e12:.3f} TFLOP, {gb(pf.bytes)} → {rate(line)}; MFU {pct(line.mfu)} measured, "
            f"{pct(line.mfu_datasheet)} datasheet")
    c.print(f"         [bold]{line.bound.kind}-bound[/bold]: {line.bound.why}")
    if a.decode:
        dc = a.decode
        line = dc.roofline
        c.print(f"[bold]Decode[/bold]   {dc.steps} steps, median {dc.gpu_ms_median:.3f} ms on the device and "
                f"{dc.host_ms_median:.3f} ms of host work per step; {gb(dc.bytes_per_step_median)} moved per step "
                f"→ {line.achieved_gbps:.0f} GB/s; MBU {pct(line.mbu)} measured, {pct(line.mbu_datasheet)} datasheet")
        c.print(f"         [bold]{line.bound.kind}-bound[/bold]: {line.bound.why}; the KV cache is "
                f"{pct(dc.kv_share_of_bytes)} of the bytes a median step moves")

    b = a.batching
    if b is not None and b.max_batch_size == 1 and not b.stalls and not b.preemptions:
        c.print(f"[bold]Batching[/bold] alone on the engine (a batch of 1 at every step); queued {b.queue_ms:.3f} ms")
    elif b is not None:
        stalls = (f"stalled {b.stall_ms:.1f} ms by {len(b.stalls)} prefill step(s) of other requests"
                  if b.stalls else "never stalled by other requests")
        c.print(f"[bold]Batching[/bold] queued {b.queue_ms:.3f} ms · batch max {b.max_batch_size}, mean "
                f"{b.mean_batch_size:.1f} · shared steps with {len(b.co_scheduled)} other request(s) · {stalls} · "
                f"{b.preemptions} preemption(s)")

    kv = a.kv_cache
    c.print()
    c.print(f"[bold]KV cache[/bold] {kv.formula}")
    share = f" ({pct(kv.pool_share_of_device)} of the device)" if kv.pool_share_of_device is not None else ""
    c.print(f"         this call: {kv.tokens} tokens = {gb(kv.bytes_used)} used, {kv.blocks_allocated} blocks of "
            f"{kv.block_size} = {gb(kv.bytes_allocated)} allocated; pool {gb(kv.pool_bytes)}{share}")
    c.print(f"         the memory left would hold {kv.fits_sequences_this_length:,} more sequences of this length, "
            f"{kv.fits_sequences_full_context:,} of the full context ({kv.full_context:,} tokens)")

    mem = a.memory
    census = Table(title=f"Memory census ({mem.source})", title_justify="left")
    census.add_column("where")
    census.add_column("bytes", justify="right")
    census.add_column("share", justify="right")
    for name, value in census_rows(mem):
        census.add_row(name, gb(value), pct(value / mem.total))
    census.add_row("[bold]total[/bold]", gb(mem.total), "100%")
    c.print()
    c.print(census)
    peak = gb(mem.activation_peak) if mem.activation_peak is not None else "not measured on the host"
    c.print(f"         activation peak during the call (transient): {peak}")

    c.print()
    t = a.telemetry
    if not t.available:
        c.print(f"[bold]GPU[/bold]      {t.note}")
    else:
        power = [s.power_w for s in a.gpu_samples if s.power_w is not None]
        clocks = [s.sm_clock_mhz for s in a.gpu_samples if s.sm_clock_mhz]
        throttles = sorted({r for s in a.gpu_samples for r in s.throttle} - {"gpu_idle"})
        whole = next((e for e in t.energy if e.phase == "call"), None)
        mean = f"mean power {whole.joules / (a.e2e_ms / 1e3):.0f} W from the energy counter; " if whole else ""
        c.print(f"[bold]GPU[/bold]      {t.note}; {mean}NVML's lagging power average: median "
                f"{statistics.median(power):.0f} W (max {max(power):.0f}); "
                f"SM clock median {statistics.median(clocks):.0f} MHz (min {min(clocks)}); "
                f"throttle reasons seen: {', '.join(throttles) or 'none'}" if power and clocks else
                f"[bold]GPU[/bold]      {t.note}; no samples")
        for e in t.energy:
            per = f", {e.per_token_j:.3f} J per token" if e.per_token_j is not None else ""
            c.print(f"         energy {e.phase}: {e.joules:.2f} J ± {e.uncertainty_j:.2f}{per}")
        if t.energy:
            c.print(f"         ({t.energy[0].method})")

    for k in a.kernels:
        table = Table(title=f"Kernels: {k.phase} ({k.steps} step(s), {k.total_ms:.3f} ms, profiled in a replay)",
                      title_justify="left")
        for col in ("category", "ms", "share", "kernels"):
            table.add_column(col, justify="left" if col == "category" else "right")
        for cat in k.categories:
            table.add_row(cat.category, f"{cat.ms:.3f}", pct(cat.ms / k.total_ms if k.total_ms else None),
                          str(cat.count))
        c.print()
        c.print(table)
    for note in a.notes:
        c.print(f"[yellow]Note[/yellow]     {note}")
