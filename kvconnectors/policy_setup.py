"""Build the pull policy of one engine from its own vLLM config.

The roofline policy needs the model, its KV format, the hardware P runs on and a
link prior. By default each comes from the engine itself: the model from its
Hugging Face config, the KV format from its cache dtype, the hardware from the
platform (a CPU engine's bound cores, or the GPU's name times the tensor-parallel
size), the link prior from the platform (NIXL over loopback on a CPU box, RDMA on
GPUs). ``policy_model``, ``policy_hardware`` and ``policy_link`` override them by
preset name. The link prior stands until the engine has measured its own NIXL
transfers (see :class:`kvpilot.kvconnectors.pull_policy.LinkMeter`); the hardware (with the
model) prices recomputing only until the engine has timed
:data:`~kvpilot.policies.measured_fit.MIN_SAMPLES` of its own steps
(:mod:`kvpilot.kvconnectors.step_rates`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvpilot.kvconnectors.config import RECOMPUTE_THRESHOLD_KEY, KVPilotConfig
from kvpilot.kvconnectors.pull_policy import PullPolicy, RecomputePolicy, RooflinePullPolicy, ThresholdPullPolicy
from kvpilot.policies.measured_fit import MIN_SAMPLES
from kvpilot.policies.presets import (
    GPUS,
    hardware_preset,
    kv_format_preset,
    link_preset,
    model_from_hf_config,
    model_preset,
)
from kvpilot.policies.recompute_vs_transfer import VLLM_RECOMPUTE_BELOW_TOKENS, RecomputeVsTransferPolicy
from kvpilot.policies.specs import HardwareSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("kvpilot.connector")
_FALLBACK_GPU = "h100"


def cpu_cores(bind: str | None) -> int:
    """Cores named by ``VLLM_CPU_OMP_THREADS_BIND`` (``"0"``, ``"0-3"``, ``"0,2"``,
    ``"0-1|2-3"`` for several ranks: the first); the machine's count otherwise."""
    first_rank = (bind or "").split("|")[0]
    cores = 0
    for part in filter(None, first_rank.split(",")):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return os.cpu_count() or 1
        cores += int(high) - int(low) + 1 if high else 1
    return cores or os.cpu_count() or 1


def engine_hardware(vllm_config: VllmConfig) -> HardwareSpec:
    """The hardware this engine runs on, as a preset: ``cpux<cores>`` or ``<gpu>x<tp>``."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return hardware_preset(f"cpux{cpu_cores(os.environ.get('VLLM_CPU_OMP_THREADS_BIND'))}")
    device = current_platform.get_device_name().lower()
    gpu = next((name for name in GPUS if name != "cpu" and name in device), None)
    if gpu is None:
        logger.warning(
            "kvpilot: no hardware preset for %r; the pull policy assumes %s (set policy_hardware)",
            device,
            _FALLBACK_GPU,
        )
        gpu = _FALLBACK_GPU
    return hardware_preset(f"{gpu}x{vllm_config.parallel_config.tensor_parallel_size}")


def build_pull_policy(vllm_config: VllmConfig, config: KVPilotConfig) -> PullPolicy:
    """The policy that decides this engine's session pulls (see :mod:`kvpilot.kvconnectors.config`)."""
    if config.recompute_policy is RecomputePolicy.THRESHOLD:
        threshold = config.inner_extra_config.get(RECOMPUTE_THRESHOLD_KEY, VLLM_RECOMPUTE_BELOW_TOKENS)
        return ThresholdPullPolicy(int(threshold))
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if config.policy_model:
        model = model_preset(config.policy_model)
    else:
        served = model_config.served_model_name
        name = served[0] if isinstance(served, list) and served else served
        model = model_from_hf_config(
            model_config.hf_config.to_dict(), str(name or "model"), "the engine's model config"
        )
    fmt = kv_format_preset("fp8" if vllm_config.cache_config.cache_dtype.startswith("fp8") else "bf16")
    hardware = hardware_preset(config.policy_hardware) if config.policy_hardware else engine_hardware(vllm_config)
    link = link_preset(config.policy_link or ("loopback" if current_platform.device_type == "cpu" else "rdma"))
    logger.info(
        "kvpilot: session pulls decided by the roofline policy: model %s, %s KV, hardware %s (until %d of "
        "this engine's steps are timed), link prior %s",
        model.name,
        fmt.name,
        hardware.name,
        MIN_SAMPLES,
        link.name,
    )
    return RooflinePullPolicy(RecomputeVsTransferPolicy(model, fmt, hardware, link))
