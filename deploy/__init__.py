"""How kvpilot runs: the tiny offline model, the local CPU fleet, the demo, the CLI.

GPU and Dynamo recipes live beside this package as Markdown (``docs/guides/gpu.md``).

Citations: "the article" is the reference article "KV, Prefix, and Session Caching
in Co-located and Disaggregated LLM Serving", kvpilot's specification; "article
section 9.2" cites its section by number.
"""
