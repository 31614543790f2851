"""tokengate's vLLM plugin (distribution ``tokengate-vllm``).

Two parts, both loaded by vLLM itself, never by editing its files:

- ``stat_logger.EngineUsageLogger`` (entry point ``vllm.stat_logger_plugins`` ->
  ``tokengate``): one JSON line per finished request, aborted ones included, in the
  engine usage file (``record``, ``writer``, ``hooks``); the ledger joins them with the
  edge's usage events by request id.
- ``scheduler.TokenWeightedScheduler`` (``--scheduler-cls
  tokengate_vllm.scheduler.TokenWeightedScheduler``): vLLM's scheduler with the waiting
  queue ordered by prompt tokens + 0.7 x max_tokens, with an aging bound
  (``request_queue``).

Both check the vLLM version they run in (``compat``) and stay inactive, with one
warning, on a version they were not tested with. Settings: ``settings``.
"""

__version__ = "0.1.0"
