"""Benchmarks: ``counter`` (``make bench-counter``), ``storm`` (``make bench``),
``scheduler`` (``make bench-scheduler``) and ``vllm_serve`` (``vllm bench serve`` for the
CPU build, run by ``storm``)."""
