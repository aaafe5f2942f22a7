"""An engine's step time, fitted to a measured profile (`loadtest.engine_profile`), and the KV
hand-over's time: what the serving simulator (`loadtest.serving_sim`) charges each engine step.

One vLLM step runs every scheduled sequence through the model once: `decode_seqs` sequences
that each add one token, and `prefill_tokens` prompt tokens of chunked prefills. Its time is

    g(T) + a * decode_context_tokens + b * prefill_attention

where T = decode_seqs + prefill_tokens (the matrix multiplies: flat while the weights' reads
dominate, then linear in tokens; g is piecewise linear over `KNOTS`), `decode_context_tokens`
the decode sequences' summed context (attention reads their KV) and `prefill_attention` the sum
over prefill chunks of chunk x (context before it + chunk / 2) (a chunk attends to its prompt so
far). The profile's observations are single steps (a decode step, a decode step with a prefill
chunk in it) and whole prefills (several chunked steps summed): each is linear in the
coefficients, which a non-negative least-squares fit of the relative errors finds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KNOTS = (1, 16, 64, 256, 1024, 4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class Step:
    """What one engine step computes."""

    decode_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_attention: float = 0.0

    @staticmethod
    def chunk_attention(chunk: int, before: int) -> float:
        return chunk * (before + chunk / 2)


def chunked_prefill(prompts: Sequence[int], budget: int) -> list[Step]:
    """The steps of prompts (their lengths) prefilled together on an idle engine, first come
    first served under a token budget per step, as vLLM's scheduler chunks them."""
    steps, done, index = [], [0] * len(prompts), 0
    while index < len(prompts):
        left, tokens, attention = budget, 0, 0.0
        for k in range(index, len(prompts)):
            chunk = min(left, prompts[k] - done[k])
            tokens, attention = tokens + chunk, attention + Step.chunk_attention(chunk, done[k])
            done[k] += chunk
            left -= chunk
            if left == 0:
                break
        steps.append(Step(prefill_tokens=tokens, prefill_attention=attention))
        while index < len(prompts) and done[index] == prompts[index]:
            index += 1
    return steps


def _hats(tokens: float) -> np.ndarray:
    """Piecewise-linear basis over KNOTS: g(T) = hats(T) . weights; linear beyond the last knot."""
    knots = np.asarray(KNOTS, dtype=float)
    values = np.zeros(len(knots))
    t = max(float(tokens), knots[0])
    k = min(int(np.searchsorted(knots, t, side="right")) - 1, len(knots) - 2)
    share = (t - knots[k]) / (knots[k + 1] - knots[k])
    values[k], values[k + 1] = 1 - share, share
    return values


def features(steps: Sequence[Step], first_token: bool = False) -> np.ndarray:
    """The observation's row: the features of its steps, summed, and with `first_token` the
    latency from a request's arrival at an idle engine to its first token beyond the steps
    themselves (scheduling it, taking its output: paid once per request)."""
    row = np.zeros(len(KNOTS) + 3)
    for step in steps:
        row[: len(KNOTS)] += _hats(step.decode_seqs + step.prefill_tokens)
        row[-3] += step.decode_context_tokens
        row[-2] += step.prefill_attention
    row[-1] = float(first_token)
    return row


def nonnegative_least_squares(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min |Ax - b| with x >= 0, by dropping the most negative coefficient and refitting (columns
    scaled to one first, so features of very different sizes weigh alike)."""
    scale = np.maximum(np.abs(matrix).max(axis=0), 1e-30)
    scaled = matrix / scale
    active = np.ones(matrix.shape[1], dtype=bool)
    solution = np.zeros(matrix.shape[1])
    while active.any():
        solution[:] = 0.0
        solution[active] = np.linalg.lstsq(scaled[:, active], target, rcond=None)[0]
        if solution.min() >= 0:
            break
        active[int(np.argmin(solution))] = False
    return np.maximum(solution, 0.0) / scale


@dataclasses.dataclass(frozen=True)
class Handover:
    """KV hand-over time for `tokens` of prompt: latency + bytes / bandwidth."""

    latency_s: float
    bytes_per_s: float
    kv_bytes_per_token: int

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bytes_per_s

    @classmethod
    def fit(cls, tokens: Sequence[int], seconds: Sequence[float], kv_bytes_per_token: int) -> Handover:
        slope, intercept = np.polyfit(np.asarray(tokens, dtype=float) * kv_bytes_per_token, seconds, 1)
        return cls(max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-18), kv_bytes_per_token)

    def over_network(self, gbit_per_s: float) -> Handover:
        """The same hand-over with its bytes crossing a link of `gbit_per_s` (whichever is slower)."""
        return dataclasses.replace(self, bytes_per_s=min(self.bytes_per_s, gbit_per_s * 1e9 / 8))


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Seconds of an engine step, with the engine's scheduling limits it was measured under."""

    weights: tuple[float, ...]
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int
    handovers: dict[str, Handover]

    def seconds(self, step: Step) -> float:
        return float(features([step]) @ np.asarray(self.weights))

    @property
    def first_token_s(self) -> float:
        """What a request's tokens reach its client later than its steps end (see `features`)."""
        return self.weights[-1]

    @classmethod
    def fit(cls, profile: dict) -> StepModel:
        rows, targets = _observations(profile)
        # Relative errors weigh alike: a 5 ms decode step as much as a 1 s prefill.
        weights = nonnegative_least_squares(np.array(rows) / np.array(targets)[:, None], np.ones(len(targets)))
        engine = profile["engine"]
        per_token = profile["kv_bytes_per_token"]
        handovers = {
            path: Handover.fit([h["tokens"] for h in profile["handover"]], [h[f"{path}_s"] for h in profile["handover"]],
                               per_token)
            for path in ("direct", "store")
        }
        return cls(tuple(float(w) for w in weights), engine["max_num_batched_tokens"], engine["max_num_seqs"],
                   engine["kv_capacity_tokens"], handovers)

    @classmethod
    def load(cls, path: Path) -> StepModel:
        return cls.fit(json.loads(path.read_text()))

    def fit_errors(self, profile: dict) -> list[float]:
        """Relative error of the fit on each observation of `profile`."""
        rows, targets = _observations(profile)
        predicted = np.array(rows) @ np.asarray(self.weights)
        return [float(p / t - 1) for p, t in zip(predicted, targets, strict=True)]


def _observations(profile: dict) -> tuple[list[np.ndarray], list[float]]:
    """The profile's measurements as (feature row, seconds)."""
    budget = profile["engine"]["max_num_batched_tokens"]
    rows, targets = [], []
    for sample in profile["prefill"]:
        rows.append(features(chunked_prefill([sample["tokens"]] * sample["prompts"], budget), first_token=True))
        targets.append(sample["seconds"])
    for sample in profile["decode"]:
        rows.append(features([Step(sample["batch"], sample["batch"] * sample["context"])]))
        targets.append(sample["step_s"])
    for sample in profile["mixed"]:
        step = Step(sample["batch"], sample["batch"] * sample["context"], sample["chunk"],
                    Step.chunk_attention(sample["chunk"], 0))
        rows.append(features([step]))
        targets.append(sample["step_s"])
    return rows, targets
