"""tokengate's client SDK: the official ``openai`` client with token-aware pacing, the
billed usage of every call and an adaptive streaming buffer.

    from tokengate_client import Client
    client = Client(base_url="http://127.0.0.1:8080/v1", api_key="tg-demo-key",
                    config="tokengate.yaml")
    answer = client.chat.completions.create(model="tiny-qwen3", messages=[...])
    answer.usage, answer.token_count
    for piece in client.stream_text(model="tiny-qwen3", messages=[...], max_tokens=512):
        print(piece, end="", flush=True)
    r = client.responses.create(model="tiny-qwen3", input="Hello!", max_output_tokens=64)
    r.usage.input_tokens, r.usage.output_tokens
    for piece in client.responses.stream_text(model="tiny-qwen3", input="Hello!",
                                              max_output_tokens=512):
        print(piece, end="", flush=True)

Modules: ``client`` (``Client``, ``AsyncClient``), ``pacing`` (the key's windows, as the
edge keeps them), ``buffer`` (the streaming buffer), ``counting`` (prompts counted
offline with the counter's library).
"""

from tokengate_client.buffer import TextBuffer, buffer_size
from tokengate_client.client import (
                                     AsyncClient,
                                     AsyncCompletionStream,
                                     AsyncTextStream,
                                     Billing,
                                     Client,
                                     Completion,
                                     CompletionStream,
                                     TextStream,
                                     billed_tokens,
)
from tokengate_client.counting import Estimate
from tokengate_client.pacing import Pacer, RateLimits

__all__ = ["AsyncClient", "AsyncCompletionStream", "AsyncTextStream", "Billing", "Client",
           "Completion", "CompletionStream", "Estimate", "Pacer", "RateLimits", "TextBuffer",
           "TextStream", "billed_tokens", "buffer_size"]
