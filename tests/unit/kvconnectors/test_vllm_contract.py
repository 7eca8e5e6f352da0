"""The vLLM contract: the installed vLLM meets it; each kind of break is reported
(shown on deliberately wrong contracts and on a small fake vLLM tree); and the
contract states what kvpilot's own code relies on (KVPilotConnector's overrides,
the KV-event fields the router's decoder requires)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from textwrap import dedent

import msgspec
import pytest

from kvpilot.kvconnectors import vllm_contract as vc
from kvpilot.kvconnectors.vllm_source import SourceTree, parameters
from kvpilot.routing.index import events

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def installed() -> SourceTree:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    return SourceTree(vc.installed_root())


def _seam(name: str) -> vc.ClassSeam:
    return next(c for c in vc.CONTRACT.classes if c.name == name)


def _with_class(seam: vc.ClassSeam) -> vc.Contract:
    """CONTRACT with the class seam of the same name replaced by ``seam``."""
    classes = tuple(seam if c.name == seam.name and c.module == seam.module else c for c in vc.CONTRACT.classes)
    return dataclasses.replace(vc.CONTRACT, classes=classes)


def _problems(tree: SourceTree, contract: vc.Contract) -> list[str]:
    return [str(v) for v in vc.check(tree, contract)]


def test_the_installed_vllm_meets_the_contract(installed: SourceTree) -> None:
    assert [str(v) for v in vc.check(installed)] == []


def test_a_renamed_parameter_is_reported(installed: SourceTree) -> None:
    base = _seam("KVConnectorBase_V1")
    methods = tuple(
        dataclasses.replace(m, params=("request", "num_tokens")) if m.name == "get_num_new_matched_tokens" else m
        for m in base.methods
    )
    version = installed.version()
    assert _problems(installed, _with_class(dataclasses.replace(base, methods=methods))) == [
        f"KVConnectorBase_V1.get_num_new_matched_tokens: parameter 'num_tokens' missing in vLLM {version}",
        f"KVConnectorBase_V1.get_num_new_matched_tokens: new parameter 'num_computed_tokens' in vLLM {version}",
    ]


def test_a_missing_method_a_wrong_kind_and_a_missing_attribute_are_reported(installed: SourceTree) -> None:
    base = _seam("KVConnectorBase_V1")
    broken = dataclasses.replace(
        base,
        methods=(
            *base.methods,
            vc.Method("get_num_new_matched_blocks", ("request",)),
            vc.Method("shutdown", kind="property"),
        ),
    )
    request = dataclasses.replace(_seam("Request"), attributes=("block_hashes", "block_digests"))
    contract = dataclasses.replace(_with_class(broken), classes=(*_with_class(broken).classes, request))
    version = installed.version()
    assert set(_problems(installed, contract)) == {
        f"KVConnectorBase_V1.get_num_new_matched_blocks: missing in vLLM {version}",
        f"KVConnectorBase_V1.shutdown: a method in vLLM {version}, expected a property",
        f"Request.block_digests: attribute missing in vLLM {version}",
    }


def test_missing_literals_metrics_symbols_and_struct_options_are_reported(installed: SourceTree) -> None:
    nixl = vc.CONTRACT.literals[0]
    contract = dataclasses.replace(
        vc.CONTRACT,
        classes=(*vc.CONTRACT.classes, dataclasses.replace(_seam("BlockStored"), keywords=(("array_like", True),))),
        literals=(dataclasses.replace(nixl, values=("do_remote_prefill", "remote_block_hashes")),),
        metrics=("vllm:nixl_xfer_time_seconds", "vllm:nixl_xfer_seconds"),
        symbols=(("vllm.v1.core.kv_cache_utils", "NONE_HASH"), ("vllm.v1.core.kv_cache_utils", "NO_HASH")),
    )
    version = installed.version()
    assert _problems(installed, contract) == [
        f"BlockStored: class keyword array_like=None in vLLM {version}, expected True",
        f"vllm.v1.core.kv_cache_utils.NO_HASH: not defined in vLLM {version}",
        f"{nixl.module}: kv_transfer_params field 'remote_block_hashes' no longer appears in vLLM {version}",
        f"vllm:nixl_xfer_seconds: metric name not found in vLLM {version}'s source",
    ]


FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/kv/__init__.py": "",
    "vllm/kv/base.py": """
        class KVConnectorBase_V1(ABC):
            def __init__(self, vllm_config, role, kv_cache_config): ...
            def request_finished(self, request, block_ids): ...
            def new_seam(self, request): ...
            def new_but_default_is_fine(self): ...
            @classmethod
            def deliberately_inherited(cls, config): ...
        """,
    "vllm/kv/factory.py": """
        KVConnectorFactory.register_connector("NixlConnector", "vllm.kv.nixl", "NixlConnector")
        """,
    "vllm/kv/nixl/__init__.py": "from vllm.kv.nixl.connector import NixlConnector\n",
    "vllm/kv/nixl/connector.py": """
        from vllm.kv.base import KVConnectorBase_V1

        class NixlPullConnector(KVConnectorBase_V1):
            def __init__(self, vllm_config, role, kv_cache_config):
                self.backends = config.get_from_extra_config("backends", ["UCX"])
                self.params = config.get_from_extra_config("new_key", {})
            def new_seam(self, request): ...
            @classmethod
            def deliberately_inherited(cls, config): ...

        NixlConnector = NixlPullConnector
        """,
}


@pytest.fixture
def fake_vllm(tmp_path: Path) -> SourceTree:
    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(dedent(text))
    return SourceTree(tmp_path)


def _fake_contract(inherited: tuple[tuple[str, str], ...]) -> vc.Contract:
    api = (
        vc.Method("__init__", ("vllm_config", "role", "kv_cache_config")),
        vc.Method("request_finished", ("request", "block_ids")),
    )
    return vc.Contract(
        classes=(
            vc.ClassSeam("vllm.kv.base", "KVConnectorBase_V1", api),
            vc.ClassSeam("vllm.kv.nixl", "NixlConnector", api[:1]),
        ),
        functions=(),
        symbols=(),
        literals=(),
        metrics=(),
        wrapped=vc.Wrapped(
            "NixlConnector",
            "vllm.kv.factory",
            "KVConnectorBase_V1",
            "get_from_extra_config",
            frozenset({"backends"}),
            inherited,
        ),
    )


def test_a_new_base_method_the_inner_connector_overrides_is_reported(fake_vllm: SourceTree) -> None:
    """Through the registry, the package's re-export and the alias, as vLLM finds it;
    a new base method NIXL leaves alone, or one the contract inherits on purpose, is not."""
    assert _problems(fake_vllm, _fake_contract((("deliberately_inherited", "why"),))) == [
        "NixlConnector extra config: vLLM 9.9.9 reads key 'new_key', which KVPilotConfig refuses (config.NIXL_KEYS)",
        (
            "KVConnectorBase_V1.new_seam: new in vLLM 9.9.9 and overridden by NixlPullConnector "
            "(vllm.kv.nixl.connector); KVPilotConnector does not forward it, so vLLM gets the base class's default"
        ),
    ]
    assert len(_problems(fake_vllm, _fake_contract(()))) == 3


def test_an_unregistered_inner_connector_is_reported(fake_vllm: SourceTree) -> None:
    contract = _fake_contract(())
    contract = dataclasses.replace(contract, wrapped=dataclasses.replace(contract.wrapped, name="NixlPushConnector"))
    assert _problems(fake_vllm, contract) == ["NixlPushConnector: not registered in vllm.kv.factory in vLLM 9.9.9"]


def _kvpilot_connector_methods() -> dict[str, tuple[str, tuple[str, ...]]]:
    """KVPilotConnector's public methods as connector.py defines them: kind, parameters."""
    tree = ast.parse((REPO / "kvconnectors" / "connector.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVPilotConnector")
    found: dict[str, tuple[str, tuple[str, ...]]] = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and (fn.name == "__init__" or not fn.name.startswith("_")):
            decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
            kind = next((k for k in ("property", "classmethod") if k in decorators), "method")
            found[fn.name] = (kind, parameters(fn, bound=True))
    return found


def test_the_contract_lists_every_override_of_kvpilot_connector() -> None:
    """A method added to KVPilotConnector, or a changed signature, must be added to the
    contract too, or the check would not watch it."""
    ours = _kvpilot_connector_methods()
    ours.pop("inner")  # kvpilot's own property
    stated = {
        m.name: (m.kind, m.params)
        for s in vc.CONTRACT.classes
        if s.name in ("KVConnectorBase_V1", "SupportsHMA")
        for m in s.methods
    }
    assert {name: stated.get(name) for name in ours} == ours


@pytest.mark.parametrize("struct", [events.BlockStored, events.BlockRemoved, events.AllBlocksCleared])
def test_the_contract_checks_every_field_the_routers_decoder_requires(struct: type[msgspec.Struct]) -> None:
    name = struct.__name__
    required = {f.name for f in msgspec.structs.fields(struct) if f.required}
    assert required <= set(_seam(name).attributes)
    assert set(_seam(name).attributes) <= {f.name for f in msgspec.structs.fields(struct)}
