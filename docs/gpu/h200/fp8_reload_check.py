"""FP8 on CUDA through the in-place reload every engine of ours loads its weights with (issue #35,
item 3): greedy tokens and top-5 logprobs of plain vLLM against an engine started on dummy weights
and then given the checkpoint by WeightPlaneExtension.pdc_load_weights (our disk path), with the
same flags. Each side runs in a process of its own (a GPU holds one engine at a time here):

    python3 docs/gpu/h200/fp8_reload_check.py plain MODEL OUT_DIR [vLLM LLM(...) options as JSON]
    python3 docs/gpu/h200/fp8_reload_check.py ours MODEL OUT_DIR [same]
    python3 docs/gpu/h200/fp8_reload_check.py compare MODEL OUT_DIR [SIDE SIDE]

`alone` is plain vLLM given one prompt at a time (the others give all four at once, one batch):
`compare MODEL OUT_DIR plain alone` says whether plain vLLM's own answers depend on the batch.

e.g. options '{"quantization": "fp8"}' for vLLM's online FP8 (weights cast at load, per-tensor
scales). engine/quantization.py refuses online quantization until such a check says it is right.
On the H200: vLLM 0.26 from the wheelhouse (/tmp/vparts, env.sh), the repository on PYTHONPATH,
and vLLM's FP8 code needs `compressed-tensors==0.17.0` and `loguru` (pure-Python wheels for 3.12,
`pip download --no-deps`, installed with `--target` and put on PYTHONPATH); the model built first
in a process of its own (`engine.models.ensure_model("llama1b-tied", ...)`). docs/gpu-notes.md,
session 20.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three prime numbers: 2, 3,",
]


def answers(side: str, model: str, options: dict) -> dict:
    from vllm import LLM, SamplingParams

    settings = {"model": model, "max_model_len": 2048, "gpu_memory_utilization": 0.4, "seed": 0, **options}
    record = None
    if side == "ours":
        settings.update(load_format="dummy", worker_extension_cls="engine.worker_extension.WeightPlaneExtension")
    llm = LLM(**settings)
    if side == "ours":
        record = llm.collective_rpc("pdc_load_weights", args=("{}",))
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5)
    if side == "alone":
        outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in PROMPTS]
    else:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {
        "options": options,
        "load": record,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "top5": [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outputs],
    }


def compare(out: Path, sides: tuple[str, str] = ("plain", "ours")) -> dict:
    plain, ours = (json.loads((out / f"{side}.json").read_text()) for side in sides)
    differing = [k for k, (a, b) in enumerate(zip(plain["tokens"], ours["tokens"], strict=True)) if a != b]
    worst = max(abs(p[token] - o.get(token, float("-inf")))  # one side may end sooner: its steps so far
                for plain_steps, our_steps in zip(plain["top5"], ours["top5"], strict=True)
                for p, o in zip(plain_steps, our_steps, strict=False) for token in p)
    return {"sides": sides, "options": plain["options"], "prompts": len(PROMPTS), "prompts_differing": differing,
            "largest_top5_logprob_difference": worst, "load": ours["load"]}


def main() -> int:
    side, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    if side == "compare":
        sides = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else ("plain", "ours")
        result = compare(out, sides)
        (out / f"compare-{'-'.join(sides)}.json").write_text(json.dumps(result, indent=1))
    else:
        result = answers(side, model, json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
        (out / f"{side}.json").write_text(json.dumps(result))
        result = {"side": side, "first_tokens": result["tokens"][0][:8], "load": result["load"]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
