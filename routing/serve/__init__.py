"""The HTTP front: the aiohttp app and its handlers (``app``), the P->D proxy that
serves one :class:`~kvpilot.routing.decide.router.Route` behind the upstream interface
(``proxy``), the engines' HTTP calls (``upstream``), admission control
(``admission``), what a client may send (``request_fields``), prompts and chat
(``tokenizer``, ``chat``).
"""
