"""What the plugin costs on this machine: plain vLLM against the same batch with the
plugin installed. The benchmark lives in the package (``vllm-nnsight bench`` runs
it too); see ``vllm_nnsight_plugin/bench.py`` for the jobs.

    python benchmarks/overhead.py --prompts 16 --tokens 32 [--taps]
"""

from vllm_nnsight_plugin.bench import main

if __name__ == "__main__":
    main()
