"""The vLLM seams and the plugin entry point, checked against the installed vLLM.

When a vLLM release moves one of the internals in ``seams/`` these tests fail
by name, before any behaviour test has to guess why saves stopped arriving. The
wrapped methods are the ones ``seams.SEAMS`` declares, the list ``plugin.register``
installs from."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from vllm_nnsight_plugin import seams
from vllm_nnsight_plugin.versions import SUPPORTED_VLLM, UnsupportedVersion, check_vllm, vllm_version


def assert_prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (plugins patch classes process-wide)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_installed_vllm_is_supported():
    assert vllm_version().startswith(SUPPORTED_VLLM)
    with pytest.raises(UnsupportedVersion, match="supports vLLM"):
        check_vllm("0.11.0")


@pytest.mark.parametrize("seam", seams.SEAMS, ids=[seam.label for seam in seams.SEAMS])
def test_seam_exists_with_the_expected_signature(seam):
    import importlib

    if not seam.applies():
        return  # another platform's runner (the CPU one, on a GPU build), or another release's

    if not seam.owner:  # a module's function: read from its source, which the
        # server's extras (missing on an install with no server) need not import
        params = _function_parameters(seam.module, seam.name)
    else:
        owner = getattr(importlib.import_module(seam.module), seam.owner)
        params = list(inspect.signature(inspect.unwrap(getattr(owner, seam.name))).parameters)
    assert tuple(params[: len(seam.leading)]) == seam.leading, f"{seam.label} now takes {params}"


def _function_parameters(module: str, name: str) -> list[str]:
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is gone"
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return [arg.arg for arg in node.args.args]
        if isinstance(node, ast.ImportFrom) and any(a.name == name and not a.asname for a in node.names):
            package = module if spec.submodule_search_locations else module.rpartition(".")[0]
            source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            return _function_parameters(source, name)  # bound by import: where it is defined
    raise AssertionError(f"{module}.{name} is gone")


def test_register_installs_every_declared_front_end_and_engine_core_seam():
    processes = {seam.process for seam in seams.SEAMS}
    assert processes == {seams.FRONT_END, seams.ENGINE_CORE, seams.WORKER}
    for seam in seams.SEAMS:
        if seam.process == seams.WORKER:
            assert seam.module not in seams.INSTALLERS, seam.label  # installed by workers only
        else:
            assert seam.module in seams.INSTALLERS, f"{seam.label}: no installer in seams.INSTALLERS"
    assert set(seams.INSTALLERS) == {s.module for s in seams.SEAMS if s.process != seams.WORKER}


def test_the_declared_seams_are_exactly_the_wraps_made():
    """After ``register`` and the worker's runner patch, every declared seam is
    wrapped, and no method of a class the plugin touches is wrapped undeclared."""
    code = (
        "import importlib\n"
        "from vllm_nnsight_plugin import seams\n"
        "from vllm_nnsight_plugin.plugin import register\n"
        "register()\n"
        "seams.worker.patch_model_runner(*[lambda *args: None] * 4)\n"
        "def importable(module):\n"
        "    try:\n"
        "        importlib.import_module(module)\n"
        "    except ModuleNotFoundError as error:  # the server's extras, on an install without them\n"
        "        assert not error.name.startswith('vllm'), error\n"
        "        return False\n"
        "    return True\n"
        "applying = [s for s in seams.SEAMS if s.applies() and importable(s.module)]\n"
        "owners = {(s.module, s.owner) for s in applying}\n"
        "def owner_of(module, owner):\n"
        "    found = importlib.import_module(module)\n"
        "    return getattr(found, owner) if owner else found\n"
        "made = {f'{owner or module}.{name}' for module, owner in owners\n"
        "        for name, value in vars(owner_of(module, owner)).items()\n"
        "        if getattr(value, '_vllm_nnsight_wrapped', False)}\n"
        "declared = {s.label for s in applying}\n"
        "assert made == declared, (sorted(made - declared), sorted(declared - made))\n"
        "print('ok')\n"
    )
    assert_prints_ok(code)


def test_the_seams_package_does_not_import_worker_code():
    """Workers import ``seams``; ``seams`` must not import the worker back."""
    import ast
    from pathlib import Path

    package = Path(seams.__file__).parent
    worker = "vllm_nnsight_plugin.worker"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # ``.`` is this package, ``..`` is vllm_nnsight_plugin.
                base = {0: "", 1: "vllm_nnsight_plugin.seams", 2: "vllm_nnsight_plugin"}[node.level]
                module = ".".join(part for part in (base, node.module) if part)
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                assert name != worker and not name.startswith(worker + "."), f"{path.name} imports {name}"


def test_scheduler_reads_the_chunking_switches_where_we_override_them():
    from vllm.v1.core.sched.scheduler import Scheduler

    source = inspect.getsource(inspect.unwrap(Scheduler.schedule))
    assert "self.scheduler_config.enable_chunked_prefill" in source
    assert "self.scheduler_config.long_prefill_token_threshold" in source
    assert "self.max_num_scheduled_tokens" in source
    # ``_traced_first``: first come, first served preempts the last running request.
    assert "self.running[-1]" in source or "self.running.pop()" in source
    assert "self.running: list[Request]" in inspect.getsource(Scheduler.__init__)


def test_openai_server_parts_the_response_path_relies_on():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    # vllm_xargs becomes SamplingParams.extra_args, the block's ride to the worker.
    for request in (CompletionRequest, ChatCompletionRequest):
        assert "vllm_xargs" in request.model_fields
        assert "vllm_xargs" in inspect.getsource(request.to_sampling_params)
    # A stream ends with [DONE]; the saves event goes right before it.
    for cls, name in (
        (OpenAIServingCompletion, "completion_stream_generator"),
        (OpenAIServingChat, "chat_completion_stream_generator"),
    ):
        assert "data: [DONE]" in inspect.getsource(getattr(cls, name))
    error = list(inspect.signature(OpenAIServingCompletion.create_error_response).parameters)
    assert error[:3] == ["message", "err_type", "status_code"]
    assert inspect.iscoroutinefunction(AsyncLLM.collective_rpc)


def test_runner_layout_attributes_are_where_the_worker_reads_them():
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_src = inspect.getsource(GPUModelRunner)
    for attribute in ("self.query_start_loc", "self.input_batch", "self.requests", "self.sampler("):
        assert attribute in runner_src
    assert "req_ids" in inspect.getsource(InputBatch)


def test_the_switches_a_python_step_on_a_compiled_engine_relies_on():
    from vllm.compilation.decorators import _support_torch_compile
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # A step with a block is dispatched with force_eager (no CUDA graph) ...
    determine = inspect.unwrap(GPUModelRunner._determine_batch_execution_and_padding)
    assert "force_eager" in inspect.signature(determine).parameters
    assert "valid_modes={CUDAGraphMode.NONE} if force_eager" in inspect.getsource(determine)
    # ... and the compiled module calls its Python forward when skip_compiled is set.
    assert "skip_compiled" in ForwardContext.__dataclass_fields__
    assert "get_forward_context().skip_compiled" in inspect.getsource(_support_torch_compile)
    # The engine config says, once built, whether it runs the V2 runner.
    assert "use_v2_model_runner" in inspect.getsource(VllmConfig)


def test_a_python_step_switches_custom_ops_to_the_eager_kernels_and_back():
    """``seams/kernels.py``: under torch.compile each CustomOp keeps forward_native;
    a Python step points it at the platform's own kernel, and puts it back."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    assert "self._forward_method(" in inspect.getsource(CustomOp.forward)
    assert "self._forward_method = " in inspect.getsource(CustomOp.__init__)
    config = VllmConfig(compilation_config=CompilationConfig(mode=3, custom_ops=["none", "-rms_norm"]))
    with set_current_vllm_config(config):
        module = torch.nn.Sequential(SiluAndMul(), RMSNorm(64))
    act, norm = module
    compiled, kept = act._forward_method, norm._forward_method  # forward_native, or it compiled
    assert getattr(compiled, "__func__", None) not in (SiluAndMul.forward_cpu, SiluAndMul.forward_cuda)
    kernels = seams.eager_kernels(module, config)
    assert kernels is not None and [op for op, _, _ in kernels.switches] == [act]  # -rms_norm kept
    from vllm.platforms import current_platform

    own = SiluAndMul.forward_cuda if current_platform.is_cuda() else SiluAndMul.forward_cpu
    x = torch.randn(3, 128, device="cuda" if current_platform.is_cuda() else "cpu")
    want = act.forward_native(x)
    kernels.use()
    assert act._forward_method.__func__ is own
    torch.testing.assert_close(act(x), want)
    kernels.restore()
    kernels.restore()  # idempotent
    assert act._forward_method is compiled and norm._forward_method is kept
    # vLLM releases that route RMSNorm through vllm.ir keep a registry and a scoped priority.
    try:
        from vllm.ir.op import IrOp
    except ImportError:
        return
    assert IrOp.registry and all(
        hasattr(op, "set_priority") and hasattr(op, "impls") for op in IrOp.registry.values()
    )


def test_the_reads_the_tap_tables_rely_on():
    """``seams.whole_prompt_scheduled``, ``scheduled_rows``, ``tap_table_sizes``,
    ``speculates`` and ``step_rows`` (the persistent batch's ids and row offsets)."""
    import dataclasses
    import inspect

    from vllm.config import CompilationConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fields = {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_id", "prompt_token_ids", "num_computed_tokens", "sampling_params"} <= fields
    assert {"max_num_batched_tokens", "max_num_seqs"} <= set(SchedulerConfig.__dataclass_fields__)
    assert "cudagraph_capture_sizes" in CompilationConfig.__dataclass_fields__
    assert callable(ModelConfig.get_hidden_size)
    assert "speculative_config" in VllmConfig.__dataclass_fields__
    assert isinstance(InputBatch.req_ids, property) and isinstance(InputBatch.num_reqs, property)
    assert "query_start_loc" in inspect.getsource(GPUModelRunner.__init__)


def test_the_reads_lending_saves_on_the_device_relies_on():
    """``seams.front_end_elsewhere``: vLLM's switch for the engine core's own
    process, and the tensor-parallel rank."""
    import vllm.envs as envs
    from vllm.distributed import parallel_state

    assert isinstance(envs.VLLM_ENABLE_V1_MULTIPROCESSING, bool)
    assert callable(parallel_state.get_tensor_model_parallel_rank)


def test_the_read_of_requests_resumed_after_a_preemption():
    """``seams.resumed_ids``: vLLM names the requests a step recomputes."""
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    assert "resumed_req_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}
    assert "scheduled_cached_reqs" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    cached = CachedRequestData.make_empty()
    cached.resumed_req_ids = {"a"}
    assert seams.resumed_ids(type("Out", (), {"scheduled_cached_reqs": cached})()) == {"a"}


def test_blocks_are_refused_on_pipeline_and_data_parallel_engines():
    """``seams.frontend.unsupported_parallelism`` on vLLM's own parallel config
    (the input processor reads it from ``self.vllm_config``). A config laid out
    over more devices than this machine has does not validate, so those are
    read through the fields' names."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_nnsight_plugin.seams.frontend import unsupported_parallelism

    assert "self.vllm_config = vllm_config" in inspect.getsource(InputProcessor.__init__)
    assert {"pipeline_parallel_size", "data_parallel_size"} <= set(ParallelConfig.__dataclass_fields__)
    assert unsupported_parallelism(ParallelConfig()) is None
    laid_out = SimpleNamespace(pipeline_parallel_size=2, data_parallel_size=1)
    assert "pipeline_parallel_size > 1" in unsupported_parallelism(laid_out)
    laid_out = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=2)
    assert "data_parallel_size > 1" in unsupported_parallelism(laid_out)


def test_register_is_cheap_and_idempotent():
    code = (
        "import sys, vllm\n"
        "from vllm_nnsight_plugin.plugin import register\n"
        "register(); register()\n"
        "heavy = [m for m in ('vllm.v1.engine.llm_engine', 'vllm.v1.worker.gpu_model_runner', 'nnsight')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import vllm.v1.engine.llm_engine as e\n"
        "assert getattr(e.LLMEngine.step, '_vllm_nnsight_wrapped', False)\n"
        "print('ok')\n"
    )
    assert_prints_ok(code)


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "vllm_nnsight_plugin.plugin:register" in names


def test_extension_composes_with_a_users_class():
    assert seams.extension_for(None) == seams.EXTENSION
    composed = seams.extension_for("tests.test_seams.UserExtension")
    module_name, _, class_name = composed.rpartition(".")
    import importlib

    cls = getattr(importlib.import_module(module_name), class_name)
    assert issubclass(cls, UserExtension)
    assert hasattr(cls, "nnsight_collect") and hasattr(cls, "user_method")
    assert seams.extension_for(composed) == composed  # configuring twice changes nothing


class UserExtension:
    def user_method(self) -> str:
        return "mine"


def test_the_meta_tree_build_skips_weight_processing_where_the_loader_calls_it():
    """``seams.building_meta_tree`` replaces ``base_loader``'s own name for the step
    that turns weights into kernel formats; the loader must still call it by that name."""
    import inspect

    from vllm.model_executor.model_loader import base_loader

    load_model = inspect.unwrap(base_loader.BaseModelLoader.load_model)
    assert "process_weights_after_loading" in load_model.__code__.co_names
    original = base_loader.process_weights_after_loading
    with seams.building_meta_tree():
        assert base_loader.process_weights_after_loading is not original
        base_loader.process_weights_after_loading(None, None, None)  # nothing to process
    assert base_loader.process_weights_after_loading is original


def test_reads_the_edits_and_the_resume_rely_on():
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # The front end's book of installed edits lives on the engine's input processor.
    for engine in (LLMEngine, AsyncLLM):
        assert "self.input_processor = InputProcessor(" in inspect.getsource(engine.__init__)
    # A recompute's chunks whose sample vLLM throws away, known before the forward.
    source = inspect.getsource(GPUModelRunner._prepare_inputs)
    assert "self.discard_request_mask.np[:num_reqs] = (" in source
    # The OpenAI server's handlers reach the engine through ``engine_client``.
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    assert "self.engine_client.generate(" in inspect.getsource(OpenAIServingCompletion)
