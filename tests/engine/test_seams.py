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
from vllm_nnsight_plugin.seams.check import (
    installed_root,
    missing,
    module_file,
    parameters,
    runners_in,
    source_of,
)
from vllm_nnsight_plugin.versions import TESTED_VLLM, release, vllm_version, why_off


def needs_runner(name: str) -> None:
    """Checks of one model runner's internals run where this vLLM has that runner
    (0.32 has V1 and V2; 0.34 only the V2 family)."""
    if name not in runners_in(installed_root()):
        pytest.skip(f"this vLLM has no {name} runner")


def assert_prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter (plugins patch classes process-wide)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_installed_vllm_is_a_tested_release_and_others_are_read_from_their_source():
    assert vllm_version().startswith(TESTED_VLLM) and why_off() is None
    assert "older than 0.25" in why_off("0.24.1")
    # An untested release runs when its source has every seam (here: this one's).
    assert why_off("0.99.0") is None
    assert release("0.32.0+cpu") == (0, 32, 0) and release("0.9.0.post1") == (0, 9, 0)
    assert missing(installed_root(), seams.SEAMS, seams.FACTS) == []


@pytest.mark.parametrize("fact", seams.FACTS, ids=[f"{f.qualname}:{f.why}" for f in seams.FACTS])
def test_every_line_of_vllm_the_plugin_relies_on_is_there(fact):
    if fact.runner is not None:
        needs_runner(fact.runner)
    text = source_of(installed_root(), fact.module, fact.qualname)
    assert text is not None, f"{fact.module}.{fact.qualname} is gone"
    assert fact.found_in(text), f"{fact.qualname} no longer has {fact.text!r} ({fact.why})"


def test_a_release_that_lacks_a_seam_switches_the_plugin_off_and_vllm_runs(tmp_path, tiny_qwen3_path):
    """A real vLLM process on a release that reads as untested and lacks
    ``LLMEngine.step``: one warning naming it, no seam made, a plain request served,
    and the client refuses with the reason."""
    root = installed_root()
    modules = {s.module for s in seams.SEAMS} | {f.module for f in seams.FACTS}
    for module in modules | {"vllm.entrypoints.launchers.app"}:
        found = module_file(root, module)
        if found is not None:
            copy = tmp_path / found.relative_to(root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(found.read_text())
    engine_file = tmp_path / "v1/engine/llm_engine.py"
    engine_file.write_text(engine_file.read_text().replace("    def step(self)", "    def stepped(self)"))
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from vllm_nnsight_plugin import versions\n"
        "from vllm_nnsight_plugin.seams import check\n"
        "versions.vllm_version = lambda: '0.99.0'\n"
        f"check.installed_root = lambda: Path({str(tmp_path)!r})\n"
        "from vllm import LLM, SamplingParams\n"
        "from tests.engines import ENGINE_DEFAULTS\n"
        f"llm = LLM({tiny_qwen3_path!r}, **ENGINE_DEFAULTS)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "from vllm.v1.engine.llm_engine import LLMEngine\n"
        "assert not getattr(LLMEngine.add_request, '_vllm_nnsight_wrapped', False)\n"
        "from vllm_nnsight_plugin import VLLM\n"
        "try:\n"
        "    VLLM(llm)\n"
        "except RuntimeError as error:\n"
        "    assert 'LLMEngine.step is gone' in str(error), error\n"
        "else:\n"
        "    raise AssertionError('the client built requests for a plugin that is off')\n"
        "llm.llm_engine.engine_core.shutdown()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "vllm-nnsight: switched off" in line]
    assert len(warnings) == 1 and "LLMEngine.step is gone" in warnings[0], warnings


@pytest.mark.parametrize("seam", seams.SEAMS, ids=[seam.label for seam in seams.SEAMS])
def test_seam_exists_with_the_expected_signature(seam):
    import importlib

    if not seam.applies():
        return  # another platform's runner (the CPU one, on a GPU build), or a module that does not call it

    if not seam.owner:  # a module's function: read from its source, which the
        # server's extras (missing on an install with no server) need not import
        params = parameters(installed_root(), seam.module, seam.name)
    else:
        owner = getattr(importlib.import_module(seam.module), seam.owner)
        params = list(inspect.signature(inspect.unwrap(getattr(owner, seam.name))).parameters)
    assert params is not None, f"{seam.label} is gone"
    assert tuple(params[: len(seam.leading)]) == seam.leading, f"{seam.label} now takes {params}"


def test_the_openai_server_app_is_wrapped_where_its_server_calls_it():
    made = [seam for seam in seams.SEAMS if seam.name == "build_app" and seam.applies()]
    assert len(made) == 1, made  # 0.32: launchers/api_server/entry.py; 0.25: openai/api_server.py


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
        "seams.runners.patch_model_runners(seams.StepHooks(*[lambda *args: None] * 4))\n"
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


def test_openai_server_parts_the_response_path_relies_on():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    # vllm_xargs becomes SamplingParams.extra_args (FACTS), the block's ride to the worker.
    for request in (CompletionRequest, ChatCompletionRequest):
        assert "vllm_xargs" in request.model_fields
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
    needs_runner("v1")
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner_src = inspect.getsource(GPUModelRunner)
    for attribute in ("self.query_start_loc", "self.input_batch", "self.requests", "self.sampler("):
        assert attribute in runner_src
    assert "req_ids" in inspect.getsource(InputBatch)


def test_the_switches_a_python_step_on_a_compiled_engine_relies_on():
    needs_runner("v1")
    from vllm.compilation.decorators import _support_torch_compile
    from vllm.forward_context import ForwardContext
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # A step with a block is dispatched with force_eager (no CUDA graph) ...
    # (what it reads in their source is in FACTS).
    determine = inspect.unwrap(GPUModelRunner._determine_batch_execution_and_padding)
    assert "force_eager" in inspect.signature(determine).parameters
    # ... and the compiled module calls its Python forward when skip_compiled is set.
    assert "skip_compiled" in ForwardContext.__dataclass_fields__
    assert callable(_support_torch_compile)


def test_a_python_step_switches_custom_ops_to_the_eager_kernels_and_back():
    """``seams/kernels.py``: under torch.compile each CustomOp keeps forward_native;
    a Python step points it at the platform's own kernel, and puts it back."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    assert callable(CustomOp.forward)  # what it reads of CustomOp's source is in FACTS
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

    fields = {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_id", "prompt_token_ids", "num_computed_tokens", "sampling_params"} <= fields
    assert {"max_num_batched_tokens", "max_num_seqs"} <= set(SchedulerConfig.__dataclass_fields__)
    assert "cudagraph_capture_sizes" in CompilationConfig.__dataclass_fields__
    assert callable(ModelConfig.get_hidden_size)
    assert "speculative_config" in VllmConfig.__dataclass_fields__
    if "v1" in runners_in(installed_root()):
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        assert isinstance(InputBatch.req_ids, property) and isinstance(InputBatch.num_reqs, property)
        assert "query_start_loc" in inspect.getsource(GPUModelRunner.__init__)


@pytest.mark.parametrize("runner", ["v2", "v2-cpu"])
def test_the_v2_batch_is_what_the_worker_reads_its_rows_from(runner):
    """``seams.runner_v2.view_of``: the fields of the V2 ``InputBatch`` (a dataclass
    in 0.25 to 0.34) that the step's rows are read from."""
    import dataclasses
    import importlib

    needs_runner(runner)
    module = {"v2": "vllm.v1.worker.gpu.input_batch", "v2-cpu": "vllm.v1.worker.cpu.input_batch"}[runner]
    batch = importlib.import_module(module).InputBatch
    fields = {f.name for f in dataclasses.fields(batch)}
    assert {"req_ids", "num_reqs", "query_start_loc_np", "num_computed_tokens_np", "prefill_len_np"} <= fields


def test_the_reads_lending_saves_on_the_device_relies_on():
    """``seams.front_end_elsewhere``: vLLM's switch for the engine core's own
    process, and the tensor-parallel rank."""
    import vllm.envs as envs
    from vllm.distributed import parallel_state

    assert isinstance(envs.VLLM_ENABLE_V1_MULTIPROCESSING, bool)
    assert callable(parallel_state.get_tensor_model_parallel_rank)


def test_the_read_of_requests_resumed_after_a_preemption():
    """V1 names the requests a step recomputes; V2 frees a preempted request
    (``preempted_req_ids``) and sends it again as a new one."""
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_nnsight_plugin.seams.runner_v1 import V1Runner

    assert "preempted_req_ids" in {f.name for f in dataclasses.fields(SchedulerOutput)}
    if "v1" in runners_in(installed_root()):
        from vllm.v1.core.sched.output import CachedRequestData

        assert "scheduled_cached_reqs" in {f.name for f in dataclasses.fields(SchedulerOutput)}
        cached = CachedRequestData.make_empty()
        cached.resumed_req_ids = {"a"}
        assert V1Runner().resumed(type("Out", (), {"scheduled_cached_reqs": cached})(), {}) == {"a"}


def test_blocks_are_refused_on_pipeline_parallel_engines_and_run_on_data_parallel_ones():
    """``seams.frontend.unsupported_parallelism`` on vLLM's own parallel config
    (the input processor reads it from ``self.vllm_config``). A config laid out
    over more devices than this machine has does not validate, so those are
    read through the fields' names."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_nnsight_plugin.seams.frontend import unsupported_parallelism

    assert callable(InputProcessor.process_inputs)  # it reads self.vllm_config (FACTS)
    assert {"pipeline_parallel_size", "data_parallel_size"} <= set(ParallelConfig.__dataclass_fields__)
    assert unsupported_parallelism(ParallelConfig()) is None
    laid_out = SimpleNamespace(pipeline_parallel_size=2, data_parallel_size=1)
    assert "pipeline_parallel_size > 1" in unsupported_parallelism(laid_out)
    laid_out = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=2)
    assert unsupported_parallelism(laid_out) is None  # this vLLM's client reaches every engine


def test_the_async_client_can_ask_every_data_parallel_engine():
    """``seams.frontend.rpc_every_engine``: vLLM's data-parallel client answers
    ``collective_rpc`` with the first engine's replies only, so the collect asks
    each engine (``call_utility_all_async``). Without it, blocks on a
    data-parallel engine are refused rather than losing their saves."""
    import inspect
    from types import SimpleNamespace

    import vllm

    from vllm_nnsight_plugin.seams.frontend import reaches_every_engine, unsupported_parallelism
    from vllm_nnsight_plugin.versions import release

    if release(vllm.__version__) >= (0, 32, 0):  # the release the CPU runs: it must
        from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient

        assert reaches_every_engine()
        assert "self.core_engines" in inspect.getsource(AsyncMPClient.call_utility_all_async)
        assert "call_utility_all_async" in inspect.getsource(DPLBAsyncMPClient.call_utility_async)
    data_parallel = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=2)
    assert (unsupported_parallelism(data_parallel) is None) == reaches_every_engine()


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
    composed = seams.extension_for("tests.engine.test_seams.UserExtension")
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


def test_the_plugins_variables_are_known_to_vllm_and_change_no_cache_key():
    """vLLM validates every ``VLLM_*`` variable when it builds an engine (a warning,
    or a refusal with ``--fail-on-environ-validation``); the plugin's are known to it,
    read as None, and every one the code names is in the list."""
    import re
    from pathlib import Path

    import vllm.envs as envs

    from vllm_nnsight_plugin import settings

    settings.known_to_vllm()
    assert all(envs.environment_variables[name]() is None for name in settings.ENVIRONMENT)
    validate = getattr(envs, "validate_environ", None)
    if validate is None:  # 0.32 moved it to the platform
        from vllm.platforms.interface import Platform

        validate = Platform.validate_environ
    assert "environment_variables" in inspect.getsource(validate)
    package = Path(settings.__file__).parent
    named = {
        m for path in package.rglob("*.py") for m in re.findall(r"VLLM_NNSIGHT_[A-Z0-9_]+", path.read_text())
    }
    assert named <= set(settings.ENVIRONMENT), sorted(named - set(settings.ENVIRONMENT))


def test_the_reads_whole_parameters_under_tensor_parallelism_rely_on():
    """``seams.parallel_split`` and ``tensor_parallel_gather``: vLLM's parallel
    layer classes, the group's size and its gather, and the attributes on a
    sharded parameter that say which dimension is split."""
    import torch
    from vllm.distributed import parallel_state, tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    assert callable(parallel_state.get_tensor_model_parallel_world_size)
    assert "dim" in inspect.signature(tensor_model_parallel_all_gather).parameters
    linear = inspect.getsource(inspect.getmodule(ColumnParallelLinear))
    vocab = inspect.getsource(inspect.getmodule(VocabParallelEmbedding))
    assert issubclass(RowParallelLinear, torch.nn.Module) and "self.tp_size" in linear
    assert "input_dim=1" in linear and "output_dim=0" in linear  # the unquantized weight's split
    assert "self.tp_size" in vocab and "self.num_added_embeddings" in vocab
    assert seams.parallel_split(torch.nn.Linear(2, 2)) is None  # one device: held whole


#: vLLM modules code outside ``seams/`` may import: its public API (``LLM``,
#: ``SamplingParams``, ``AsyncLLM`` and its engine arguments, ``vllm.envs``, the
#: platform and the version). Everything else of vLLM's is reached through seams.
PUBLIC_VLLM = {"vllm", "vllm.envs", "vllm.platforms", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm"}


def test_vllm_internals_are_imported_only_in_the_seams_package():
    import ast
    from pathlib import Path

    package = Path(seams.__file__).parent.parent
    found = []
    for path in package.rglob("*.py"):
        if "seams" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [
                f"{path.relative_to(package)}: {name}"
                for name in names
                if (name == "vllm" or name.startswith("vllm.")) and name not in PUBLIC_VLLM
            ]
    assert not found, found
