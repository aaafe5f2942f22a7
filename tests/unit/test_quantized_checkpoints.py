"""The hand-written quantizer behind the tiny-w8a8 and llama1b-tied-fp8 checkpoints
(engine/models.py `_quantize_linears`): no quantizer library, no engine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import _quantize_linears, build_tiny


def _read(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, copied out of the files (the quantizer replaces them)."""
    return {name: tensor.clone() for file in folder.glob("*.safetensors") for name, tensor in load_file(file).items()}


def _split_in_two(folder) -> None:
    """Make the one-file checkpoint a two-shard one with an index, as large checkpoints come."""
    (single,) = folder.glob("*.safetensors")
    tensors = _read(folder)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, chosen in shards.items():
        save_file({name: tensors[name] for name in chosen}, folder / file, metadata={"format": "pt"})
    single.unlink()
    weight_map = {name: file for file, chosen in shards.items() for name in chosen}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_a_quantized_checkpoint_holds_the_weights_within_one_step_of_its_format(tmp_path, fp8, sharded):
    """Each linear weight in the format's dtype with one scale per output row, the rest as it was,
    the index naming the file of every tensor, and the compressed-tensors configuration vLLM reads
    to pick its kernels."""
    build_tiny(tmp_path)
    if sharded:
        _split_in_two(tmp_path)
    original = _read(tmp_path)
    _quantize_linears(tmp_path, fp8=fp8)
    quantized = _read(tmp_path)
    linears = [name for name in original if name.endswith("_proj.weight")]
    assert len(linears) == 4 * 7 and set(quantized) == set(original) | {n + "_scale" for n in linears}
    for name in linears:
        weight, scale = quantized[name], quantized[name + "_scale"]
        assert weight.dtype == (torch.float8_e4m3fn if fp8 else torch.int8)
        assert scale.shape == (weight.shape[0], 1) and scale.dtype == torch.bfloat16
        restored, want = weight.float() * scale.float(), original[name].float()
        # int8 rounds to a step of the row's scale; E4M3 keeps 3 mantissa bits (relative error <= 1/16)
        bound = scale.float() * 0.51 if not fp8 else want.abs() / 16 + scale.float() * 2 ** -9
        assert ((restored - want).abs() <= bound).all(), name
    assert torch.equal(quantized["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    if sharded:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        for file in tmp_path.glob("*.safetensors"):
            assert all(index["weight_map"][name] == file.name for name in load_file(file))
        assert set(index["weight_map"]) == set(quantized)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in quantized.values())
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == ("float-quantized" if fp8 else "int-quantized")
    assert config["config_groups"]["group_0"]["weights"]["type"] == ("float" if fp8 else "int")


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_our_disk_loader_reads_every_tensor_of_a_quantized_checkpoint_as_safetensors_does(tmp_path, fp8):
    """The weight plane's reader (engine/checkpoint.py), not safetensors, gives engines their
    weights from disk: FP8 tensors were once a KeyError there (the H200, session 24)."""
    from engine.checkpoint import read_from_disk

    build_tiny(tmp_path)
    _quantize_linears(tmp_path, fp8=fp8)
    want = _read(tmp_path)
    got = dict(read_from_disk(tmp_path).tensors())
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_tensor_of_a_dtype_the_loader_does_not_read_is_refused_by_name(tmp_path):
    header = json.dumps({"model.norm.weight": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    from engine.checkpoint import read_from_disk

    with pytest.raises(ValueError, match="model.norm.weight is F4, a safetensors dtype the weight loader does not read"):
        read_from_disk(tmp_path)
