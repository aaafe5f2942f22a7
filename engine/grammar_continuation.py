"""Structured output that goes on from tokens already sent: a vLLM logits processor, loaded by
every engine of ours (`--logits-processors`), for the router's migration of a structured stream
(decode/stream_ledger.py).

A migrated stream's continuation is a completion whose prompt ends with the tokens the client
already has. vLLM's own structured output would start its grammar at the continuation's first
output token, as if nothing had been generated, so the router sends the grammar in the request's
`vllm_xargs` instead (GRAMMAR_ARG: JSON of the kind, the spec and the tokens already sent). This
processor compiles it with vLLM's own xgrammar backend (vLLM's compiler options, tokenizer info
and stop tokens: the masks vLLM's structured output would compute), advances it over the sent
tokens, then masks each step's logits and advances it with each sampled token, as vLLM does:
a terminated grammar masks nothing (its request is ending).

Only kinds vLLM's xgrammar backend compiles as they are (a JSON schema, any JSON object, a
regex, an EBNF grammar: a choice comes as the grammar vLLM's backend makes of it), and only
grammars it accepts (vLLM's own check, run on the request: a 400 otherwise, so a
stream whose grammar vLLM gave to another backend ends with an error event, not other masks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.structured_output.backend_types import StructuredOutputOptions

from engine.environment import GRAMMAR_ARG

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

log = logging.getLogger(__name__)
KINDS = {"json": StructuredOutputOptions.JSON, "json_object": StructuredOutputOptions.JSON_OBJECT,
         "regex": StructuredOutputOptions.REGEX, "grammar": StructuredOutputOptions.GRAMMAR}


@dataclasses.dataclass
class _Tracked:
    grammar: StructuredOutputGrammar | None
    """None: it could not be compiled or did not take the sent tokens; the request may only stop."""
    stop_token_ids: set[int]
    output_token_ids: list[int]
    """vLLM's running list of the request's output tokens (a reference it keeps appending to)."""
    accepted: int = 0
    """How many of them the grammar has accepted."""


def grammar_arg(params: SamplingParams) -> dict | None:
    """The request's continued grammar, checked for shape; None if it has none."""
    raw = (params.extra_args or {}).get(GRAMMAR_ARG)
    if raw is None:
        return None
    try:
        arg = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError:
        arg = None
    if not (isinstance(arg, dict) and arg.get("kind") in KINDS and isinstance(arg.get("spec"), str)
            and isinstance(arg.get("sent"), list) and all(isinstance(t, int) for t in arg["sent"])):
        raise ValueError(f"{GRAMMAR_ARG} must be {{kind: {'|'.join(KINDS)}, spec: str, sent: [token ids]}}")
    return arg


class GrammarContinuation(LogitsProcessor):
    """Masks the rows of requests that carry GRAMMAR_ARG; others pass untouched."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config = vllm_config
        self._backend = None  # vLLM's xgrammar backend, built on first use (it loads the tokenizer)
        self._tracked: dict[int, _Tracked] = {}  # by batch row

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        arg = grammar_arg(sampling_params)
        if arg is None:
            return
        if sampling_params.structured_outputs is not None:
            raise ValueError(f"{GRAMMAR_ARG} replaces structured_outputs: not both")
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        fields = {"json": {"json": arg["spec"]}, "json_object": {"json_object": True}, "regex": {"regex": arg["spec"]},
                  "grammar": {"grammar": arg["spec"]}}
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(**fields[arg["kind"]])))

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy tokens too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for row in batch_update.removed:
                self._tracked.pop(row, None)
            for row, params, _prompt, output_token_ids in batch_update.added:
                arg = grammar_arg(params)
                self._tracked.pop(row, None)
                if arg is not None:
                    self._tracked[row] = self._start(arg, params, output_token_ids)
            for a, b, direction in batch_update.moved:
                moving, other = self._tracked.pop(a, None), self._tracked.pop(b, None)
                if moving is not None:
                    self._tracked[b] = moving
                if other is not None and direction == MoveDirectionality.SWAP:
                    self._tracked[a] = other
        for tracked in self._tracked.values():
            new = tracked.output_token_ids[tracked.accepted:]
            if new and tracked.grammar is not None:
                tracked.grammar.accept_tokens(GRAMMAR_ARG, new)
            tracked.accepted += len(new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [row for row, t in self._tracked.items() if t.grammar is not None and not t.grammar.is_terminated()]
        if rows:
            import xgrammar

            bitmask = self._xgrammar().allocate_token_bitmask(logits.shape[0])
            for row in rows:
                self._tracked[row].grammar.fill_bitmask(bitmask, row)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        for row, tracked in self._tracked.items():
            if tracked.grammar is None:  # end it: its tokens could not be kept to the grammar
                stops = list(tracked.stop_token_ids)
                kept = logits[row, stops].clone()
                logits[row] = float("-inf")
                logits[row, stops] = kept
        return logits

    def _start(self, arg: dict, params: SamplingParams, output_token_ids: list[int]) -> _Tracked:
        """The request's grammar, advanced over the sent tokens. A failure here must not raise: it
        would end the engine's step loop, every request with it."""
        stops = params.all_stop_token_ids
        try:
            grammar = self._xgrammar().compile_grammar(KINDS[arg["kind"]], arg["spec"], stop_token_ids=stops)
            if not grammar.accept_tokens(GRAMMAR_ARG, arg["sent"]):
                raise ValueError("the tokens sent do not follow the grammar")
        except Exception:
            log.exception("a continued grammar could not be set up: the request is ended")
            grammar = None
        return _Tracked(grammar, stops, output_token_ids)

    def _xgrammar(self):
        if self._backend is None:
            from vllm.tokenizers import cached_tokenizer_from_config
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            config = self.vllm_config
            self._backend = XgrammarBackend(config, tokenizer=cached_tokenizer_from_config(config.model_config),
                                            vocab_size=config.model_config.get_vocab_size())
        return self._backend
