"""How kvpilot runs: the tiny offline model, the local CPU fleet, the demo, the CLI.

GPU and Dynamo recipes live beside this package as Markdown (``deploy/gpu.md``).
"""
