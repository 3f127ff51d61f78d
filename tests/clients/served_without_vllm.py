"""The client on a machine with no vLLM, against a server: run by ``test_serve.py``
in the environment ``tests/without_vllm.py`` makes. Writes what it saw to argv[2]."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import torch

PROMPT = "The capital of France is"


def main(url: str, out: str) -> None:
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("vLLM is importable here: this is not an environment without it")

    import nnsight

    from vllm_nnsight_plugin import connect

    model = connect(url)  # the operator's key from VLLM_NNSIGHT_KEY
    seen: dict = {"tree": repr(model), "layers": len(model.model.layers)}

    def first(layer: int) -> tuple:  # the first traces of a client, several at once
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            row = model.model.layers[layer].output[0][-1].clone().save()
        return tuple(row.shape)

    with ThreadPoolExecutor(4) as pool:
        seen["concurrent"] = list(pool.map(first, [1, 2, 3, 4]))

    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        hidden = model.model.layers[10].output[0].clone().save()
        logits = model.logits.save()
        result = tracer.result.save()
    seen.update(hidden=hidden, logits=logits, tokens=list(result.outputs[0].token_ids))
    seen["text"] = model.tokenizer.decode(result.outputs[0].token_ids)

    with model.trace(temperature=0.0, max_tokens=3) as tracer:
        with tracer.invoke("Paris is in"):
            first = model.model.layers[3].output[0].clone().save()
        with tracer.invoke("The capital of Japan is"):
            tokens = list().save()
            for _ in tracer.iter[:3]:
                tokens.append(model.samples.item())
    seen.update(first=tuple(first.shape), japan=model.tokenizer.decode(tokens))

    with model.edit(name="probe") as (tracer, probe):
        norm = model.model.layers[2].output[0][-1].norm().save()  # noqa: F841
    seen["installed"] = sorted(model.installed_edits().values(), key=str)
    with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        result = tracer.result.save()
    seen["edit_saves"] = sorted(result.saves)
    probe.clear()
    with model.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        result = tracer.result.save()
    seen["after_clear"] = sorted(getattr(result, "saves", None) or {})

    try:
        with model.trace(PROMPT, temperature=0.0, max_tokens=2):
            model.model.layers[3].output[0][99].save()
    except RuntimeError as error:
        seen["block_error"] = str(error)
    try:
        with model.trace(PROMPT, temprature=0.0):
            nnsight.save(1)
    except TypeError as error:
        seen["typo"] = str(error)
    seen["vllm_loaded"] = sorted(name for name in sys.modules if name.split(".")[0] == "vllm")
    torch.save(seen, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
