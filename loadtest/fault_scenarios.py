"""The fault scenarios loadtest/faults.py runs, and the goals each row must meet."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    serve_args: tuple[str, ...]
    victim_role: str
    kill_after_s: float
    """When the victim serves no streams (prefill, store, router): seconds into the burst."""
    prompt_words: int
    max_tokens: int
    regex: str | None = None
    """Structured output (vLLM's `structured_outputs`): a killed engine's streams go on in the
    grammar's state (engine/grammar_continuation.py)."""
    drained: bool = False
    """A planned shrink instead of a kill: the victim is drained (POST /admin/instances/ID/drain)."""
    json_schema: dict | None = None
    """Chats answering in this JSON schema (`response_format`), instead of completions."""
    goals: tuple[str, ...] = ()
    """What the row must show (GOALS), beyond what every row must (ALWAYS)."""

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.json_schema else "/v1/completions"

    def body(self, prompt: str) -> dict:
        body = {"model": "tiny", "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        if self.json_schema:
            body["messages"] = [{"role": "user", "content": prompt}]
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": self.json_schema}}
        else:
            body["prompt"] = prompt
        if self.regex:
            body["structured_outputs"] = {"regex": self.regex}
        return body

    @property
    def kills_streams(self) -> bool:
        """The victim serves streams: killed once it holds some that have sent tokens."""
        return self.victim_role in ("decode", "colocated")


# Where a killed engine's streams go on elsewhere: in float32 the continuation's recomputed
# prefix gives the same greedy tokens as the fault-free run (decode/stream_ledger.py).
FLOAT32 = ("--dtype", "float32")
JSON_SCHEMA = {"type": "object", "required": ["title", "words"],
               "properties": {"title": {"type": "string"}, "words": {"type": "array", "items": {"type": "string"}}}}
# Each goal: what it says, and whether a row meets it.
GOALS = {
    "all_completed": ("every stream completed (in router-killed-of-two, after one retry of a cut one)",
                      lambda row: row["completed"] == row["sent"]),
    "equal_to_no_fault": ("every stream's text equals the fault-free run's",
                          lambda row: row.get("equal_to_no_fault") == row["sent"]),
    "migrated": ("the kill cut a stream that went on elsewhere (migrated >= 1)", lambda row: row.get("migrated", 0) >= 1),
    "none_migrated": ("no stream migrated (a drained instance finishes its own)", lambda row: row.get("migrated") == 0),
    "store_settled": ("the store holds nothing in flight afterwards",
                      lambda row: all(held == 0 for held in row["store_in_flight_after"])),
    "engines_kept": ("the restarted router kept the engines and knows again the blocks it knew",
                     lambda row: row["engines_kept"] and row["index_blocks_after_restart"] >= row["index_blocks_before"]),
    "index_kept": ("the surviving router's index did not shrink",
                   lambda row: row["surviving_index_blocks"]["after"] >= row["surviving_index_blocks"]["before"]),
}
ALWAYS = {
    "nothing hung": lambda row: row["hung"] == 0,
    "the follow-up batch served whole": lambda row: row["follow_up_completed"] == row["follow_up_sent"],
}
MIGRATION_GOALS = ("all_completed", "equal_to_no_fault", "migrated")
SCENARIOS = {
    "prefill-killed-mid-transfer": Scenario(
        "prefill-killed-mid-transfer",
        ("--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"),
        "prefill", 1.0, 400, 16, goals=("all_completed", "store_settled"),
    ),
    "decode-killed-mid-stream": Scenario(
        "decode-killed-mid-stream",
        ("--prefill", "1", "--decode", "2", "--remote-prefill-min-tokens", "0", *FLOAT32),
        "decode", 0.0, 40, 128, goals=(*MIGRATION_GOALS, "store_settled"),
    ),
    # P/D through the store, chats in a JSON schema (`response_format`): the continuation on the
    # other decode instance carries the schema's grammar in the state the sent tokens left it.
    "decode-killed-mid-json-stream": Scenario(
        "decode-killed-mid-json-stream",
        ("--prefill", "1", "--decode", "2", "--remote-prefill-min-tokens", "0", "--structured-migration", *FLOAT32),
        "decode", 0.0, 40, 256, json_schema=JSON_SCHEMA, goals=(*MIGRATION_GOALS, "store_settled"),
    ),
    "store-shard-killed": Scenario(
        "store-shard-killed",
        ("--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"),
        "store", 1.0, 400, 16, goals=("all_completed",),
    ),
    "colocated-killed-mid-stream": Scenario(
        "colocated-killed-mid-stream", ("--instances", "2", *FLOAT32), "colocated", 0.0, 40, 512,
        goals=MIGRATION_GOALS,
    ),
    "structured-stream-killed": Scenario(
        # Unbounded, so each stream runs to max_tokens (xgrammar does not hold `{600}` exactly: seen)
        "structured-stream-killed", ("--instances", "2", "--structured-migration", *FLOAT32), "colocated", 0.0, 40, 512, regex="[a-z ]+",
        goals=MIGRATION_GOALS,
    ),
    "instance-drained-under-load": Scenario(
        "instance-drained-under-load", ("--instances", "2", *FLOAT32), "colocated", 0.0, 40, 512, drained=True,
        goals=("all_completed", "none_migrated"),
    ),
    # Two routers behind nginx on a Ray cluster of their own; the one that owns the fleet is killed.
    "router-killed-of-two": Scenario("router-killed-of-two", ("--instances", "2"), "router-of-two", 0.0, 40, 512,
                                     goals=("all_completed", "index_kept")),
    # On a Ray cluster of its own (as on a `ray up` head), so the engines outlive the router. The
    # streams in flight are cut (their connections end at the router): no goal on them.
    "router-restarted": Scenario(
        "router-restarted",
        ("--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"),
        "router", 2.0, 400, 64, goals=("engines_kept",),
    ),
}


def missed_goals(scenario: Scenario, row: dict) -> list[str]:
    """The goals `row` misses, in words (none: it met them all)."""
    if "error" in row:
        return [row["error"]]
    checks = {**ALWAYS, **{GOALS[name][0]: GOALS[name][1] for name in scenario.goals}}
    return [goal for goal, met in checks.items() if not met(row)]
