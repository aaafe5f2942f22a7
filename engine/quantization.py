"""Quantized checkpoints: which formats our engines may serve, and what vLLM's in-place reload of
them needs.

Engines start with dummy weights and are given theirs by vLLM's in-place reload, which quantizes
and repacks each layer again: a format is served only where that was checked against plain vLLM
on the same checkpoint (`RELOAD_VERIFIED`, tests/conformance/test_conformance_quantized.py), and
vLLM's online quantization of an unquantized checkpoint (`--quantization`) only by the methods
checked so (`ONLINE_VERIFIED`); any other is refused when the engine's configuration is made (and
again on vLLM's parsed arguments, engine/engine_args.py), never served unchecked.

An int8 W8A8 layer (compressed-tensors W8A8, served by vLLM's `CPUInt8ScaledMMLinearKernel`) is
processed, where the CPU has no AMX, into a oneDNN handle that keeps a copy of the packed weight
but only a pointer to the weight scales: the tensor `weight_scale` held when the handle was made
(vLLM's csrc/cpu/dnnl_kernels.cpp, `args.b_scales_ptr = b_scales.data_ptr<float>()`). vLLM's
layerwise reload (model_loader/reload/layerwise.py) processes a layer on fresh tensors, copies the
results into the parameters the layer had, puts those back and drops the fresh ones: the new
handle's scales are then freed memory, and the engine answers NaN (plain vLLM's own
`reload_weights` does the same, no pdcluster code involved: docs/conformance.md).
`keep_int8_handle_scales` makes every such handle keep the scales tensor it points at alive
(with the reloaded values: the same the layer's own parameter receives). Called once in each
worker process, before its first reload."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)
_KEPT = "_pdc_handle_scales"


def keep_int8_handle_scales() -> bool:
    """Patch vLLM's CPU int8 kernel so that each oneDNN handle's weight scales outlive a reload.
    Idempotent; False where this vLLM has no such kernel (nothing to patch)."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    except ImportError:
        return False
    process = getattr(CPUInt8ScaledMMLinearKernel, "process_weights_for_onednn", None)
    if process is None:
        logger.warning("vLLM's CPUInt8ScaledMMLinearKernel has no process_weights_for_onednn: "
                       "int8 checkpoints are not checked to reload in place")
        return False
    if getattr(process, "_pdc_keeps_scales", False):
        return True

    def process_weights_for_onednn(self, layer) -> None:
        process(self, layer)
        # The tensor the handle was just made with (its scales pointer); a reload puts another back.
        setattr(self, _KEPT, getattr(layer, self.layer_param_names[1]))

    process_weights_for_onednn._pdc_keeps_scales = True
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = process_weights_for_onednn
    return True


RELOAD_VERIFIED: dict[bool, frozenset[str]] = {
    True: frozenset({"compressed-tensors/int-quantized"}),  # the CPU build: int8 W8A8
    False: frozenset({"compressed-tensors/float-quantized"}),  # CUDA: FP8 W8A8 (llm-compressor's FP8_DYNAMIC), the H200
}
"""Per build (CPU build or not), the checkpoint formats ("quant_method/format") whose in-place
reload was checked to answer as plain vLLM does."""

ONLINE_VERIFIED: dict[bool, frozenset[str]] = {
    True: frozenset(),
    False: frozenset({"fp8"}),  # CUDA: the H200, vLLM 0.26, every load path (docs/conformance.md)
}
"""Per build, vLLM's online quantization methods (`--quantization METHOD` on an unquantized
checkpoint) whose in-place reload was checked against plain vLLM."""


def checkpoint_format(model: Path) -> str | None:
    """The checkpoint's quantization as "quant_method/format" (format where the method names
    one), None for an unquantized checkpoint."""
    config = json.loads((model / "config.json").read_text()).get("quantization_config")
    if not config:
        return None
    method = str(config.get("quant_method", "unknown"))
    return f"{method}/{config['format']}" if config.get("format") else method


QUANTIZATION_CONFIG = "--quantization-config"
"""vLLM's per-layer online quantization (newer vLLMs): named as a method of its own, verified nowhere."""


def online_methods(engine_args: tuple[str, ...]) -> list[str]:
    """The online quantization `engine_args` ask for: each method `--quantization` / `-q` names
    ("--quantization fp8", "--quantization=fp8", "-q fp8", "-q=fp8", "-qfp8"), and
    QUANTIZATION_CONFIG for `--quantization-config` in any form. Abbreviations ("--quant fp8")
    are judged on vLLM's parsed values instead (engine/engine_args.py)."""
    methods = []
    for k, arg in enumerate(engine_args):
        flag, equals, value = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag.startswith(QUANTIZATION_CONFIG):
            methods.append(QUANTIZATION_CONFIG)
        elif flag in ("--quantization", "-q"):
            methods.append(value if equals else (engine_args[k + 1] if k + 1 < len(engine_args) else ""))
        elif flag.startswith("-q") and not flag.startswith("--"):
            methods.append(arg[2:])
    return methods


def _build_name(cpu_build: bool) -> str:
    return "the CPU build" if cpu_build else "CUDA"


def online_refusal(methods: list[str], cpu_build: bool) -> str | None:
    """Why the first of `methods` (online quantization) may not be served on this build, or None."""
    unchecked = [method for method in methods if method not in ONLINE_VERIFIED[cpu_build]]
    if not unchecked:
        return None
    checked, formats = (", ".join(sorted(v[cpu_build])) for v in (ONLINE_VERIFIED, RELOAD_VERIFIED))
    offline = f"quantize the checkpoint offline (verified formats there: {formats})" if formats else \
        "serve an unquantized checkpoint (no quantized format is verified there yet)"
    shown = unchecked[0] if unchecked[0] == QUANTIZATION_CONFIG else f"--quantization={unchecked[0]}"
    return (f"online quantization {shown} is not verified to reload in place on {_build_name(cpu_build)} "
            f"(verified there: {checked or 'none'}); {offline}")


def check_served_right(model: Path, engine_args: tuple[str, ...], cpu_build: bool) -> None:
    """Raise ValueError, naming what is verified, for a quantized checkpoint of a format, or an
    online quantization (`--quantization`), whose in-place reload was not checked on this build."""
    if refusal := online_refusal(online_methods(engine_args), cpu_build):
        raise ValueError(refusal)
    found = checkpoint_format(model)
    verified = RELOAD_VERIFIED[cpu_build]
    if found is not None and found not in verified:
        raise ValueError(f"{model.name} is quantized as {found}, whose in-place reload (how engines get their "
                         f"weights) is not verified on {_build_name(cpu_build)} against plain vLLM; verified: "
                         f"{', '.join(sorted(verified)) or 'none yet'} (docs/conformance.md, quantized checkpoints)")
