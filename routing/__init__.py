"""kvpilot's router: an OpenAI-compatible HTTP front that sends each request to a
prefill engine, then a decode engine (or to one co-located engine), with token ids.

Imports and runs without vLLM installed.
"""
