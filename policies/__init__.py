"""kvpilot's pure decision logic: a roofline cost model and the policies built on it.

- :mod:`kvpilot.policies.specs`, :mod:`kvpilot.policies.presets`: model / KV format / hardware / link
  specs, presets, and parsers for HF ``config.json`` and YAML/JSON documents.
- :mod:`kvpilot.policies.roofline`: KV bytes, prefill and decode pass times, capacity.
- :mod:`kvpilot.policies.recompute_vs_transfer` (+ :mod:`kvpilot.policies.scenarios`): section 9.3.
- :mod:`kvpilot.policies.disaggregation`: local vs remote prefill (section 7).
- :mod:`kvpilot.policies.failure`: how the router recovers a request whose prefill on P failed (section 8.6).
- :mod:`kvpilot.policies.tier_credit`: what a block in a slower tier is worth to the router (section 5.3).
- :mod:`kvpilot.policies.session_hold`: whether D holds a session's KV for its next step (sections 5.3, 9.2).
- :mod:`kvpilot.policies.planner`: P and D pool sizing (sections 5.1, 10.1).
- :mod:`kvpilot.policies.cli`: ``kvpilot cost`` / ``kvpilot plan``, the only module doing I/O.

Nothing here imports vLLM, ``kvconnectors`` or ``routing``, reads a clock, or draws
random numbers.

Citations: "the article" is the reference article "KV, Prefix, and Session Caching
in Co-located and Disaggregated LLM Serving", kvpilot's specification; "article
section 9.2" cites its section by number.
"""

from kvpilot.policies.specs import HardwareSpec, KVFormat, LinkSpec, ModelSpec, SpecError

__all__ = ["HardwareSpec", "KVFormat", "LinkSpec", "ModelSpec", "SpecError"]
