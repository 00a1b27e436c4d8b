"""Prefill/decode handoff: the producer's capture and its server, the consumer's pull
and load; the scheduler half's bookkeeping of both."""
