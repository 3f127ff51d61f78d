"""Taps: locations compiled into the engine's graphs, and blocks lowered onto them.

A block that runs as Python costs a Python forward at every step it runs in. A
*tap* is a location the operator declares when the engine is built
(``VLLM(..., taps=[...])``, vLLM's ``additional_config={"nnsight_taps": [...]}``
or ``VLLM_NNSIGHT_TAPS``): the plugin puts one custom operation there before
vLLM compiles the model and captures its CUDA graphs, so the operation is part of
every compiled and graphed step. It reads small per-row tables that the worker
refills before each step; a row whose table entry is empty passes through
unchanged.

A request whose block computes one of the forms the tables can express (the
steering loop of the user docs, however it is spelled) is *lowered*: it gets table entries instead of a
Python block, and its steps stay in the graphs. Anything else runs as Python, as
it would on an engine without taps.

- ``spec.py``: tap patterns, and what they resolve to on a module tree;
- ``ops.py``: the operation (``torch.ops.vllm_nnsight.steer``);
- ``broken.py``: a CUDA graph of the whole forward broken at the taps, for steps
  whose blocks run as Python there;
- ``install.py``: the worker's side: the operation put on each tapped module, the
  tables, and their per-step fill;
- ``forms.py``: the shapes of block the tables run, read from a block's source;
- ``meaning.py``: blocks spelled otherwise, rewritten as the form they compute;
- ``lower.py``: which blocks are lowered, and to what.
"""
