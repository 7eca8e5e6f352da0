"""The global block index, pure: block naming (``chain``), the engines' KV-event wire
format (``events``), the :class:`~kvpilot.routing.index.kvindex.KVIndex` protocol and its
shared event dispatch (``kvindex``), kvpilot's backend (``block_index``) and Dynamo's
``RadixTree`` behind the same protocol (``dynamo``, needs ``ai-dynamo-runtime``).
"""
