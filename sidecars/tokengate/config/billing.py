"""The ``billing`` section: rules shared by every model's bill (the weights are each
model's, ``tokengate.config.models.ModelCost``)."""

from __future__ import annotations

from pydantic import Field

from tokengate.config.types import Count, Rate, _Schema


class ContextPenalty(_Schema):
    """Long-context surcharge on billed input: above ``threshold`` prompt tokens each
    billed input token counts ``1 + rate * (prompt_tokens - threshold)`` times."""

    threshold: Count = Field(
        default=32768,
        description="Prompt size above which the surcharge applies, tokens.")
    rate: Rate = Field(
        default=0.00015,
        description="Surcharge per prompt token above the threshold (a factor per token, "
                    "0..1).")


class BillingConfig(_Schema):
    """Billing options shared by every model (weights are per model, ``ModelCost``)."""

    exclude_system_tokens: bool = Field(
        default=False,
        description="System-message tokens are not billed.")
    context_penalty: ContextPenalty = Field(
        default_factory=ContextPenalty,
        description="Long-context surcharge.")
