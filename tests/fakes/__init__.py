"""What the tests share instead of writing it again: one fake per external system,
each with knobs and a record of the calls it got, used only where the real one cannot
run in a test (where it runs on this box, as vLLM's scheduler and NixlConnector's
scheduler side do, tests use the real one); and the loopback ports the e2e modules
divide between them. Tests import these as ``tests.fakes.<module>``; kvpilot itself
never does."""
