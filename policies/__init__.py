"""kvpilot's pure decision logic: a roofline cost model and the policies built on it.

- :mod:`policies.specs`, :mod:`policies.presets`: model / KV format / hardware / link
  specs, presets, and parsers for HF ``config.json`` and YAML/JSON documents.
- :mod:`policies.roofline`: KV bytes, prefill and decode pass times, capacity.
- :mod:`policies.recompute_vs_transfer` (+ :mod:`policies.scenarios`): section 9.3.
- :mod:`policies.disaggregation`: local vs remote prefill (section 7).
- :mod:`policies.failure`: what D does when a KV load fails (section 8.6).
- :mod:`policies.session_tier`: where session KV waits between turns (section 5.3).
- :mod:`policies.planner`: P and D pool sizing (sections 5.1, 10.1).
- :mod:`policies.cli`: ``kvpilot cost`` / ``kvpilot plan``, the only module doing I/O.

Nothing here imports vLLM, ``kvconnectors`` or ``routing``, reads a clock, or draws
random numbers.

Citations: "the article" is the reference article "KV, Prefix, and Session Caching
in Co-located and Disaggregated LLM Serving", kvpilot's specification; "article
section 9.2" cites its section by number.
"""

from policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec, SpecError

__all__ = ["HardwareSpec", "KVFormat", "LinkSpec", "ModelSpec", "SpecError"]
