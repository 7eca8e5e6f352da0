"""What the tests share instead of writing it again: one fake per external system,
used only where the real one cannot run in a test, and the loopback ports the e2e
modules divide between them. Tests import these as ``tests.fakes.<module>``;
kvpilot itself never does."""
