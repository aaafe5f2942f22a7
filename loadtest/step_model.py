"""An engine's step time, fitted to a measured profile (`loadtest.engine_profile`), and the KV
hand-over's time: what the serving simulator (`loadtest.serving_sim`) charges each engine step.

One vLLM step runs every scheduled sequence through the model once: `decode_seqs` sequences
that each add one token, and `prefill_tokens` prompt tokens of chunked prefills. Its time is

    g(T) + c * decode_seqs + a * decode_context_tokens + b * prefill_attention

where T = decode_seqs + prefill_tokens (the matrix multiplies: flat while the weights' reads
dominate, then linear in tokens; g is piecewise linear over the knots the profile's steps reach,
and extends its last segment beyond them), `c` what each decoding sequence costs beyond its row
(sampling, its scheduling and output), `decode_context_tokens` the decode sequences' summed
context (attention reads their KV) and `prefill_attention` the sum over prefill chunks of chunk x
(context before it + chunk / 2) (a chunk attends to its prompt so far). A request's tokens reach
its client `first_token_s` after their steps end (scheduling it, taking its output). The profile's
observations are single steps (a decode step, a decode step with a prefill chunk in it) and whole
prefills (several chunked steps summed, plus that latency): each is linear in the coefficients,
which a non-negative least-squares fit of the relative errors finds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

KNOTS = (1, 16, 64, 256, 1024, 4096, 8192, 16384)
EXTRA_FEATURES = ("decode_seqs", "decode_context_tokens", "prefill_attention", "first_token")


@dataclasses.dataclass(frozen=True)
class Step:
    """What one engine step computes."""

    decode_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_tokens: int = 0
    prefill_attention: float = 0.0

    @property
    def tokens(self) -> int:
        return self.decode_seqs + self.prefill_tokens

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


def _hats(tokens: float, knots: Sequence[int]) -> np.ndarray:
    """Piecewise-linear basis: g(T) = hats(T) . weights, the last segment extended beyond."""
    points = np.asarray(knots, dtype=float)
    values = np.zeros(len(points))
    t = max(float(tokens), points[0])
    k = min(int(np.searchsorted(points, t, side="right")) - 1, len(points) - 2)
    share = (t - points[k]) / (points[k + 1] - points[k])
    values[k], values[k + 1] = 1 - share, share
    return values


def features(steps: Sequence[Step], knots: Sequence[int] = KNOTS, first_token: bool = False) -> np.ndarray:
    """The observation's row: the features of its steps, summed, and with `first_token` the
    latency from a request's arrival at an idle engine to its first token beyond the steps
    themselves (paid once per request)."""
    row = np.zeros(len(knots) + len(EXTRA_FEATURES))
    for step in steps:
        row[: len(knots)] += _hats(step.tokens, knots)
        row[len(knots) :] += (step.decode_seqs, step.decode_context_tokens, step.prefill_attention, 0.0)
    row[-1] = float(first_token)
    return row


def nonnegative_least_squares(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min |Ax - b| subject to x >= 0 (Lawson and Hanson's active set), on columns scaled to one
    so that features of very different sizes weigh alike; a column without data gets 0."""
    scale = np.abs(matrix).max(axis=0)
    usable = scale > 0
    a = matrix / np.where(usable, scale, 1.0)
    x = np.zeros(a.shape[1])
    passive = np.zeros(a.shape[1], dtype=bool)
    tolerance = 1e-10 * max(1.0, float(np.abs(a).sum()))
    for _ in range(3 * a.shape[1]):
        gradient = a.T @ (target - a @ x)
        candidates = ~passive & usable & (gradient > tolerance)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            trial = np.zeros_like(x)
            trial[passive] = np.linalg.lstsq(a[:, passive], target, rcond=None)[0]
            if (trial[passive] > 0).all():
                x = trial
                break
            shrinking = passive & (trial <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - trial[shrinking]))
            x = x + step * (trial - x)
            passive &= x > tolerance
            x[~passive] = 0.0
    return x / np.where(usable, scale, 1.0)


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

    knots: tuple[int, ...]
    weights: tuple[float, ...]
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int
    handovers: dict[str, Handover]

    def seconds(self, step: Step) -> float:
        return float(features([step], self.knots) @ np.asarray(self.weights))

    @property
    def first_token_s(self) -> float:
        """What a request's tokens reach its client later than their steps end (see `features`)."""
        return self.weights[-1]

    @classmethod
    def fit(cls, profile: dict) -> StepModel:
        knots = _knots_reached(profile)
        rows, targets = _observations(profile, knots)
        # Relative errors weigh alike: a 5 ms decode step as much as a 1 s prefill.
        weights = nonnegative_least_squares(np.array(rows) / np.array(targets)[:, None], np.ones(len(targets)))
        engine = profile["engine"]
        per_token = profile["kv_bytes_per_token"]
        handovers = {
            path: Handover.fit([h["tokens"] for h in profile["handover"]], [h[f"{path}_s"] for h in profile["handover"]],
                               per_token)
            for path in ("direct", "store")
        }
        return cls(knots, tuple(float(w) for w in weights), engine["max_num_batched_tokens"], engine["max_num_seqs"],
                   engine["kv_capacity_tokens"], handovers)

    @classmethod
    def load(cls, path: Path) -> StepModel:
        return cls.fit(json.loads(path.read_text()))

    def fit_errors(self, profile: dict) -> list[float]:
        """Relative error of the fit on each observation of `profile`."""
        rows, targets = _observations(profile, self.knots)
        predicted = np.array(rows) @ np.asarray(self.weights)
        return [float(p / t - 1) for p, t in zip(predicted, targets, strict=True)]


def _steps(profile: dict) -> list[tuple[list[Step], float, bool]]:
    """The profile's measurements as (their steps, seconds, whether a first token's latency is in them)."""
    budget = profile["engine"]["max_num_batched_tokens"]
    observed = [(chunked_prefill([s["tokens"]] * s["prompts"], budget), s["seconds"], True) for s in profile["prefill"]]
    observed += [([Step(s["batch"], s["batch"] * s["context"])], s["step_s"], False) for s in profile["decode"]]
    observed += [([Step(s["batch"], s["batch"] * s["context"], s["chunk"], Step.chunk_attention(s["chunk"], 0))],
                  s["step_s"], False) for s in profile["mixed"]]
    return observed


def _knots_reached(profile: dict) -> tuple[int, ...]:
    """KNOTS up to the first one at or beyond the largest step measured: g is fitted where there
    are data and extended linearly beyond, never given a knot no step reaches."""
    largest = max(step.tokens for steps, _, _ in _steps(profile) for step in steps)
    last = next((i for i, knot in enumerate(KNOTS) if knot >= largest), len(KNOTS) - 1)
    return KNOTS[: max(last, 1) + 1]


def _observations(profile: dict, knots: Sequence[int]) -> tuple[list[np.ndarray], list[float]]:
    """The profile's measurements as (feature row, seconds)."""
    observed = _steps(profile)
    return [features(steps, knots, first) for steps, _, first in observed], [seconds for _, seconds, _ in observed]
