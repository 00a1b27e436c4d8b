"""How the model's decode reads c4a rows on this platform, as the worker half sees it.

* :class:`CpuDecode`: the routed CPU attention serves the tokens of admitted requests
  whose prefill is complete; every other token is upstream's over vLLM's cache, so a
  request is admitted once its prefill completes.
* :class:`CudaDecode`: vLLM's V4 attention classes any step of at most 1 + speculative
  tokens as a decode, and the routed FlashMLA decode reads c4a rows of admitted requests
  only.  Such a step admits its request before the forward (a short prompt chunk, a full
  prefix-cache hit), a request it cannot admit fails rather than read nothing, the
  binding's tables are written before each forward and its counters read after.
"""
from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class CpuDecode:
    admits_decode_steps = False  # a short step before the prefill completes waits for it

    def before_forward(self, decoding: list) -> None:
        """``decoding``: (admitted request, its tokens once this step's are computed)."""

    def after_forward(self, requests, failures, served) -> None:
        """Fails the requests the decode could not serve in this step; ``served``: the
        routed layers' counters (the CPU layers count into them themselves)."""


class CudaDecode(CpuDecode):
    admits_decode_steps = True

    def __init__(self, binding):
        self.binding = binding  # decode_binding.DecodeBinding

    def before_forward(self, decoding: list) -> None:
        self.binding.write_tables(decoding)

    def after_forward(self, requests, failures, served) -> None:
        lost = self.binding.take_counters()
        # the graph-captured decode counts on the device; the census reads them here
        served.selected_rows += lost["selected"]
        served.fresh_selections += lost["fresh_selections"]
        if lost["unrouted_tokens"] or lost["fresh_rows_lost"]:
            logger.error("DHiSparse: the routed decode served %d tokens without their c4a "
                         "rows (a routing table out of step with vLLM's batch) and lost "
                         "%d uncommitted rows that did not fit the staging rows (%s)",
                         lost["unrouted_tokens"], lost["fresh_rows_lost"],
                         ", ".join(sorted(lost["lost_requests"])) or "-")
        for rid in lost["lost_requests"]:
            req = requests.get(rid)
            if req is not None and not req.failed:
                failures.fail(req, "rows past its committed ones (this step's, or unverified "
                                   "drafts') did not fit the routed decode's staging rows")
