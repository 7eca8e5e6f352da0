"""An example: Dynamo's operator runs the workers and its frontend in direct mode, and
kvpilot's router routes in front of it (docs/guides/dynamo.md, docs/guides/gpu.md).

The ``DynamoGraphDeployment`` (``nvidia.com/v1alpha1``) has a frontend and
``dynamo.vllm`` prefill and decode workers whose ``--kv-transfer-config`` is the P/D
fleet's engines' (:func:`kvpilot.deploy.k8s.plan.plan_cluster`) under the name Dynamo's
handoff table knows (:func:`dynamo_kv_transfer_config`: ``NixlConnector`` loaded from
``kvpilot.kvconnectors.dynamo_nixl``, which vLLM resolves to KVPilotConnector) and whose KV
events bind :data:`KV_EVENTS_PORT` on every worker pod; beside it, the router's
Deployment, Service and config, reading the workers from Dynamo's Kubernetes discovery.

What has and has not run (docs/guides/dynamo.md, "Dynamo's vLLM workers"): this config
resolves to Dynamo 1.6.1's NIXL protocol and to KVPilotConnector in vLLM 0.32
(``tests/unit/kvconnectors/test_dynamo_seam.py``), and two vLLM 0.32 engines started with it
hand KV over through that protocol object, verified (``tests/e2e/test_dynamo_seam.py``). No
``dynamo.vllm`` worker has run: Dynamo 1.6.1 pins vLLM 0.31.0 and does not import beside vLLM
0.32 (``dynamo/vllm/embedding_worker_processes.py`` imports ``get_engine_zmq_addresses``),
while KVPilotConnector needs vLLM 0.32 to 0.34, so the image needs a Dynamo release built for
one of those.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import cast

from kvpilot.deploy.dynamo_spec import DynamoFleetSpec, router_config, router_plan
from kvpilot.deploy.env import HASH_SEED_ENV
from kvpilot.deploy.k8s.gateway import envoy_config_map, envoy_deployment, envoy_service
from kvpilot.deploy.k8s.objects import SIDE_CHANNEL_HOST_FROM_POD, Obj, env_list, meta, obj
from kvpilot.deploy.k8s.plan import (
    ALL_ADDRESSES,
    CONFIG_MOUNT,
    ENVOY_ADMIN_PORT,
    GATEWAY_PORT,
    MODELS_MOUNT,
    NAME,
    PICKER_PORT,
    PYTHON,
    ROUTER_API_KEY_ENV,
    ClusterPlan,
    RouterPod,
)
from kvpilot.deploy.k8s.workloads import router_config_map, router_deployment, router_service

GRAPH = NAME
"""The DynamoGraphDeployment's name; the operator names the frontend's Service after it."""
FRONTEND_PORT = 8000
"""The port Dynamo's operator gives the frontend's Service."""
KV_EVENTS_PORT = 20080
"""Every worker's vLLM KV events (one worker per pod): ``dynamo.kv_events_port``."""
WORKER_ROLES = {"VllmPrefillWorker": "prefill", "VllmDecodeWorker": "decode"}
"""Each worker service of the graph and its ``--disaggregation-mode``."""
DYNAMO_CONNECTOR_NAME = "NixlConnector"
"""The ``kv_connector`` name Dynamo's ``make_kv_connector_protocol`` maps to its NIXL protocol."""
DYNAMO_CONNECTOR_MODULE = "kvpilot.kvconnectors.dynamo_nixl"
"""Where vLLM finds the class of that name: KVPilotConnector (``kv_connector_module_path``)."""


def dynamo_kv_transfer_config(engine_config: str) -> str:
    """An engine's ``--kv-transfer-config`` (KVPilotConnector) as a ``dynamo.vllm`` worker
    must name it: ``NixlConnector`` from :data:`DYNAMO_CONNECTOR_MODULE`, the rest as it was.
    Dynamo 1.6.1 refuses the name ``KVPilotConnector`` on every prefill ("Unsupported
    kv_connector='KVPilotConnector' for PD")."""
    config = json.loads(engine_config)
    config["kv_connector"] = DYNAMO_CONNECTOR_NAME
    config["kv_connector_module_path"] = DYNAMO_CONNECTOR_MODULE
    return json.dumps({"kv_connector": config.pop("kv_connector"), **config})


def frontend_url() -> str:
    return f"http://{GRAPH}-frontend:{FRONTEND_PORT}"


def worker_args(plan: ClusterPlan, mode: str) -> list[str]:
    """``dynamo.vllm``'s flags: the P/D engines' model, block size, KV connector (named
    for Dynamo's handoff table: :func:`dynamo_kv_transfer_config`) and tensor-parallel size."""
    engine = plan.engines[0]
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}", "topic": ""}
    return [
        "--model",
        engine.model,
        "--served-model-name",
        plan.spec.served_model_name,
        "--disaggregation-mode",
        mode,
        "--block-size",
        str(plan.spec.block_size),
        "--kv-transfer-config",
        dynamo_kv_transfer_config(engine.flag("--kv-transfer-config")),
        "--kv-events-config",
        json.dumps(events),
        "--tensor-parallel-size",
        str(plan.spec.tensor_parallel_size),
    ]


def _container(plan: ClusterPlan, module: str, args: list[str], env: list[Obj]) -> Obj:
    return {
        "image": plan.spec.dynamo_image,
        "command": [PYTHON, "-m", module],
        "args": args,
        **({"env": env} if env else {}),
        "volumeMounts": [{"name": "models", "mountPath": str(MODELS_MOUNT), "readOnly": True}],
    }


def _pod(plan: ClusterPlan, container: Obj) -> Obj:
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": plan.spec.models_claim, "readOnly": True}}
    return {"mainContainer": container, "volumes": [volume]}


def graph(plan: ClusterPlan) -> Obj:
    model = str(MODELS_MOUNT / plan.spec.served_model_name)
    frontend_args = ["--router-mode", "direct", "--http-port", str(FRONTEND_PORT), "--model-path", model]
    services: Obj = {
        "Frontend": {
            "componentType": "frontend",
            "replicas": 1,
            "extraPodSpec": _pod(plan, _container(plan, "dynamo.frontend", frontend_args, [])),
        }
    }
    literal = {**HASH_SEED_ENV, **plan.engines[0].env}
    literal.pop("VLLM_NIXL_SIDE_CHANNEL_PORT")  # one worker per pod: NIXL's default port
    env = [SIDE_CHANNEL_HOST_FROM_POD, *env_list(literal, {}, "")]
    for service, mode in WORKER_ROLES.items():
        services[service] = {
            "componentType": "worker",
            "subComponentType": mode,
            "replicas": plan.spec.prefill if mode == "prefill" else plan.spec.decode,
            "resources": {"limits": {"gpu": str(plan.spec.tensor_parallel_size)}},
            "extraPodSpec": _pod(plan, _container(plan, "dynamo.vllm", worker_args(plan, mode), env)),
        }
    return obj(
        "nvidia.com/v1alpha1",
        "DynamoGraphDeployment",
        meta(GRAPH, plan.spec.namespace),
        spec={"backendFramework": "vllm", "services": services},
    )


def dynamo_router(plan: ClusterPlan) -> RouterPod:
    """The router in front of the frontend: the Dynamo fleet's router config, with
    Kubernetes discovery and the workers' fixed KV event port."""
    spec = DynamoFleetSpec(
        model_dir=MODELS_MOUNT / plan.spec.served_model_name,
        run_dir=CONFIG_MOUNT,
        prefill=1,
        decode=1,
        served_model_name=plan.spec.served_model_name,
        block_size=plan.spec.block_size,
        gateway_port=GATEWAY_PORT,  # Envoy in front (deploy/k8s/gateway.py), the router its picker
        picker_port=PICKER_PORT,
        envoy_admin_port=ENVOY_ADMIN_PORT,
    )
    config = router_config(spec)
    server = dict(cast(Mapping[str, object], config["server"]))
    config["server"] = {**server, "host": ALL_ADDRESSES, "api_key_env": ROUTER_API_KEY_ENV}
    dynamo = {k: v for k, v in cast(Mapping[str, object], config["dynamo"]).items() if not k.endswith("_port_offset")}
    dynamo |= {"frontend_url": frontend_url(), "discovery_backend": "kubernetes", "kv_events_port": KV_EVENTS_PORT}
    config["dynamo"] = dynamo
    local = router_plan(spec)
    return RouterPod(local, (PYTHON, *local.argv[1:]), (ROUTER_API_KEY_ENV,), (), config, PICKER_PORT)


def dynamo_example(plan: ClusterPlan) -> list[Obj]:
    """The graph, the router (its picker on), and the standalone Envoy in front of it."""
    router = dynamo_router(plan)
    spec = plan.spec
    envoy = [envoy_config_map(spec), envoy_deployment(spec), envoy_service(spec)]
    return [
        graph(plan),
        router_config_map(spec, router),
        router_deployment(plan.spec, router),
        router_service(spec, router),
        *envoy,
    ]
