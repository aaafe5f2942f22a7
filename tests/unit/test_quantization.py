"""An int8 W8A8 layer after an in-place reload (engine/quantization.py).

On vLLM's CPU build without AMX, processing an int8 layer makes a oneDNN handle that points at
the layer's `weight_scale` tensor of that moment. vLLM's layerwise reload processes fresh tensors,
copies the results into the layer's old parameters and drops the fresh ones: the handle's scales
were freed memory and the engine answered NaN (docs/conformance.md). vLLM's real kernel on a small
layer, the reload's steps done as vLLM does them; no engine."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from engine.quantization import keep_int8_handle_scales

cpu_kernels = pytest.importorskip("vllm.model_executor.kernels.linear.scaled_mm.cpu")
config_module = pytest.importorskip("vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel")
# K not a multiple of 32: vLLM's AMX kernel refuses the shape, so the oneDNN handle is used on any CPU.
ROWS, COLUMNS = 48, 40
NAMES = ["weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"]


def checkpoint(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight and its per-row scales, as a compressed-tensors W8A8 checkpoint holds them."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (ROWS, COLUMNS), dtype=torch.int8, generator=generator)
    return weight, torch.rand(ROWS, 1, generator=generator) / 100 + 1e-3


def int8_layer(weight: torch.Tensor, scale: torch.Tensor):
    """A layer as vLLM's CompressedTensorsW8A8Int8 creates it, and the kernel vLLM picks for it
    (channel-wise weights, dynamic per-token symmetric activations)."""
    layer = torch.nn.Module()
    layer.logical_widths = [ROWS]
    for name, tensor in (("weight", weight), ("weight_scale", scale)):
        layer.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    for name in NAMES[2:]:
        layer.register_parameter(name, None)
    config = config_module.Int8ScaledMMLinearLayerConfig(
        is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
    kernel = cpu_kernels.CPUInt8ScaledMMLinearKernel(config, layer_param_names=NAMES)
    kernel.process_weights_after_loading(layer)
    return layer, kernel


def reload_in_place(layer: torch.nn.Module, kernel, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """vLLM's layerwise reload of one layer (model_loader/reload/layerwise.py): the layer's
    parameters set aside, fresh ones loaded and processed, the results copied into the set-aside
    parameters, those put back, the fresh ones dropped."""
    kept = {name: p for name, p in layer._parameters.items() if p is not None}
    for name in kept:
        delattr(layer, name)
    for name, tensor in (("weight", weight), ("weight_scale", scale)):
        layer.register_parameter(name, torch.nn.Parameter(tensor.clone(), requires_grad=False))
    kernel.process_weights_after_loading(layer)
    for name, parameter in kept.items():
        parameter.data.copy_(getattr(layer, name))
    for name in [n for n, p in layer._parameters.items() if p is not None]:
        delattr(layer, name)
    for name, parameter in kept.items():
        layer.register_parameter(name, parameter)


def test_an_int8_layer_reloaded_in_place_multiplies_by_the_reloaded_scales():
    assert keep_int8_handle_scales() and keep_int8_handle_scales()  # idempotent
    layer, kernel = int8_layer(*checkpoint(seed=0))  # started with other (dummy) weights
    assert kernel.linear_method == kernel._apply_weights_onednn
    reload_in_place(layer, kernel, *checkpoint(seed=1))
    gc.collect()
    scratch = [torch.full((ROWS, 1), float("nan")) for _ in range(64)]  # what freed scales would become
    plain_layer, plain_kernel = int8_layer(*checkpoint(seed=1))  # vLLM's own load of that checkpoint
    hidden = torch.randn(5, COLUMNS)
    torch.testing.assert_close(kernel.apply_weights(layer, hidden), plain_kernel.apply_weights(plain_layer, hidden),
                               rtol=0, atol=0)
    del scratch


def _checkpoint_config(tmp_path, quantization: dict | None):
    folder = tmp_path / (quantization or {}).get("format", (quantization or {}).get("quant_method", "plain"))
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_only_formats_whose_reload_was_checked_are_served(tmp_path, monkeypatch):
    from engine import quantization
    from engine.quantization import check_served_right

    # What each build has verified is data (docs/conformance.md); set here so the rule is tested
    # whatever the lists hold: the CPU build int8, CUDA the two FP8 spellings.
    monkeypatch.setattr(quantization, "RELOAD_VERIFIED", {True: frozenset({"compressed-tensors/int-quantized"}),
                                                          False: frozenset({"compressed-tensors/float-quantized"})})
    monkeypatch.setattr(quantization, "ONLINE_VERIFIED", {True: frozenset(), False: frozenset({"fp8"})})
    check_served_right(_checkpoint_config(tmp_path, None), (), cpu_build=False)  # unquantized: anywhere
    int8 = _checkpoint_config(tmp_path, {"quant_method": "compressed-tensors", "format": "int-quantized"})
    check_served_right(int8, ("--max-num-seqs=4",), cpu_build=True)
    with pytest.raises(ValueError, match="compressed-tensors/int-quantized.*not verified on CUDA"):
        check_served_right(int8, (), cpu_build=False)
    fp8 = _checkpoint_config(tmp_path, {"quant_method": "compressed-tensors", "format": "float-quantized"})
    check_served_right(fp8, (), cpu_build=False)
    with pytest.raises(ValueError, match="float-quantized.*verified: compressed-tensors/int-quantized"):
        check_served_right(fp8, (), cpu_build=True)
    vllm_fp8 = _checkpoint_config(tmp_path, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match="quantized as fp8, whose"):
        check_served_right(vllm_fp8, (), cpu_build=False)
    unquantized = _checkpoint_config(tmp_path, None)
    for online in (("--quantization", "fp8"), ("--quantization=fp8",), ("-q", "fp8"), ("-q=fp8",), ("-qfp8",)):
        check_served_right(unquantized, ("--max-num-seqs=4", *online), cpu_build=False)
        with pytest.raises(ValueError, match="--quantization=fp8 is not verified .* on the CPU build .verified there: none"):
            check_served_right(unquantized, online, cpu_build=True)
    with pytest.raises(ValueError, match="--quantization=awq is not verified .* on CUDA .verified there: fp8"):
        check_served_right(unquantized, ("-q", "awq"), cpu_build=False)
    for config in (("--quantization-config.linear", "fp8_per_token"), ("--quantization_config={}",)):
        with pytest.raises(ValueError, match="online quantization --quantization-config is not verified .* on CUDA"):
            check_served_right(unquantized, config, cpu_build=False)
    monkeypatch.setattr(quantization, "RELOAD_VERIFIED", {True: frozenset(), False: frozenset()})
    with pytest.raises(ValueError, match="float-quantized.*not verified on CUDA.*verified: none yet"):
        check_served_right(fp8, (), cpu_build=False)
    monkeypatch.setattr(quantization, "ONLINE_VERIFIED", {True: frozenset(), False: frozenset()})
    with pytest.raises(ValueError, match="not verified .* on CUDA .verified there: none.; serve an unquantized"):
        check_served_right(unquantized, ("-qfp8",), cpu_build=False)


def test_an_engine_configuration_of_an_unchecked_format_is_refused(tmp_path):
    from pydantic import ValidationError

    from engine.config import EngineConfig
    from engine.engine_args import EngineArgs

    gptq = _checkpoint_config(tmp_path, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValidationError, match="quantized as gptq"):
        EngineConfig(model=gptq, served_model_name="m")
    plain = _checkpoint_config(tmp_path, None)
    with pytest.raises(ValidationError, match="online quantization --quantization=awq"):
        EngineConfig(model=plain, served_model_name="m", engine_args=EngineArgs(decode=("--quantization", "awq")))

