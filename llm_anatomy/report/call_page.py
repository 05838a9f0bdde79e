"""The content of one call's HTML page: every figure and every formatted value templates/anatomy.html shows.

`page_context(anatomy)` returns (figures, context) for `page.render_page("anatomy.html", ...)`. Values are
formatted here with `units` (decimal SI, significant digits) so the template only places them.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from ..anatomy import Anatomy
from . import finite, fp8_plan_words, startup_plan, startup_text, units
from .call_charts import roofline_figure, steps_figure, timeline_figure
from .charts import token_repr
from .readings import BytesReading, bytes_reading, energy_reading, memory_words
from .resource_charts import census_figure, clocks_figure, kernels_figure, kv_figure, power_figure

CHARTS = ("timeline", "steps", "roofline", "power", "clocks", "kv", "census", "kernels")
STEP_ROWS = 20  # the per-step table shows the first and last STEP_ROWS steps when there are more than 2x that

BYTES_NOTE = ("bytes moved are the cost model's count of what the kernels must read and write (weights, KV cache, "
              "activations), labelled modelled; they are labelled measured where the GPU's DRAM counters were "
              "read (Nsight Compute)")


def page_context(a: Anatomy) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures by element id, template context) of the anatomy page."""
    figures = _figures(a)
    charts = {name: f"chart-{name}" in figures for name in CHARTS}
    words = memory_words(a)
    context = dict(
        a=a, synthetic=a.weights.kind == "synthetic", startup=startup_text(a),
        fp8_plan=fp8_plan_words(startup_plan(a)),
        parameters=units.integer(a.model.parameters),
        cards=_headline(a), charts=charts, prefill=_prefill(a), decode=_decode(a),
        host_work=[(k.replace("_", " "), units.ms(v)) for k, v in (getattr(a, "host_ms", None) or {}).items()],
        ceilings=_ceilings(a), energy=_energy(a), batching=_batching(a), kv=_kv(a), memory=_memory(a),
        steps=dict(_steps(a), processor=words.processor), kernel_tables=_kernel_tables(a),
        definitions=sorted((a.definitions or {}).items()), bytes_note=BYTES_NOTE,
        prompt_text=a.prompt_text if a.prompt_text is not None else "",
        request_json=json.dumps(a.request, indent=2, ensure_ascii=False, default=str),
        **_header(a),
    )
    return figures, context


def _figures(a: Anatomy) -> dict[str, Any]:
    builders = [("chart-timeline", timeline_figure), ("chart-steps", steps_figure), ("chart-roofline", roofline_figure),
                ("chart-kv", kv_figure), ("chart-census", census_figure), ("chart-kernels", kernels_figure)]
    if a.telemetry.available:
        builders += [("chart-power", power_figure), ("chart-clocks", clocks_figure)]
    figures = {fid: build(a) for fid, build in builders}
    return {fid: fig for fid, fig in figures.items() if fig is not None}


def _header(a: Anatomy) -> dict[str, str]:
    when = "unknown date"
    if finite(a.started_at_unix):
        when = datetime.fromtimestamp(a.started_at_unix, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    dev = a.device
    words = memory_words(a)
    device_line = (dev.name + (f" ({dev.type})" if dev.type and dev.type not in dev.name else "")
                   + (f", {units.size(dev.total_memory)} of {words.noun}" if finite(dev.total_memory) else ""))
    software = ", ".join(x for x in (f"torch {dev.torch}" if dev.torch else "", f"CUDA {dev.cuda}" if dev.cuda else "",
                                     f"driver {dev.driver}" if dev.driver else "") if x)
    return dict(when=when, device_line=device_line, software=software)


def _energy_card(a: Anatomy) -> dict | None:
    readings = {e.phase: energy_reading(e) for e in a.telemetry.energy}
    total = readings.get("call") or readings.get("e2e")
    per = readings.get("decode") or total
    if per is None or per.per_token is None:
        return None
    value = units.joules(per.per_token) + (f" in {per.per_token_range_text}" if per.per_token_low is not None else "")
    sub = f"{per.phase}; whole call {total.text()}" if total is not None else per.phase
    title = f"{per.method}; {per.note}" if per.note else per.method
    return dict(label="Energy per token", value=value, sub=sub, title=title)


def _headline(a: Anatomy) -> list[dict]:
    d = a.definitions or {}
    cards = [
        dict(label="TTFT", value=units.ms(a.ttft_ms), sub=f"{len(a.prompt_token_ids)} prompt tokens",
             title=d.get("ttft_ms", "")),
        dict(label="TPOT", value=units.ms(a.tpot_ms), sub=f"{len(a.output_token_ids)} output tokens",
             title=d.get("tpot_ms", "")),
        dict(label="End to end", value=units.ms(a.e2e_ms), sub=f"finish: {a.finish_reason}", title=d.get("e2e_ms", "")),
    ]
    rl = a.prefill.roofline
    cards.append(dict(label="Prefill", value=units.tflops(rl.achieved_tflops),
                      sub=f"MFU {units.percent(a.prefill.mfu)} (datasheet {units.percent(rl.mfu_datasheet)}), "
                          f"{rl.bound.kind}-bound", title=rl.bound.why))
    if a.decode is not None and a.decode.roofline is not None:
        drl = a.decode.roofline
        cards.append(dict(label="Decode", value=units.tbps(drl.achieved_gbps),
                          sub=f"MBU {units.percent(drl.mbu)} (datasheet {units.percent(drl.mbu_datasheet)}), "
                              f"{units.sig(a.decode.tokens_per_s)} tok/s", title=drl.bound.why))
    elif a.decode is not None:
        cards.append(dict(label="Decode", value=f"{units.sig(a.decode.tokens_per_s)} tok/s",
                          sub=f"{a.decode.steps} steps", title=""))
    cards.append(dict(label="KV cache per token", value=units.size(a.kv_cache.bytes_per_token),
                      sub=f"{units.size(a.kv_cache.bytes_used)} used by this call", title=a.kv_cache.formula))
    energy = _energy_card(a)
    if energy is not None:
        cards.append(energy)
    return cards


def _intensity(flops: Any, reading: BytesReading) -> str:
    f, b = finite(flops), reading.value
    return units.sig(f / b) if f is not None and b else units.NA


def _prefill(a: Anatomy) -> dict:
    pf, rl = a.prefill, a.prefill.roofline
    reading = bytes_reading(pf)
    return dict(tokens=pf.tokens, ms=units.ms(pf.ms), host=units.ms(pf.host_ms),
                gflop=units.sig(finite(pf.flops) / 1e9 if finite(pf.flops) is not None else None),
                bytes=reading.text(), ai=_intensity(pf.flops, reading), tflops=units.tflops(rl.achieved_tflops),
                tbps=units.tbps(rl.achieved_gbps), mfu=units.percent(pf.mfu), mbu=units.percent(pf.mbu),
                bound=rl.bound)


def _decode(a: Anatomy) -> dict | None:
    dc = a.decode
    if dc is None:
        return None
    return dict(steps=dc.steps, gpu=units.ms(dc.gpu_ms_median), host=units.ms(dc.host_ms_median),
                itl=units.ms(dc.itl_ms_median), itl90=units.ms(dc.itl_ms_p90), tps=units.sig(dc.tokens_per_s),
                bytes=BytesReading(finite(dc.bytes_per_step_median), None).text(),
                kv_share=units.percent(dc.kv_share_of_bytes))


def _ceilings(a: Anatomy) -> dict:
    c = a.ceilings
    measured = any(bytes_reading(s).measured is not None for s in [a.prefill, *a.decode_steps])
    return dict(read=units.tbps(c.read_gbps), gemv=units.tbps(c.gemv_gbps), matmul=units.tflops(c.matmul_tflops),
                ds_bandwidth=units.tbps(c.datasheet_gbps), ds_tflops=units.tflops(c.datasheet_tflops),
                ridge=units.sig(c.ridge) if finite(c.ridge) else "", source=c.datasheet_source,
                has_ds=bool(finite(c.datasheet_gbps) or finite(c.datasheet_tflops)),
                has_measured=bool(finite(c.read_gbps) or finite(c.gemv_gbps) or finite(c.matmul_tflops)),
                measured_at=f"calibrated {c.measured_at}" if c.measured_at else "calibration date unknown",
                bytes_source="measured (DRAM counters) where read, else modelled" if measured else "modelled")


def _energy(a: Anatomy) -> list[dict]:
    rows = []
    for e in a.telemetry.energy:
        r = energy_reading(e)
        rows.append(dict(phase=r.phase, joules=units.joules(r.joules), range=r.range_text,
                         per_token=units.joules(r.per_token) if r.per_token is not None else "",
                         per_token_range=r.per_token_range_text,
                         method=f"{r.method}; {r.note}" if r.note else r.method))
    return rows


def _batching(a: Anatomy) -> dict | None:
    b = getattr(a, "batching", None)
    if b is None:
        return None
    co = sorted(b.co_scheduled.items(), key=lambda kv: -kv[1])
    return dict(queue=units.ms(b.queue_ms), max=units.integer(b.max_batch_size), mean=units.sig(b.mean_batch_size),
                shared=units.integer(len(co)), stall_count=units.integer(len(b.stalls)), stall_ms=units.ms(b.stall_ms),
                preemptions=units.integer(b.preemptions), co=[dict(id=k, steps=units.integer(v)) for k, v in co[:12]],
                stalls=[dict(start=_fixed(st.start_ms), gpu=_fixed(st.gpu_ms), tokens=units.integer(st.tokens),
                             requests=", ".join(st.requests[:6]) + (" ..." if len(st.requests) > 6 else ""))
                        for st in b.stalls[:20]])


def _kv(a: Anatomy) -> dict:
    kv = a.kv_cache
    return dict(bpt=units.integer(kv.bytes_per_token), formula=kv.formula, dtype=kv.dtype, block=kv.block_size,
                pool=units.size(kv.pool_bytes), pool_blocks=units.integer(kv.pool_blocks),
                pool_share=units.percent(kv.pool_share_of_device), tokens=kv.tokens, blocks=kv.blocks_allocated,
                used=units.size(kv.bytes_used), allocated=units.size(kv.bytes_allocated),
                fits=units.integer(kv.fits_sequences_this_length),
                fits_full=units.integer(kv.fits_sequences_full_context),
                full=units.integer(kv.full_context))


def _memory(a: Anatomy) -> dict:
    m, words = a.memory, memory_words(a)
    total = finite(m.total) or 0
    values = [finite(v) for _, _, v in words.rows]
    rows = [dict(name=label, bytes=units.integer(v), human=units.size(v),
                 share=units.percent(finite(v) / total if total and finite(v) is not None else None))
            for _, label, v in words.rows]
    census_sum = sum(v or 0 for v in values)
    return dict(noun=words.noun, rows=rows, total=units.integer(total), total_h=units.size(total),
                ok=census_sum == total, sum=units.integer(census_sum),
                activation_peak=units.size(m.activation_peak) if finite(m.activation_peak) is not None else "")


def _fixed(x: Any, digits: int = 3) -> str:
    """Milliseconds on the call's clock, to the microsecond (a column of instants lines up)."""
    v = finite(x)
    return units.NA if v is None else f"{v:.{digits}f}"


def _mega(x: Any) -> str:
    v = finite(x)
    return units.sig(v / 1e6 if v is not None else None)


def _step_row(s: Any) -> dict:
    reading = bytes_reading(s)
    return dict(index=s.index, start=_fixed(s.start_ms), gpu=_fixed(s.gpu_ms), host=_fixed(s.host_ms),
                ctx=s.context_len, batch=s.batch_size, token_id=s.token_id, token=token_repr(s.token_text),
                gflop=units.sig(finite(s.flops) / 1e9 if finite(s.flops) is not None else None),
                mb=_mega(reading.modelled), mb_measured=_mega(reading.measured) if reading.measured is not None else "",
                kv_mb=_mega(s.kv_bytes_read), mbu=units.percent(s.mbu), mfu=units.percent(s.mfu), bound=s.bound,
                batch_change=" ".join([f"+{x}" for x in s.joined] + [f"\u2212{x}" for x in s.left]))


def _steps(a: Anatomy) -> dict:
    steps = a.decode_steps
    measured = any(bytes_reading(s).measured is not None for s in steps)
    if len(steps) <= 2 * STEP_ROWS:
        return dict(first=[_step_row(s) for s in steps], last=[], omitted=0, measured=measured)
    return dict(first=[_step_row(s) for s in steps[:STEP_ROWS]], last=[_step_row(s) for s in steps[-STEP_ROWS:]],
                omitted=len(steps) - 2 * STEP_ROWS, measured=measured)


def _kernel_tables(a: Anatomy) -> list[dict]:
    return [dict(phase=k.phase, steps=k.steps, total=units.ms(k.total_ms),
                 top=[dict(name=str(t.get("name", "?")), ms=units.ms(t.get("ms")), count=t.get("count", ""))
                      for t in k.top_kernels]) for k in a.kernels if k.top_kernels]
