"""A chat template's loop over the messages, split out so that a conversation's next render
can reuse its last one. Pure: :func:`message_loop` reads a template's syntax tree.

Most chat templates are a *head* (the system prompt, the tools), one loop that renders each
message on its own, and a *tail* (the generation prompt). For such a template, a chat that
only appends messages to the last one renders as the last text without its tail, then the
new messages through the loop alone, then the tail: exactly the whole render, when

- the head reads ``messages`` only as ``messages[i]`` (a constant ``i``) or to bind the
  loop's sequence, ``messages`` or ``messages[k:]`` (a constant ``k``), so it is the same
  for both chats (they share their first messages and their variables);
- the loop (at the template's top level, no ``else``, no filter, not recursive) renders
  each message from the message, the template's variables and names it binds itself: no
  ``loop`` of its own (no ``loop.last``, no index), no ``break``, no name the head or tail
  binds (a namespace it updates, a macro), no ``messages``;
- the tail reads neither ``messages`` nor a name the head binds;
- nothing includes, imports or extends another template, and nothing reads the clock
  (``strftime_now``).

:func:`message_loop` returns None for any template that it cannot show to be of this form,
and the caller renders whole: the split is an optimisation, never a different text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from jinja2 import Environment, Template, nodes

TURNS = "kvpilot_turns"
"""The variable the split loop iterates (a name no template is allowed to use)."""
_REFUSED_NAMES = frozenset({"strftime_now", TURNS})
_REFUSED_NODES = (nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport, nodes.Block)


@dataclass(frozen=True, slots=True)
class MessageLoop:
    """A template's message loop and tail, each renderable alone (module doc)."""

    loop: Template
    """Renders its ``kvpilot_turns`` messages as the template's loop renders them."""
    tail: Template
    """Renders what the template renders after its loop."""
    min_messages: int
    """The fewest messages a chat must have for its head to be the same in a longer chat
    that starts with them (the head's highest ``messages[i]`` or ``messages[k:]``)."""


def _with_parents(node: nodes.Node, parent: nodes.Node | None = None) -> Iterator[tuple[nodes.Node, nodes.Node | None]]:
    yield node, parent
    for child in node.iter_child_nodes():
        yield from _with_parents(child, node)


def _all(body: list[nodes.Node]) -> Iterator[tuple[nodes.Node, nodes.Node | None]]:
    for node in body:
        yield from _with_parents(node)


def _names(body: list[nodes.Node], ctx: str) -> set[str]:
    return {n.name for n, _ in _all(body) if isinstance(n, nodes.Name) and n.ctx == ctx}


def _bound(body: list[nodes.Node]) -> set[str]:
    """Every name ``body`` binds: assigned, looped, a namespace it sets, a macro it defines."""
    names = _names(body, "store") | _names(body, "param")
    names |= {n.name for n, _ in _all(body) if isinstance(n, (nodes.NSRef, nodes.Macro))}
    return names


def _own_loop_free(body: list[nodes.Node]) -> bool:
    """Whether ``body`` (a loop's) reads its own ``loop`` nowhere and never breaks out of it
    (what a nested loop does with its own is its own)."""
    for node in body:
        if isinstance(node, nodes.For):  # its iter, test and else still belong to the outer loop
            if not _own_loop_free([node.iter, *node.else_] + ([node.test] if node.test else [])):
                return False
            continue
        if isinstance(node, nodes.Break) or (isinstance(node, nodes.Name) and node.name == "loop"):
            return False
        if not _own_loop_free(list(node.iter_child_nodes())):
            return False
    return True


def _views(head: list[nodes.Node]) -> tuple[dict[int, int], set[str]] | None:
    """The head's reads of ``messages`` that keep it the same in a longer chat (by the read
    Name node's id: how many messages it needs), and the names bound to the loop's sequence;
    None if it reads ``messages`` otherwise or also binds such a name to anything else."""
    allowed: dict[int, int] = {}
    views: set[str] = set()
    targets: set[int] = set()
    for node, _ in _all(head):
        if not isinstance(node, nodes.Assign) or not isinstance(node.target, nodes.Name):
            continue
        value = node.node
        if isinstance(value, nodes.Name) and value.name == "messages":
            allowed[id(value)] = 0
        elif (
            isinstance(value, nodes.Getitem)
            and isinstance(value.node, nodes.Name)
            and value.node.name == "messages"
            and isinstance(value.arg, nodes.Slice)
            and value.arg.stop is None
            and value.arg.step is None
            and (start := 0 if value.arg.start is None else _const_index(value.arg.start)) is not None
        ):
            allowed[id(value.node)] = start
        else:
            continue
        views.add(node.target.name)
        targets.add(id(node.target))
    for node, parent in _all(head):
        if isinstance(node, nodes.Name) and node.name == "messages" and id(node) not in allowed:
            index = _const_index(parent.arg) if isinstance(parent, nodes.Getitem) and parent.node is node else None
            if index is not None:
                allowed[id(node)] = index + 1
            else:
                return None
        if isinstance(node, nodes.Name) and node.ctx == "store" and node.name in views and id(node) not in targets:
            return None
    return allowed, views


def _const_index(node: nodes.Node) -> int | None:
    if isinstance(node, nodes.Const) and type(node.value) is int and node.value >= 0:
        return node.value
    return None


def message_loop(env: Environment, source: str) -> MessageLoop | None:
    """``source``'s message loop and tail compiled in ``env``, or None (module doc)."""
    root = env.parse(source)
    refused = any(True for _ in root.find_all(_REFUSED_NODES))
    if refused or _REFUSED_NAMES & (_names(root.body, "load") | _bound(root.body)):
        return None
    candidates = [
        k for k, node in enumerate(root.body) if isinstance(node, nodes.For) and isinstance(node.iter, nodes.Name)
    ]
    for k in candidates:
        head, loop, tail = root.body[:k], root.body[k], root.body[k + 1 :]
        assert isinstance(loop, nodes.For) and isinstance(loop.iter, nodes.Name)
        found = _views(head)
        if found is None:
            return None
        allowed, views = found
        if loop.iter.name not in views | {"messages"}:
            continue
        return _split(env, source, k, head, loop, tail, allowed, views)
    return None


def _split(
    env: Environment,
    source: str,
    k: int,
    head: list[nodes.Node],
    loop: nodes.For,
    tail: list[nodes.Node],
    allowed: dict[int, int],
    views: set[str],
) -> MessageLoop | None:
    if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
        return None
    outer = _bound(head) | _bound(tail) | views | {"messages"}
    if _names(loop.body, "load") & outer or _bound(loop.body) & (outer - {loop.target.name}):
        return None
    if not _own_loop_free(loop.body):
        return None
    if _names(tail, "load") & (_bound(head) | views | {"messages"}):
        return None
    if _names(head, "load") & views:
        return None
    # compiled from fresh trees: jinja2's compiler may rewrite the nodes it is given
    fresh = env.parse(source).body
    fresh_loop = fresh[k]
    assert isinstance(fresh_loop, nodes.For) and isinstance(fresh_loop.target, nodes.Name)
    looped = nodes.For(
        nodes.Name(fresh_loop.target.name, "store"), nodes.Name(TURNS, "load"), fresh_loop.body, [], None, False
    )
    loop_tree = nodes.Template([looped], lineno=1)
    loop_tree.set_environment(env)
    tail_tree = nodes.Template(env.parse(source).body[k + 1 :], lineno=1)
    tail_tree.set_environment(env)
    return MessageLoop(env.from_string(loop_tree), env.from_string(tail_tree), max([1, *allowed.values()]))
