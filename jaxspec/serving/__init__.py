"""Serving: continuous batching over a fixed number of slots, behind an OpenAI-compatible HTTP API.

slots.py (the batched per-slot state and how a prefilled prompt enters a slot), slot_cycle.py (one cycle over
every slot with per-slot sampling, and the device loop of a few cycles), slot_engine.py (the compiled programs
and the device state), scheduler.py (requests, queue, admission, the engine thread), stop.py (stop strings), assistant_output.py (a chat
answer split into reasoning, content and tool calls, over kimi_tool_calls.py and reasoning.py), kimi_tool_declaration.py (K2.5's tools as TypeScript),
protocol.py (OpenAI request fields), metrics.py (Prometheus counters), app.py (the ASGI app),
background.py (the server in a thread, for tests and benchmarks).
"""
