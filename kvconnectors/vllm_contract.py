"""What ``KVPilotConnector`` relies on in vLLM, stated as data, and a check of a vLLM
source tree against it.

:data:`CONTRACT` (in :mod:`kvpilot.kvconnectors.vllm_seams`) names every seam kvpilot
touches: the ``KVConnectorBase_V1`` methods the connector overrides and forwards (with their
parameters), the ``NixlConnector`` it wraps (found through vLLM's connector registry, as
vLLM finds it), the vLLM objects it reads (request, scheduler output, connector output,
configs), the NIXL ``kv_transfer_params`` fields and extra-config keys, the KV-event structs
the router decodes, the hash function the block-hash contract mirrors, the metric names the
dashboards read, and where vLLM's OpenAI answers carry ``kv_transfer_params`` (the whole
answers; the router withholds it from clients and keeps D's offer, from a stream chunk too
where a release streams it). :func:`check` reads a vLLM tree with
:mod:`kvpilot.kvconnectors.vllm_source` (``ast`` only: no vLLM import, so any version can be
checked on any box) and returns one :class:`Violation` per seam that moved.

A wrapper has one more way to break: vLLM adds a method to ``KVConnectorBase_V1``
that ``NixlConnector`` overrides. ``KVPilotConnector`` does not forward it, so vLLM
gets the base class's default instead of NIXL's answer. :func:`check` reports every
such method, except those :attr:`Wrapped.inherited` names with the reason the
default is right for kvpilot.

``python -m kvpilot.kvconnectors.vllm_contract [ROOT]`` checks the vLLM under ``ROOT``
(the folder holding ``vllm/``; default: the installed one) and prints one line, then
each violation; exit status 1 if there is any. ``scripts/compat.sh`` (``make compat``)
runs it over each vLLM release the ``gpu`` extra allows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvpilot.kvconnectors.vllm_seams import (
    CONTRACT,
    ClassSeam,
    Contract,
    FunctionSeam,
    Literals,
    Method,
    Violation,
    Wrapped,
)
from kvpilot.kvconnectors.vllm_source import SourceTree, parameters

__all__ = [
    "CONTRACT",
    "ClassSeam",
    "Contract",
    "FunctionSeam",
    "Literals",
    "Method",
    "Violation",
    "Wrapped",
    "check",
]


def _compare_params(seam: str, want: tuple[str, ...], got: tuple[str, ...], version: str) -> list[Violation]:
    problems = [f"parameter {p!r} missing in vLLM {version}" for p in want if p not in got]
    problems += [f"new parameter {p!r} in vLLM {version}" for p in got if p not in want]
    if not problems and want != got:
        problems.append(f"parameters reordered in vLLM {version}: ({', '.join(got)}), expected ({', '.join(want)})")
    return [Violation(seam, p) for p in problems]


def _check_class(tree: SourceTree, seam: ClassSeam, version: str) -> list[Violation]:
    cls = tree.find_class(seam.module, seam.name)
    if cls is None:
        return [Violation(f"{seam.module}.{seam.name}", f"class not found in vLLM {version}")]
    violations: list[Violation] = []
    for method in seam.methods:
        name = f"{seam.name}.{method.name}"
        found = tree.lookup(cls, method.name)
        if found is None and not _before(version, method.since):
            violations.append(Violation(name, f"missing in vLLM {version}"))
        elif found is None:
            continue
        elif found[1].kind != method.kind:
            violations.append(Violation(name, f"a {found[1].kind} in vLLM {version}, expected a {method.kind}"))
        else:
            violations += _compare_params(name, method.params, found[1].params, version)
    violations += [
        Violation(f"{seam.name}.{attr}", f"attribute missing in vLLM {version}")
        for attr in seam.attributes
        if tree.lookup(cls, attr) is None
    ]
    keywords = tree.class_keywords(cls)
    violations += [
        Violation(seam.name, f"class keyword {key}={keywords.get(key)!r} in vLLM {version}, expected {value!r}")
        for key, value in seam.keywords
        if keywords.get(key) != value
    ]
    return violations


def _before(version: str, since: str) -> bool:
    """Whether vLLM ``version`` is older than ``since`` (empty: no version is)."""
    if not since:
        return False
    try:
        return Version(version) < Version(since)
    except InvalidVersion:
        return False


def _check_function(tree: SourceTree, seam: FunctionSeam, version: str) -> list[Violation]:
    fn = tree.function(seam.module, seam.name)
    if fn is None:
        return [Violation(f"{seam.module}.{seam.name}", f"function not found in vLLM {version}")]
    return _compare_params(seam.name, seam.params, parameters(fn, bound=False), version)


def _check_wrapped(tree: SourceTree, contract: Contract, version: str) -> list[Violation]:
    """The wrapped connector is registered and found, kvpilot accepts every
    extra-config key it reads, and no base method it overrides goes unforwarded."""
    wrapped = contract.wrapped
    registered = tree.registrations(wrapped.factory, "register_connector").get(wrapped.name)
    if registered is None:
        return [Violation(wrapped.name, f"not registered in {wrapped.factory} in vLLM {version}")]
    inner = tree.find_class(*registered)
    base_seam = next(c for c in contract.classes if c.name == wrapped.base)
    base = tree.find_class(base_seam.module, base_seam.name)
    if inner is None or base is None:
        return [Violation(wrapped.name, f"{'.'.join(registered)} not found in vLLM {version}")]
    package = registered[0]
    violations = [
        Violation(
            f"{wrapped.name} extra config",
            f"vLLM {version} reads key {key!r}, which KVPilotConfig refuses (config.NIXL_KEYS)",
        )
        for key in sorted(tree.call_literals(package, wrapped.config_getter) - wrapped.accepted_keys)
    ]
    known = {m.name for m in base_seam.methods} | {name for name, _ in wrapped.inherited}
    for name, (owner, _member) in sorted(tree.members(base).items()):
        if owner.node is not base.node or name in known or name.startswith("_") or _member.kind == "attribute":
            continue
        found = tree.lookup(inner, name)
        if found is not None and found[0].node is not base.node:
            violations.append(
                Violation(
                    f"{wrapped.base}.{name}",
                    f"new in vLLM {version} and overridden by {found[0].name} ({found[0].module}); "
                    f"KVPilotConnector does not forward it, so vLLM gets the base class's default",
                )
            )
    return violations


def check(tree: SourceTree, contract: Contract = CONTRACT) -> list[Violation]:
    """Every seam of ``contract`` that ``tree``'s vLLM breaks; empty if none. Reads
    files only."""
    version = tree.version()
    violations: list[Violation] = []
    for seam in contract.classes:
        violations += _check_class(tree, seam, version)
    for fn in contract.functions:
        violations += _check_function(tree, fn, version)
    violations += [
        Violation(f"{module}.{name}", f"not defined in vLLM {version}")
        for module, name in contract.symbols
        if not tree.defines(module, name)
    ]
    for group in contract.literals:
        present = tree.string_literals(group.module)
        violations += [
            Violation(group.module, f"{group.what} {value!r} no longer appears in vLLM {version}")
            for value in group.values
            if value not in present
        ]
    violations += [
        Violation(name, f"metric name not found in vLLM {version}'s source")
        for name in contract.metrics
        if not tree.contains_text(f'"{name}"')
    ]
    return violations + _check_wrapped(tree, contract, version)


def installed_root() -> Path:
    """The folder holding the installed ``vllm`` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("root", nargs="?", type=Path, help="folder holding vllm/ (default: the installed vLLM)")
    args = parser.parse_args(argv)
    tree = SourceTree(args.root or installed_root())
    violations = check(tree)
    verdict = "pass" if not violations else f"FAIL ({len(violations)} violations)"
    print(f"vllm {tree.version()}: {verdict}")
    for violation in violations:
        print(f"  - {violation}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
