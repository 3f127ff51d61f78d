"""The names the front end calls the workers by are the worker extension's own
methods, and the reply's fields are the ones both ends use (no engine)."""

from __future__ import annotations

import typing

from vllm_nnsight_plugin.wire import reply, rpc


def test_every_name_the_front_end_calls_is_a_method_of_the_worker_extension():
    from vllm_nnsight_plugin.worker.extension import NNsightWorkerExtension

    assert len(set(rpc.CALLED)) == len(rpc.CALLED) == 5
    for name in rpc.CALLED:
        assert callable(getattr(NNsightWorkerExtension, name, None)), name


def test_a_request_s_reply_has_the_fields_its_type_names():
    assert set(reply.request_reply()) <= set(typing.get_type_hints(reply.RequestReply))
    assert set(reply.sequence_reply()) == set(typing.get_type_hints(reply.SequenceReply))
    assert set(reply.merged()) == set(typing.get_type_hints(reply.Merged))
    assert reply.request_reply() is not reply.request_reply()  # fresh dicts each time
