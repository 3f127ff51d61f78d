"""The front end's policy (``front.py``) without an engine: what it answers the
input-processing seam for plain, unvouched, vouched and last-row requests, and
that the seams call vLLM as it is while no policy is set; the salt of a block
that edits every row alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from vllm_nnsight_plugin.front import FrontEnd
from vllm_nnsight_plugin.prefix import CLAIM_KEY, EDIT_SALT, LAST_ROWS, SAME_EDIT, edit_salt
from vllm_nnsight_plugin.wire.envelope import EXTRA_ARGS_KEY, payload_of, seal
from vllm_nnsight_plugin.wire.trust import (
    LOCAL_SIGNATURE_KEY,
    VOUCHED_KEY,
    RefusedBlockError,
    Vouched,
    ensure_local_key,
    local_key,
)

#: An input processor with no edit installed, on an engine of one rank.
PROCESSOR = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=SimpleNamespace()))


def vouched(envelope: str = "nns2:block", **extra) -> SamplingParams:
    return SamplingParams(extra_args={EXTRA_ARGS_KEY: envelope, VOUCHED_KEY: Vouched(envelope), **extra})


def test_a_plain_request_is_left_as_it_came():
    params = SamplingParams(max_tokens=3)
    assert FrontEnd().admit(PROCESSOR, "r", params) is None
    assert FrontEnd().admit(PROCESSOR, "r", SamplingParams(extra_args={"other": 1})) is None


def test_a_block_nobody_vouched_for_is_refused_as_a_bad_request():
    from vllm.exceptions import VLLMValidationError

    params = SamplingParams(extra_args={EXTRA_ARGS_KEY: "nns2:block"})
    with pytest.raises(RefusedBlockError, match="neither built in this process") as refused:
        FrontEnd().admit(PROCESSOR, "r", params)
    assert isinstance(refused.value, VLLMValidationError)  # vLLM answers it with 400


def test_a_vouched_block_is_signed_computed_whole_and_salted_on_a_copy():
    ensure_local_key()
    given = vouched()
    params, salt, reads_cache = FrontEnd().admit(PROCESSOR, "r-1", given)
    assert salt == "vllm-nnsight:r-1" and not reads_cache  # its KV is its own
    assert params is not given and VOUCHED_KEY in given.extra_args  # the caller's stay as they were
    assert VOUCHED_KEY not in params.extra_args and params.extra_args[LOCAL_SIGNATURE_KEY]


def test_a_block_that_reads_only_the_last_rows_shares_the_prefix_cache():
    ensure_local_key()
    params, salt, _ = FrontEnd().admit(PROCESSOR, "r", vouched(**{CLAIM_KEY: LAST_ROWS}))
    assert salt is None and params.extra_args[LOCAL_SIGNATURE_KEY]


def _sealed(block: bytes, **key) -> str:
    return seal(block, nnsight_version="0", plugin_version="0", **key)


def test_a_block_that_edits_every_row_alike_shares_kv_with_the_same_block_only():
    """The salt names the block's bytes (not the envelope: a block sealed again, as
    a later trace does, keeps it), keyed with the engine's local key."""
    ensure_local_key()
    block = b"the same block"
    one, again, other = _sealed(block), _sealed(block), _sealed(b"another block")
    admitted = [
        FrontEnd().admit(PROCESSOR, f"r{i}", vouched(e, **{CLAIM_KEY: SAME_EDIT}))
        for i, e in enumerate((one, again, other))
    ]
    salts = [a.salt for a in admitted]
    assert all(a.reads_cache for a in admitted) and all(s.startswith(EDIT_SALT) for s in salts)
    assert salts[0] == salts[1] != salts[2]
    assert salts[0] == edit_salt(payload_of(one), local_key()) != edit_salt(payload_of(one), "another key")
    assert block.hex() not in salts[0] and payload_of(one) not in salts[0]
    unclaimed = FrontEnd().admit(PROCESSOR, "r9", vouched(one))
    assert unclaimed.salt == "vllm-nnsight:r9" and not unclaimed.reads_cache


def _with_edits(kv: dict[str, str]) -> SimpleNamespace:
    """An input processor whose book holds edits ``a`` (unnamed) and ``b`` (named
    "b"), with what each adds to a salt (absent: its requests are computed whole)."""
    from vllm_nnsight_plugin.edits import BOOK_ATTR, EditBook

    book = EditBook()
    book.installed.update({"a": None, "b": "b"})
    book.kv.update(kv)
    processor = SimpleNamespace(vllm_config=PROCESSOR.vllm_config)
    setattr(processor, BOOK_ATTR, book)
    return processor


def test_installed_edits_share_kv_where_each_lets_them_and_salt_it_by_their_installs():
    from vllm_nnsight_plugin.wire.trust import EDITS_KEY, MARK_KEY

    ensure_local_key()
    steer_a, steer_b = EDIT_SALT + "a" * 32, EDIT_SALT + "b" * 32

    def plain(processor, **extra):
        return FrontEnd().admit(processor, "r", SamplingParams(max_tokens=2, extra_args=extra or None))

    # both write nothing: as a plain request (marked, unsalted)
    admitted = plain(_with_edits({"a": "", "b": ""}))
    assert admitted.salt is None and MARK_KEY in admitted.params.extra_args
    # one writer: its install's salt; two: one salt of both, in the order they run
    assert plain(_with_edits({"a": steer_a, "b": ""})).salt == steer_a
    both = plain(_with_edits({"a": steer_a, "b": steer_b}))
    assert both.reads_cache and both.salt.startswith(EDIT_SALT) and both.salt not in (steer_a, steer_b)
    assert plain(_with_edits({"a": steer_b, "b": steer_a})).salt != both.salt
    assert plain(_with_edits({"a": steer_a, "b": steer_b}), **{EDITS_KEY: []}).salt == steer_a  # b not run
    # an edit that keeps its requests whole, or a block that does: a salt of the request's own
    assert plain(_with_edits({"a": steer_a})).salt == "vllm-nnsight:r"
    whole = FrontEnd().admit(_with_edits({"a": "", "b": ""}), "r", vouched())
    assert whole.salt == "vllm-nnsight:r" and not whole.reads_cache
    # a block that edits alike, with them: its salt joins theirs
    block = _sealed(b"steering block")
    own = FrontEnd().admit(PROCESSOR, "r", vouched(block, **{CLAIM_KEY: SAME_EDIT})).salt
    joined = FrontEnd().admit(
        _with_edits({"a": steer_a, "b": ""}), "r", vouched(block, **{CLAIM_KEY: SAME_EDIT})
    )
    assert joined.reads_cache and joined.salt not in (own, steer_a, both.salt)
    reader = FrontEnd().admit(_with_edits({"a": steer_a, "b": ""}), "r", vouched(**{CLAIM_KEY: LAST_ROWS}))
    assert reader.salt == steer_a and reader.reads_cache


def test_what_an_installed_edit_adds_to_salts_is_the_workers_common_word():
    from vllm_nnsight_plugin.edits import _kv_part

    assert _kv_part([{"prefix": LAST_ROWS}, {"prefix": LAST_ROWS}]) == ""
    drawn = {_kv_part([{"prefix": SAME_EDIT}]) for _ in range(3)}
    assert len(drawn) == 3 and all(part.startswith(EDIT_SALT) for part in drawn)  # one per install
    for replies in ([{"prefix": LAST_ROWS}, {"prefix": SAME_EDIT}], [{"prefix": None}], [None], [], ["no"]):
        assert _kv_part(replies) is None


def test_an_envelope_without_a_payload_has_none():
    assert payload_of("nns2:not base64!") is None and payload_of("other") is None and payload_of(3) is None
    signed = _sealed(b"block", key="k" * 32)
    assert payload_of(signed) == payload_of(_sealed(b"block"))  # the signature is not the block


def test_a_signature_sent_from_outside_is_dropped_from_a_plain_request():
    params, salt, _ = FrontEnd().admit(
        PROCESSOR, "r", SamplingParams(extra_args={LOCAL_SIGNATURE_KEY: "forged"})
    )
    assert salt is None and LOCAL_SIGNATURE_KEY not in params.extra_args


def test_blocks_on_a_pipeline_parallel_engine_are_refused_with_the_reason():
    ensure_local_key()
    staged = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    )
    with pytest.raises(RefusedBlockError, match="pipeline_parallel_size"):
        FrontEnd().admit(staged, "r", vouched())


class Engine:
    """An offline engine as the policy sees it: its workers' answers to a collect."""

    def __init__(self):
        self.calls = []
        self.input_processor = SimpleNamespace()  # no edit installed

    def collective_rpc(self, method, args=()):
        self.calls.append((method, args[0]))
        return [None]  # one worker, nothing saved


def test_an_offline_engine_collects_a_traced_request_once_when_it_finishes():
    from vllm_nnsight_plugin.wire import rpc

    engine, front = Engine(), FrontEnd()
    front.added(engine, "traced", vouched())
    front.added(engine, "plain", SamplingParams())
    running = SimpleNamespace(request_id="traced", finished=False)
    front.stepped(engine, [running, SimpleNamespace(request_id="plain", finished=True)])
    assert engine.calls == []  # nothing of ours finished
    done = SimpleNamespace(request_id="traced", finished=True, outputs=[])
    front.stepped(engine, [done])
    front.stepped(engine, [done])  # reported again: collected once
    assert engine.calls == [(rpc.COLLECT, ["traced"])]
    assert done.nnsight_saves == {} and done.nnsight_error is None


def test_a_collect_that_fails_is_the_error_of_its_requests_not_of_the_call():
    import vllm_nnsight_plugin

    class Short(Engine):
        def collective_rpc(self, method, args=()):
            raise RuntimeError("Call to collective_rpc method failed: CUDA out of memory.")

    engine, front = Short(), FrontEnd()
    front.added(engine, "traced", vouched())
    done = SimpleNamespace(request_id="traced", finished=True, outputs=[])
    front.stepped(engine, [done])  # raises nothing
    assert done.nnsight_error["type_name"] == "CollectError" and done.saves == {}
    with pytest.raises(RuntimeError, match="could not return this request's saves: .*out of memory"):
        vllm_nnsight_plugin.saves(done)


def test_an_aborted_traced_request_is_wound_up_on_the_workers():
    from vllm_nnsight_plugin.wire import rpc

    engine, front = Engine(), FrontEnd()
    front.added(engine, "traced", vouched())
    front.aborted(engine, ["traced", "unknown"])
    front.aborted(engine, ["traced"])
    assert engine.calls == [(rpc.COLLECT, ["traced"])]


def test_params_built_for_one_request_each_are_copied_shallow_by_the_engine():
    """A trace's invokes each build their own params; marked as vLLM's OpenAI server
    marks its own, the engine's copy of each is shallow (unmarked: deep)."""
    from vllm_nnsight_plugin.seams.frontend import built_for_one_request

    params = [SamplingParams(max_tokens=2, stop=["x"]), SamplingParams(max_tokens=3)]
    assert params[0].clone().stop is not params[0].stop
    built_for_one_request(params)
    assert all(param.skip_clone for param in params)
    copy = params[0].clone()
    assert copy is not params[0] and copy.stop is params[0].stop and copy.max_tokens == 2


def test_an_engine_id_is_the_id_a_request_was_added_under_less_vllms_suffix():
    from vllm_nnsight_plugin.seams.frontend import external_id

    assert external_id("7-0a1b2c3d") == "7"
    assert external_id("my-request-0a1b2c3d") == "my-request"
    assert external_id("7") == "7"
    assert external_id("7-0a1b2c3") == "7-0a1b2c3"  # seven digits: not vLLM's
    assert external_id("7-0A1B2C3D") == "7-0A1B2C3D"  # vLLM's are lower case
