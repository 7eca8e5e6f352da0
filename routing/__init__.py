"""kvpilot's router: an OpenAI-compatible HTTP front that sends each request to a
prefill engine, then a decode engine (or to one co-located engine), with token ids;
and the same decision as Envoy's endpoint picker, Envoy carrying the streams.
Imports and runs without vLLM installed (no vLLM import anywhere in this package).

Packages, pure first (nothing in a pure package imports an I/O one):

- ``ids`` (worker, tier, session and pair names), ``config`` (the typed config and
  its flags), ``fleet`` (the workers by role) and ``refusals`` (why a request is
  refused): shared by everything below;
- ``index/`` (pure): block naming, KV-event decoding, the ``KVIndex`` protocol,
  kvpilot's backend and Dynamo's ``RadixTree`` behind it;
- ``decide/`` (pure): Dynamo's cost, the load ledger, sessions and D's offers, the
  decision (pair, local or remote prefill, the five session options);
- ``health/`` (pure, the clock passed in): circuits, KV-event watch, pair health;
- ``ingest/`` (I/O, threads and tasks): the ZMQ subscriber, the index feeder, the
  engines' ``/metrics`` poller;
- ``serve/`` (I/O): the aiohttp app, the P->D proxy behind the upstream interface,
  the engines' HTTP calls, admission, request fields, tokenizer and chat;
- ``metrics/``: the router's Prometheus series and each component's collector;
- ``gateway/`` (I/O): the endpoint picker behind Envoy (Envoy's ext_proc and its
  OpenTelemetry access log over gRPC): the router's decision for requests whose streams
  Envoy carries;
- ``core`` (the composition root): ``RouterCore`` builds the index, the health records,
  the router, the lifecycle and the intake once, from the config, the fleet and a clock;
  the HTTP app, the picker's gRPC service and the simulator each take one;
- ``cli`` (``kvpilot router``).

Block naming: llm-d style, not the engines' hashes
--------------------------------------------------
The router recomputes its own chain from the ``token_ids`` in every
``BlockStored`` event and keeps, per worker, a map from the engine's block hash
to its own key (and position) so ``BlockRemoved`` can be applied. Block ``i``
of a chain is named ``key_i = key_{i-1} XOR mix(i, tokens_i)``
(:mod:`kvpilot.routing.index.chain`: a per-process random multilinear hash with a 64-bit
finalizer, 60-bit keys, vectorized with numpy, never sent anywhere). Why:

- speed: vLLM's own names (``kvpilot.kvconnectors.hash_contract``: pickle + SHA-256 or
  XXH3-128 per block in Python) cost a Python call and a cryptographic or 128-bit hash
  per block; this naming is a few numpy passes over the whole prompt, and runs only as
  far as the match goes (``benchmarks/bench_router_index.py`` compares it with Dynamo's
  ``compute_block_hash_for_seq``);
- independence: the engines' ``prefix_caching_hash_algo`` and
  ``PYTHONHASHSEED`` do not matter (xxhash engines without a shared seed work).

Isolation does not rest on the hash: each namespace ``(lora_name?,
cache_salt?)`` (block 0's extra keys as vLLM publishes them) is a separate
dictionary, so a request never earns credit for another salt's blocks. Within
one namespace a collision (60-bit keys, random lanes per process) only
misroutes: engines and the connector verify by content. Blocks with multimodal
or prompt-embedding extra keys are named with them, so text prompts never
match them.

Sessions: a chain is extendable (only new blocks are named) and keeps the
index's last match; the index logs removals so the next match looks only at
what changed (see ``BlockIndex.match``).

Citations: "the article" is the reference article "KV, Prefix, and Session Caching
in Co-located and Disaggregated LLM Serving", kvpilot's specification; "article
section 9.2" cites its section by number.
"""
