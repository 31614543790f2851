"""Benchmarks: ``counter`` (``make bench-counter``), ``storm`` (``make bench``) and
``vllm_serve`` (``vllm bench serve`` for the CPU build, run by ``storm``)."""
