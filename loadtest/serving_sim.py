"""Serving simulated step by step: engines that batch, prefill in chunks and decode, placed by the
live router's own placement step, on step times measured on a real engine (issue #37). Run by
`loadtest.pd_predict` (beside an open-loop load test's measurements), `loadtest.pd_bench_predict`
(beside pd_bench's closed loop on CPU engines) and `pdcluster plan` (loadtest.pd_plan).

The decode model: each engine runs vLLM's scheduling loop. A step takes every decoding sequence
(one token each), then the prompts in prefill, oldest first, chunked to the engine's token budget
(`max_num_batched_tokens`), admitting waiting requests while it has sequences and KV to spare;
its time is the fitted step model's (`loadtest.step_model`: the profile's decode steps, decode
steps with a prefill chunk in them, and whole prefills, measured on the same engine). A step's
end is when each of its sequences gets its token, so a colocated engine's streams pay every
prefill chunk that shares their step. In P/D a prefill engine computes the prompt (its answer is
one token); after the router's hop the decode engine's next step starts reading its KV (the
profile's direct or store path, no faster than the chosen link), the step ending after the read
learns it landed, and the step after that computes the prompt's last token and streams from
there, as vLLM's KV connectors go. Requests are placed by `router.placement.Placer` with the
router's policies and the load the router books (requests it sent and has not had answered,
prompt tokens it sent a prefill instance that has not answered), so `adaptive` (the router's
--remote-prefill-max-queued-tokens) decides as the router does. A prompt's blocks in an engine's
prefix cache (an LRU of its KV capacity, filled once the prompt's KV exists there) are not
computed again. On CPU machines the engines' steps take their profiled time over `core_share`,
the share of its core an engine keeps beside the router, clients and API servers, spread evenly
over steps. Not modelled: preemption (a request waits for KV instead), when that CPU is taken
(the serving path's per-token work runs beside decode steps), network contention between
hand-overs.

Reports what `loadtest.pd_goodput` reports (the same summary of per-request results): TTFT, TPOT,
inter-token gaps, served rate and goodput at the streaming and loose SLOs.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from decode.role import DECODE
from engine.role_spec import COLOCATED, RoleSpec
from fleet.instances import Instance, InstanceRegistry
from loadtest.simulate import TRACE_BLOCK_TOKENS, LRUBlocks, TraceRecord, load_trace
from loadtest.sse_client import RequestResult
from loadtest.step_model import Handover, Step, StepModel
from prefill.role import PREFILL
from router.kv_index import KVIndex
from router.placement import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, PlacementSettings, Placer
from router.policies import PolicyContext, RoutingRequest, make_policy

# The docstring's decode model, for the help of the commands that run it.
DECODE_MODEL = next(paragraph for paragraph in __doc__.split("\n\n") if paragraph.startswith("The decode model:"))


@dataclasses.dataclass(frozen=True)
class Topology:
    """`serving` engines (colocated, or decode when `prefill` > 0) and `prefill` engines; with
    `max_queued_tokens` a decode engine prefills while its prefill engine has more queued."""

    name: str
    serving: int
    prefill: int = 0
    max_queued_tokens: int | None = None

    @property
    def gpus(self) -> int:
        return self.serving + self.prefill

    @classmethod
    def parse(cls, text: str, input_tokens: int) -> Topology:
        """`colocated:N`, `pd:P+D` or `adaptive:P+D[@tokens]` (threshold default: one prompt)."""
        kind, _, size = text.partition(":")
        if kind == "colocated":
            return cls(text, int(size))
        split, _, threshold = size.partition("@")
        prefill, decode = (int(n) for n in split.split("+"))
        if kind == "pd":
            return cls(text, decode, prefill)
        if kind == "adaptive":
            return cls(text, decode, prefill, int(threshold) if threshold else input_tokens)
        raise ValueError(f"unknown topology {text!r}: colocated:N, pd:P+D or adaptive:P+D[@tokens]")


@dataclasses.dataclass(eq=False)
class Job:
    """A request's work at one engine: `compute` prompt tokens, then `outputs` tokens."""

    record: TraceRecord
    result: RequestResult
    compute: int
    outputs: int
    on_prefilled: Callable[[float], None] | None = None  # P/D prefill: the hand-over, instead of decoding
    kv_read_s: float = 0.0  # P/D decode: the KV read it starts when a step first schedules it
    done: int = 0
    first_decode_step: int = -1


class SimEngine:
    """One engine's scheduler and clock (the module's docstring says what a step takes)."""

    def __init__(self, instance: Instance, model: StepModel, sim: Simulation) -> None:
        self.instance, self.model, self.sim = instance, model, sim
        self.cache = LRUBlocks(max(model.kv_capacity_tokens // TRACE_BLOCK_TOKENS, 1))
        self.waiting: collections.deque[Job] = collections.deque()
        self.arriving: list[Job] = []  # KV to read, not yet seen by a step
        self.loading: list[tuple[float, Job]] = []  # (when its KV read lands, it)
        self.prefilling: list[Job] = []
        self.decoding: set[int] = set()
        self.finishing: dict[int, list[Job]] = collections.defaultdict(list)
        self.step_ends: list[float] = []
        self.context_tokens = 0  # summed context of the decoding sequences
        self.kv_tokens = 0
        self.busy = False
        self.requests = 0

    def submit(self, job: Job) -> None:
        (self.arriving if job.kv_read_s else self.waiting).append(job)
        self.requests += 1
        if not self.busy:
            self._start_step(self.sim.now)

    def _landed(self, now: float) -> None:
        """KV reads done by `now` make their requests schedulable, as vLLM learns at a step's end
        (or, idle, at its next empty step) that a remote KV load finished."""
        for ready, job in [item for item in self.loading if item[0] <= now]:
            self.loading.remove((ready, job))
            self.sim.stored(self, job.record)
            self.waiting.append(job)

    def _wake(self) -> None:
        if not self.busy:
            self._start_step(self.sim.now)

    def _admissible(self, job: Job) -> bool:
        """Whether a waiting request gets a sequence and its KV now (else it waits: vLLM would
        preempt a running one instead)."""
        if len(self.decoding) + len(self.prefilling) >= self.model.max_num_seqs:
            return False
        need = job.record.input_length + job.outputs
        return self.kv_tokens + need <= self.model.kv_capacity_tokens or not (self.decoding or self.prefilling)

    def _start_step(self, now: float) -> None:
        """The running prompts' next chunks, then waiting ones while the budget lasts (vLLM's order);
        requests with KV to read start reading it (vLLM schedules them with no tokens first)."""
        self.loading += [(now + job.kv_read_s, job) for job in self.arriving]
        self.arriving.clear()
        self._landed(now)
        decode_seqs = len(self.decoding)
        budget = self.model.max_num_batched_tokens - decode_seqs
        chunks: list[tuple[Job, int]] = []
        for job in self.prefilling:
            if budget <= 0:
                break
            chunks.append((job, min(budget, job.compute - job.done)))
            budget -= chunks[-1][1]
        while budget > 0 and self.waiting and self._admissible(self.waiting[0]):
            job = self.waiting.popleft()
            self.kv_tokens += job.record.input_length + job.outputs
            self.prefilling.append(job)
            chunks.append((job, min(budget, job.compute)))
            budget -= chunks[-1][1]
        if not decode_seqs and not chunks:
            self.busy = False
            if self.loading:
                self.sim.at(min(ready for ready, _ in self.loading), self._wake)
            return
        self.busy = True
        attention = sum(Step.chunk_attention(c, j.record.input_length - j.compute + j.done) for j, c in chunks)
        step = Step(decode_seqs, self.context_tokens, sum(c for _, c in chunks), attention)
        self.sim.at(now + self.model.seconds(step) / self.sim.core_share, lambda: self._end_step(chunks))

    def _end_step(self, chunks: list[tuple[Job, int]]) -> None:
        now, index = self.sim.now, len(self.step_ends)
        self.step_ends.append(now)
        self.context_tokens += len(self.decoding)
        for job in self.finishing.pop(index, ()):
            self._release(job, decoding=True)
        for job, chunk in chunks:
            job.done += chunk
            if job.done < job.compute:
                continue
            self.prefilling.remove(job)
            self.sim.stored(self, job.record)
            if job.on_prefilled is not None:  # a P/D prefill: its KV leaves, its engine is done with it
                self._release(job, decoding=False)
                job.on_prefilled(now)
                continue
            job.result.chunk_times_s.append(now)  # the first token
            if job.outputs <= 1:
                self._release(job, decoding=False)
                continue
            job.first_decode_step = index + 1
            self.finishing[index + job.outputs - 1].append(job)
            self.decoding.add(id(job))
            self.context_tokens += job.record.input_length
        self._start_step(now)

    def _release(self, job: Job, decoding: bool) -> None:
        if decoding:
            self.decoding.discard(id(job))
            self.context_tokens -= job.record.input_length + job.outputs - 1
            start = job.first_decode_step
            job.result.chunk_times_s.extend(self.step_ends[start : start + job.outputs - 1])
        self.kv_tokens -= job.record.input_length + job.outputs
        if job.on_prefilled is None:
            self.sim.finished(self, job)


class Simulation:
    """A clock, its events, the engines of one topology and the router's placement."""

    def __init__(self, topology: Topology, model: StepModel, handover: Handover, pd_model: StepModel | None = None,
                 policy: str = "kv_aware", hop_s: float = 0.002,
                 remote_prefill_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS, core_share: float = 1.0) -> None:
        """`model` steps colocated engines, `pd_model` (default: `model`) prefill and decode ones
        (ours run P/D engines with other vLLM settings: engine/role_spec.py). An engine's steps take
        their profiled time over `core_share`, the share of its compute it gets where other
        processes (the router, clients, API servers) run on its cores (CPU machines; 1 on GPUs)."""
        self.now, self.events, self.counter = 0.0, [], itertools.count()
        if not 0.0 < core_share <= 1.0:
            raise ValueError(f"core_share {core_share}: an engine computes with (0, 1] of its core")
        self.handover, self.hop_s, self.core_share = handover, hop_s, core_share
        self.index = KVIndex(speculative_ttl_s=5.0, clock=lambda: self.now)
        context = PolicyContext(index=self.index)
        settings = PlacementSettings(remote_prefill_min_tokens, topology.max_queued_tokens)
        self.placer = Placer(settings, make_policy(policy, context), make_policy(policy, context.for_prefill()))
        serving_role: RoleSpec = DECODE if topology.prefill else COLOCATED
        engine_model = (pd_model or model) if topology.prefill else model
        self.registry = InstanceRegistry()
        self.engines: dict[str, SimEngine] = {}
        for name, role, count in (("serve", serving_role, topology.serving), ("prefill", PREFILL, topology.prefill)):
            for i in range(count):
                instance = Instance(f"{name}-{i}", role, "sim://", model="sim")
                self.registry.add(instance)
                self.engines[instance.instance_id] = SimEngine(instance, engine_model, self)
        # The router's books: requests it sent each instance and has not had answered, and prompt
        # tokens it sent each prefill instance and has not had prefilled.
        self.inflight: collections.Counter[str] = collections.Counter()
        self.pending_prefill: collections.Counter[str] = collections.Counter()
        self.results: list[RequestResult] = []
        self.answered: Callable[[], None] | None = None  # a closed loop's client, when an answer ends

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (when, next(self.counter), action))

    def run(self, arrivals: Iterable[TraceRecord]) -> list[RequestResult]:
        """Requests sent at their records' arrival times (an open loop: loadtest.pd_goodput)."""
        for record in arrivals:
            self.at(record.arrival_s, lambda record=record: self._arrive(record))
        return self._drain()

    def run_closed(self, records: Iterable[TraceRecord], concurrency: int) -> list[RequestResult]:
        """`concurrency` clients, each sending the next record once its last answer has ended (a
        closed loop: loadtest.pd_bench's FixedConcurrency); the records' arrival times are ignored."""
        pending = iter(records)

        def send() -> None:
            record = next(pending, None)
            if record is not None:
                self._arrive(dataclasses.replace(record, arrival_s=self.now))

        self.answered = send
        for _ in range(concurrency):
            self.at(0.0, send)
        return self._drain()

    def _drain(self) -> list[RequestResult]:
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
        return self.results

    def _observe(self) -> None:
        for iid, engine in self.engines.items():
            self.registry.observed(engine.instance, self.inflight[iid], self.pending_prefill[iid])

    def _arrive(self, record: TraceRecord) -> None:
        self._observe()
        servers = [e.instance for e in self.engines.values() if e.instance.role.serves_clients]
        prefillers = [e.instance for e in self.engines.values() if e.instance.role.takes_remote_prefills]
        request = RoutingRequest(record.hash_ids, record.input_length, TRACE_BLOCK_TOKENS, record.text())
        placement = self.placer.place(request, servers, prefillers)
        served = self.engines[placement.serve.instance.instance_id]
        result = RequestResult(started_at=record.arrival_s, prompt_tokens=record.input_length,
                               output_tokens=record.output_length)
        if placement.prefill is None:
            self.inflight[served.instance.instance_id] += 1
            computed = record.input_length - self._cached(served, record)
            served.submit(Job(record, result, computed, record.output_length))
            return
        prefiller = self.engines[placement.prefill.instance_id]
        self.inflight[prefiller.instance.instance_id] += 1
        self.pending_prefill[prefiller.instance.instance_id] += record.input_length

        def prefilled(now: float) -> None:
            self.inflight[prefiller.instance.instance_id] -= 1
            self.pending_prefill[prefiller.instance.instance_id] -= record.input_length
            # The prefill's answer reaches the router, which sends the decode engine the request;
            # it reads the prompt's KV, then computes what that does not bring: the last token.
            job = Job(record, result, 1, record.output_length, kv_read_s=self.handover.seconds(record.input_length))
            self.at(now + prefiller.model.first_token_s + self.hop_s, lambda: self._send(served, job))

        computed = record.input_length - self._cached(prefiller, record)
        prefiller.submit(Job(record, result, computed, 1, on_prefilled=prefilled))

    def _send(self, engine: SimEngine, job: Job) -> None:
        self.inflight[engine.instance.instance_id] += 1
        engine.submit(job)

    def _cached(self, engine: SimEngine, record: TraceRecord) -> int:
        """Prompt tokens the engine's prefix cache holds now (at least the last one is computed)."""
        hits = engine.cache.leading_hits(record.hash_ids)
        return min(sum(record.block_tokens()[:hits]), record.input_length - 1)

    def stored(self, engine: SimEngine, record: TraceRecord) -> None:
        """The engine holds the prompt's KV now; it tells the router's index (vLLM's KV events)."""
        iid = engine.instance.instance_id
        self.index.stored(iid, record.hash_ids)
        self.index.removed(iid, engine.cache.touch(record.hash_ids))

    def finished(self, engine: SimEngine, job: Job) -> None:
        self.inflight[engine.instance.instance_id] -= 1
        result = job.result
        delivered = engine.model.first_token_s  # from a step's end to the client
        result.chunk_times_s = [t + delivered for t in result.chunk_times_s]
        result.ttft_s = result.chunk_times_s[0] - result.started_at
        result.e2e_s = result.chunk_times_s[-1] - result.started_at
        self.results.append(result)
        if self.answered is not None:
            self.at(result.chunk_times_s[-1], self.answered)


def random_prompts(arrivals: Iterable[float], input_tokens: int, output_tokens: int) -> list[TraceRecord]:
    """Prompts that share nothing (`loadtest.workloads.RandomLengths` with no spread)."""
    blocks = -(-input_tokens // TRACE_BLOCK_TOKENS)
    ids = itertools.count()
    return [TraceRecord(t, input_tokens, output_tokens, tuple(next(ids) for _ in range(blocks))) for t in arrivals]


def served_span(results: Sequence[RequestResult]) -> float:
    """From the first arrival to the last token: the load test's run duration (drain included)."""
    return max(r.started_at + (r.e2e_s or 0.0) for r in results) - min(r.started_at for r in results)


# Links a hand-over's bytes may cross (Gbit/s): NVLink between two H200s as measured by
# loadtest.d2d_weights on the lent nvidia-h200-x2 (366.8 GiB/s, docs/gpu/d2d_weights-h200x2.json),
# and nominal RDMA and TCP rates between nodes. None: the profile's own path alone.
NETWORKS_GBIT: dict[str, float | None] = {"profile": None, "nvlink": 366.8 * 1.024**3 * 8, "rdma-400": 400.0,
                                          "tcp-100": 100.0}


@dataclasses.dataclass(frozen=True)
class Workload:
    """Random prompts of fixed lengths (`4096/256`), or a Mooncake trace replayed at a rate."""

    name: str
    input_tokens: int = 0
    output_tokens: int = 0
    trace: tuple[TraceRecord, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Workload:
        if "/" in text and not text.endswith(".jsonl"):
            prompt, output = text.split("/")
            return cls(text, int(prompt), int(output))
        trace = tuple(load_trace(Path(text)))
        if any(r.block_size != TRACE_BLOCK_TOKENS for r in trace):  # its caches are sized in such blocks
            raise ValueError(f"{text}: the serving simulator replays {TRACE_BLOCK_TOKENS}-token blocks only")
        return cls(Path(text).stem, trace=trace)

    def mean_lengths(self) -> tuple[float, float]:
        if not self.trace:
            return self.input_tokens, self.output_tokens
        return (sum(r.input_length for r in self.trace) / len(self.trace),
                sum(r.output_length for r in self.trace) / len(self.trace))

    def arrivals(self, rate: float, duration_s: float, seed: int) -> list[TraceRecord]:
        """What arrives in `duration_s` at `rate` per second: Poisson arrivals as
        loadtest.pd_goodput offers them, or the trace's own arrivals sped up to `rate`."""
        if not self.trace:
            from loadtest.arrivals import Poisson

            times = itertools.takewhile(lambda t: t < duration_s, Poisson(rate, seed=seed).start_times())
            return random_prompts(itertools.islice(times, int(rate * duration_s) + 1), self.input_tokens,
                                  self.output_tokens)
        span = self.trace[-1].arrival_s - self.trace[0].arrival_s
        speed = rate * span / len(self.trace)
        start = self.trace[0].arrival_s
        shifted = (dataclasses.replace(r, arrival_s=(r.arrival_s - start) / speed) for r in self.trace)
        return list(itertools.takewhile(lambda r: r.arrival_s < duration_s, shifted))


def simulate_rate(topology: Topology, model: StepModel, handover: Handover, workload: Workload, rate: float,
                  duration_s: float, seed: int = 0, pd_model: StepModel | None = None,
                  remote_prefill_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS) -> dict:
    """One topology at one offered rate: loadtest.pd_goodput's summary of the simulated requests."""
    from loadtest.pd_goodput import summarize

    simulation = Simulation(topology, model, handover, pd_model, remote_prefill_min_tokens=remote_prefill_min_tokens)
    results = simulation.run(workload.arrivals(rate, duration_s, seed))
    return {"topology": topology.name, **summarize(results, served_span(results), rate)}
