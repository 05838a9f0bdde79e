"""The terminal report: the anatomy of one call as a short technical breakdown (rich).

Numbers are printed by `units` (decimal GB, TB/s, TFLOP/s, significant digits), stated once at the end; energy
with its interval and bytes as modelled or measured by `readings`, as in the HTML page.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..anatomy import Anatomy, percentile
from . import finite, fp8_plan_words, startup_plan, startup_text, units
from .readings import BytesReading, bytes_reading, energy_reading, memory_words


def shorten(text: str, limit: int = 160) -> str:
    text = text.replace("\n", "⏎ ")
    return text if len(text) <= limit else text[:limit] + "…"


def render(a: Anatomy, console: Console | None = None) -> None:
    """Print the report of one call to `console` (a new rich Console on stdout by default)."""
    c = console or Console()
    c.rule(f"[bold]llm-anatomy[/bold] · one call, measured · {a.id}")
    c.print(_header(a))
    c.print()
    c.print(_timeline(a))
    _latency(c, a)
    c.print()
    _work(c, a)
    _batching(c, a)
    c.print()
    _kv_cache(c, a)
    c.print()
    _memory(c, a)
    c.print()
    _telemetry(c, a)
    _kernels(c, a)
    for note in a.notes:
        c.print(f"[yellow]Note[/yellow]     {note}")
    c.print(f"[dim]Units    {units.UNITS}[/dim]")


def _header(a: Anatomy) -> Table:
    m, d = a.model, a.device
    words = memory_words(a)
    header = Table.grid(padding=(0, 2))
    header.add_row("Model", f"{m.name}: {units.sig(m.parameters / 1e9, 4)} B parameters, {m.dtype}, "
                            f"{units.size(m.weight_bytes)} of weights")
    if m.precision or (m.kv_cache_dtype and m.kv_cache_dtype != m.dtype):
        header.add_row("Precision", "; ".join(filter(None, (m.precision, m.kv_cache_dtype and
                                                                f"KV cache in {m.kv_cache_dtype}",
                                                                fp8_plan_words(startup_plan(a))))))
    header.add_row("Weights", Text(a.weights.label, style="bold yellow" if a.weights.kind == "synthetic" else ""))
    header.add_row("Device", f"{d.name}, {units.size(d.total_memory)} of {words.noun} ({d.why})")
    ce = a.ceilings
    measured = (f"measured {ce.measured_at}: read {units.tbps(ce.read_gbps)}, GEMV {units.tbps(ce.gemv_gbps)}, "
                f"matmul {units.tflops(ce.matmul_tflops)}" if finite(ce.read_gbps)
                else "not calibrated (llm-anatomy calibrate)")
    sheet = (f"; datasheet {units.tbps(ce.datasheet_gbps)}, {units.tflops(ce.datasheet_tflops)} "
             f"({ce.datasheet_source})" if finite(ce.datasheet_gbps) else "; no datasheet entry for this device")
    header.add_row("Ceilings", measured + sheet)
    startup = startup_text(a)
    if startup:
        header.add_row("Start-up", startup)
    templ = "chat template" if a.request.get("messages") else "raw prompt"
    header.add_row("Request", f"{len(a.prompt_token_ids)} prompt tokens ({templ}) → {len(a.output_token_ids)} output "
                              f"tokens, finish: {a.finish_reason}")
    header.add_row("Output", Text(repr(shorten(a.text))))
    return header


def _timeline(a: Anatomy) -> Table:
    timeline = Table(title="Timeline (ms since the call began, one host clock; device events aligned to it)",
                     title_justify="left")
    for col in ("phase", "start", "end", "ms", "what"):
        timeline.add_column(col, justify="right" if col in ("start", "end", "ms") else "left")
    for p in a.phases:
        timeline.add_row(p.name, f"{p.start_ms:.3f}", f"{p.end_ms:.3f}", f"{p.end_ms - p.start_ms:.3f}", p.note)
    return timeline


def _latency(c: Console, a: Anatomy) -> None:
    tpot = units.ms(a.tpot_ms) if a.tpot_ms is not None else "n/a (one token)"
    itl = a.itl_ms
    itl_text = (f"ITL p50 {units.ms(percentile(itl, 50))} / p90 {units.ms(percentile(itl, 90))}"
                if itl else "no ITL")
    tps = f" · {units.sig(a.decode.tokens_per_s)} tok/s decode" if a.decode else ""
    c.print(f"[bold]Latency[/bold]  TTFT {units.ms(a.ttft_ms)} · TPOT {tpot} (vLLM's definition) · {itl_text} · "
            f"e2e {units.ms(a.e2e_ms)}{tps}")
    if a.host_ms:
        work = ", ".join(f"{k.replace('_', ' ')} {units.ms(v)}" for k, v in a.host_ms.items())
        c.print(f"         host work: {work}")


def _work(c: Console, a: Anatomy) -> None:
    processor = memory_words(a).processor
    pf, line = a.prefill, a.prefill.roofline
    c.print(f"[bold]Prefill[/bold]  {pf.tokens} tokens in {units.ms(pf.ms)} on the {processor} ({units.ms(pf.host_ms)} "
            f"host work): {units.sig(pf.flops / 1e12)} TFLOP, {bytes_reading(pf).text()} → "
            f"{units.tflops(line.achieved_tflops)}, {units.tbps(line.achieved_gbps)}; MFU {units.percent(line.mfu)} "
            f"measured, {units.percent(line.mfu_datasheet)} datasheet")
    c.print(f"         [bold]{line.bound.kind}-bound[/bold]: {line.bound.why}")
    if not a.decode:
        return
    dc = a.decode
    median_bytes = BytesReading(finite(dc.bytes_per_step_median), None).text()
    measured = [s for s in a.decode_steps if bytes_reading(s).measured is not None]
    rl = dc.roofline
    rate = (f" → {units.tbps(rl.achieved_gbps)}; MBU {units.percent(rl.mbu)} measured, "
            f"{units.percent(rl.mbu_datasheet)} datasheet" if rl is not None else "")
    c.print(f"[bold]Decode[/bold]   {dc.steps} steps, median {units.ms(dc.gpu_ms_median)} on the {processor} and "
            f"{units.ms(dc.host_ms_median)} of host work per step; {median_bytes} per step{rate}")
    for s in measured:
        c.print(f"         step {s.index} (context {s.context_len}): {bytes_reading(s).text()}")
    if rl is not None:
        c.print(f"         [bold]{rl.bound.kind}-bound[/bold]: {rl.bound.why}; the KV cache is "
                f"{units.percent(dc.kv_share_of_bytes)} of the bytes a median step moves")


def _batching(c: Console, a: Anatomy) -> None:
    b = a.batching
    if b is None:
        return
    if b.max_batch_size == 1 and not b.stalls and not b.preemptions:
        c.print(f"[bold]Batching[/bold] alone on the engine (a batch of 1 at every step); queued "
                f"{units.ms(b.queue_ms)}")
        return
    stalls = (f"stalled {units.ms(b.stall_ms)} by {len(b.stalls)} prefill step(s) of other requests"
              if b.stalls else "never stalled by other requests")
    c.print(f"[bold]Batching[/bold] queued {units.ms(b.queue_ms)} · batch max {b.max_batch_size}, mean "
            f"{units.sig(b.mean_batch_size)} · shared steps with {len(b.co_scheduled)} other request(s) · "
            f"{stalls} · {b.preemptions} preemption(s)")


def _kv_cache(c: Console, a: Anatomy) -> None:
    kv, words = a.kv_cache, memory_words(a)
    c.print(f"[bold]KV cache[/bold] {kv.formula}")
    share = (f"{units.percent(kv.pool_share_of_device)} of {words.noun}" if kv.pool_share_of_device is not None
             else f"in {words.noun}")
    c.print(f"         this call: {kv.tokens} tokens = {units.size(kv.bytes_used)} used, {kv.blocks_allocated} blocks "
            f"of {kv.block_size} = {units.size(kv.bytes_allocated)} allocated; pool {units.size(kv.pool_bytes)} "
            f"({share})")
    c.print(f"         the {words.noun} left would hold {kv.fits_sequences_this_length:,} more sequences of this "
            f"length, {kv.fits_sequences_full_context:,} of the full context ({kv.full_context:,} tokens)")


def _memory(c: Console, a: Anatomy) -> None:
    mem, words = a.memory, memory_words(a)
    census = Table(title=f"Memory census of {words.noun} ({mem.source})", title_justify="left")
    census.add_column("where")
    census.add_column("bytes", justify="right")
    census.add_column("share", justify="right")
    for _, label, value in words.rows:
        census.add_row(label, units.size(value), units.percent(value / mem.total if mem.total else None))
    census.add_row("[bold]total[/bold]", units.size(mem.total), "100%")
    c.print(census)
    peak = units.size(mem.activation_peak) if mem.activation_peak is not None else "not measured on the host"
    c.print(f"         activation peak during the call (transient): {peak}")


def _telemetry(c: Console, a: Anatomy) -> None:
    t = a.telemetry
    if not t.available:
        c.print(f"[bold]GPU[/bold]      {t.note}")
        return
    power = [s.power_w for s in a.gpu_samples if s.power_w is not None]
    clocks = [s.sm_clock_mhz for s in a.gpu_samples if s.sm_clock_mhz]
    throttles = sorted({r for s in a.gpu_samples for r in s.throttle} - {"gpu_idle"})
    whole = next((e for e in t.energy if e.phase == "call"), None)
    mean = (f"mean power {units.sig(whole.joules / (a.e2e_ms / 1e3))} W from the energy counter; "
            if whole and a.e2e_ms else "")
    if power and clocks:
        c.print(f"[bold]GPU[/bold]      {t.note}; {mean}NVML's lagging power average: median "
                f"{statistics.median(power):.0f} W (max {max(power):.0f}); SM clock median "
                f"{statistics.median(clocks):.0f} MHz (min {min(clocks)}); throttle reasons seen: "
                f"{', '.join(throttles) or 'none'}")
    else:
        c.print(f"[bold]GPU[/bold]      {t.note}; no samples")
    for e in t.energy:
        r = energy_reading(e)
        per = ""
        if r.per_token is not None:
            per = f", {units.joules(r.per_token)} per token"
            if r.per_token_low is not None:
                per += f" in {r.per_token_range_text}"
        note = f"; {r.note}" if r.note else ""
        c.print(f"         energy {r.phase}: {r.text()}{per}{note}")
    if t.energy:
        c.print(f"         ({energy_reading(t.energy[0]).method})")


def _kernels(c: Console, a: Anatomy) -> None:
    for k in a.kernels:
        table = Table(title=f"Kernels: {k.phase} ({k.steps} step(s), {units.ms(k.total_ms)}, profiled in a replay)",
                      title_justify="left")
        for col in ("category", "ms", "share", "kernels"):
            table.add_column(col, justify="left" if col == "category" else "right")
        for cat in k.categories:
            table.add_row(cat.category, units.sig(cat.ms), units.percent(cat.ms / k.total_ms if k.total_ms else None),
                          str(cat.count))
        c.print()
        c.print(table)
