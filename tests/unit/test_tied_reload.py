"""Tied embeddings after an in-place reload (engine/worker_extension.py `reprocess_tied_layers`).

On vLLM's CPU build, processing an output head packs its weight into a kernel handle
(`layer.cpu_linear`) that the forward pass multiplies by. A tied head receives no checkpoint
tensor of its own during vLLM's layerwise reload, so its packed copy kept the dummy weights and
every tied model answered nonsense (docs/conformance.md). Real vLLM processing on small layers,
no engine."""

from __future__ import annotations

import pytest
import torch

from engine.weights import WeightTransferError
from engine.worker_extension import reprocess_tied_layers

vocab_embedding = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")


class TiedModel(torch.nn.Module):
    """An embedding and an output head sharing one weight, as a tied checkpoint's model does."""

    def __init__(self, head_method) -> None:
        super().__init__()
        weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
        self.embed_tokens, self.lm_head = torch.nn.Module(), torch.nn.Module()
        self.embed_tokens.weight = self.lm_head.weight = weight
        self.embed_tokens.quant_method = vocab_embedding.UnquantizedEmbeddingMethod()
        self.lm_head.quant_method = head_method

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.quant_method.apply(self.lm_head, hidden)


def test_the_tied_head_multiplies_by_the_reloaded_weights():
    model = TiedModel(vocab_embedding.UnquantizedEmbeddingMethod())
    for module in (model.embed_tokens, model.lm_head):  # processed at start-up, dummy weights
        module.quant_method.process_weights_after_loading(module)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(64, 32))  # the reload writes the shared weight
    hidden = torch.randn(3, 32)
    want = hidden @ model.lm_head.weight.T
    # What vLLM's reload alone leaves: the head's processed copy still holds the dummy weights.
    assert not torch.allclose(model.logits(hidden), want, atol=1e-3)
    assert sorted(reprocess_tied_layers(model)) == ["embed_tokens", "lm_head"]
    torch.testing.assert_close(model.logits(hidden), want)


def test_a_quantized_tied_layer_is_refused():
    class OtherMethod:  # a stand-in for any quantization method
        def process_weights_after_loading(self, layer) -> None:
            raise AssertionError("must not be processed twice unchecked")

    with pytest.raises(WeightTransferError, match="lm_head"):
        reprocess_tied_layers(TiedModel(OtherMethod()))
