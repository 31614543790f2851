"""One module per API whose bodies the counter converts to a chat request before it
counts them (``anthropic_messages``: ``/v1/messages`` and ``/v1/messages/count_tokens``;
``openai_responses``: ``/v1/responses``).

Each module validates its API's body (``BadRequest`` naming the field in that API's
terms) and converts it the way vLLM's own serving code for that API does, into the
OpenAI chat body that ``ModelCounter``'s chat path counts; the chat path is then the
same one ``/v1/chat/completions`` bodies take.
"""
