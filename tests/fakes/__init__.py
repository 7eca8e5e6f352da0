"""The shared test doubles: one fake per external system that cannot run in a test,
each with knobs and a record of the calls it got. Tests import them from here
(``from fakes.inner_connector import ...``; pytest puts ``tests/`` on the path)
rather than keeping copies of their own.

A fake stands in only where nothing real can run: where the real thing runs on
this box (vLLM's scheduler, NixlConnector's scheduler side), tests use the real one.
"""
