"""How far stock vLLM's log-probabilities move when the same request shares its
steps with other requests: the bound the tests allow when they compare two paths
in mixed batches (``tests/engine/test_taps.py``, ``BATCHING_NOISE``).

    python benchmarks/batching_noise.py [MODEL_DIR]

Plugin off (``VLLM_PLUGINS=""``), the tests' engine settings (fp32, eager), on
whatever device vLLM runs. Three prompts, greedy, five tokens, top-3
log-probabilities: each alone, then together, then among eight others, each batch
eight times. Prints the largest difference from the request run alone over the
tokens both top-3s share, and how many steps differ at all.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def logprobs(output) -> list[dict[int, float]]:
    return [{t: p.logprob for t, p in step.items()} for step in output.outputs[0].logprobs]


def main() -> None:
    os.environ["VLLM_PLUGINS"] = ""
    from vllm import LLM, SamplingParams

    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from vllm_nnsight_plugin.models.smollm2 import smollm2_path

        path = smollm2_path()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engines import ENGINE_DEFAULTS  # the engine the tests compare on

    llm = LLM(path, **ENGINE_DEFAULTS)
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    mine = ["The Eiffel Tower is in the city of", "Water boils at", "The capital of Japan is"]
    others = [f"Item {i}: the colour of the sky on a {i}-degree day is" for i in range(8)]
    alone = [logprobs(llm.generate([p], params, use_tqdm=False)[0]) for p in mine]
    worst, moved, steps, tokens_differ = 0.0, 0, 0, 0
    for batch in [mine] * 8 + [mine + others] * 8:
        for want, out in zip(alone, llm.generate(batch, params, use_tqdm=False)[: len(mine)]):
            got = logprobs(out)
            if [max(s, key=s.get) for s in got] != [max(s, key=s.get) for s in want]:
                tokens_differ += 1
            for a, b in zip(got, want):
                steps += 1
                gaps = [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
                worst = max(worst, *gaps)
                moved += any(g > 0 for g in gaps)
    print(
        "RESULT "
        + json.dumps(
            {
                "device": str(llm.llm_engine.vllm_config.device_config.device),
                "max_abs_logprob_gap": worst,
                "steps_moved": moved,
                "steps": steps,
                "requests_with_other_tokens": tokens_differ,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
