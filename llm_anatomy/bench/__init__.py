"""`llm-anatomy bench URL`: a load generator for any OpenAI-compatible server (vLLM, SGLang, TGI, llm-anatomy).

It streams requests at a list of concurrencies (closed loop) or request rates (open loop, Poisson), measures
each request from the client's side with vLLM's benchmark definitions (TTFT, TPOT, ITL, e2e, throughput,
goodput), and sets beside them what can be seen of the server: its Prometheus metrics, a local GPU's energy
(NVML), and, for an llm-anatomy server, each request's own anatomy. docs/bench.md has the details.

Modules: datasets (prompts), client (one streamed request, timed), load (closed and open loop), metrics
(vLLM's definitions, percentiles), scrape (Prometheus before/after), power (NVML energy), anatomy (the join),
report (terminal, JSON, HTML), runner (the levels), cli (the `bench` subcommand).
"""
