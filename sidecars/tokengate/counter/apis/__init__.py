"""One module per API whose bodies the counter reads in that API's own terms:
``anthropic_messages`` (``/v1/messages`` and ``/v1/messages/count_tokens``) and
``openai_responses`` (``/v1/responses``) convert their bodies to a chat request,
``openai_embeddings`` (``/v1/embeddings``) counts its inputs as prompts.

Each module validates its API's body (``BadRequest`` naming the field in that API's
terms). The converters do it the way vLLM's own serving code for that API does, into the
OpenAI chat body that ``ModelCounter``'s chat path counts (the same path
``/v1/chat/completions`` bodies take); the embeddings module applies vLLM's pooling
tokenization rules to the prompt counts ``ModelCounter`` gives it.
"""
