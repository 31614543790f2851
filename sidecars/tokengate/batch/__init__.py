"""The Batch API (``tokengate-batch``): OpenAI's Files and Batch endpoints behind the edge
(``api``), their state (``store``), an input file's lines (``lines``), the calls to the
edge (``edge``) and the worker that runs the batches on spare capacity (``worker``)."""
