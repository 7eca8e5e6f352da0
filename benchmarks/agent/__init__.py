"""The agent workload: the reference article's coding agent served five ways on vLLM-CPU engines
(``bench_agent.py``), and written as a Mooncake trace for fleet runs (``make_agent_trace.py``)."""
