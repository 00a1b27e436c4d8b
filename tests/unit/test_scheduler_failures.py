"""The scheduler class finishes the requests the workers failed, with an error, before
vLLM processes the step's output (integration/engine_core/scheduler.py), on vLLM's own request and
output types; the base scheduler is a stand-in that records the order of calls."""
from types import SimpleNamespace

from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_dhisparse.integration.metadata import DHiSparseWorkerMetadata
from vllm_dhisparse.integration.engine_core.scheduler import _FailsRequests


def request(rid: str, client: int = 0) -> Request:
    from vllm import SamplingParams
    r = Request(rid, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4),
                pooling_params=None, client_index=client)
    r.status = RequestStatus.RUNNING
    return r


class Base:
    """What _FailsRequests uses of vLLM's Scheduler."""

    def __init__(self, *requests):
        self.requests = {r.request_id: r for r in requests}
        self.calls = []

    def finish_requests(self, request_ids, finished_status):
        self.calls.append(("finish", set(request_ids), finished_status))
        done = [self.requests.pop(rid) for rid in request_ids]
        for r in done:
            r.status = finished_status
        return done

    def update_from_output(self, scheduler_output, model_runner_output):
        # vLLM emits tokens only for requests still running: record which were left
        self.calls.append(("update", set(self.requests)))
        return {0: EngineCoreOutputs()}


class Scheduler(_FailsRequests, Base):
    pass


def runner_output(failed: dict) -> SimpleNamespace:
    meta = DHiSparseWorkerMetadata(failed) if failed is not None else None
    return SimpleNamespace(kv_connector_output=SimpleNamespace(kv_connector_worker_meta=meta))


def test_failed_requests_end_with_an_error_before_the_output_is_processed():
    s = Scheduler(request("a"), request("b"), request("c", client=1))
    outputs = s.update_from_output(None, runner_output({"b": "host copy lost", "c": "x",
                                                        "gone": "finished already"}))
    assert s.calls == [("finish", {"b", "c"}, RequestStatus.FINISHED_ERROR), ("update", {"a"})]
    ended = {o.request_id: o for eco in outputs.values() for o in eco.outputs}
    assert set(ended) == {"b", "c"} and all(o.new_token_ids == [] for o in ended.values())
    assert all(o.finish_reason == FinishReason.ERROR for o in ended.values())
    assert [o.request_id for o in outputs[1].outputs] == ["c"]  # its own client's outputs


def test_a_step_without_failures_is_vllms():
    for failed in (None, {}):
        s = Scheduler(request("a"))
        outputs = s.update_from_output(None, runner_output(failed))
        assert list(outputs) == [0] and outputs[0].outputs == []
        assert s.calls == [("update", {"a"})]
