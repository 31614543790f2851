"""``tokengate keys list``'s table: per key its limits, models and budgets with the spend
of the current period (``tokengate.ledger.admin.listing``'s entries; ``--json`` prints
the entries themselves)."""

from __future__ import annotations

from typing import Any


def _amount(value: float) -> str:
    """A currency amount to the nano-unit budgets count in, without trailing zeros (as
    the edge writes it in a refusal)."""
    return f"{value:.9f}".rstrip("0").rstrip(".")


def print_table(entries: list[dict[str, Any]], currency: str) -> None:
    """Print ``entries`` (``listing``'s) on stdout: one line per key, then one per model
    override and per budget; an amount unknown (Redis unavailable) is ``?``."""
    for entry in entries:
        models = ", ".join(entry["allowed_models"]) \
            if entry["allowed_models"] is not None else "all"
        state = " (disabled)" if entry.get("disabled") else ""
        print(f"{entry['name']}{state}: rpm {entry['rpm']}, tpm {entry['tpm']}, "
              f"models {models}")
        for label in ("team", "owner", "description"):
            if entry.get(label):
                print(f"  {label}: {entry[label]}")
        if entry.get("expires_at"):
            print(f"  expires at {entry['expires_at']}")
        for at in entry.get("previous_expires_at") or []:
            print(f"  previous secret valid until {at}")
        for m, lim in entry["models"].items():
            print(f"  {m}: rpm {lim['rpm']}, tpm {lim['tpm']}")
        for b in entry["budgets"]:
            scope = b["model"] or "all models"
            spent = "?" if b["spent"] is None else _amount(b["spent"])
            used = "?" if b["tokens_used"] is None else str(b["tokens_used"])
            parts = []
            if b["spend"] is not None:
                part = f"spend {spent} of {_amount(b['spend'])} {currency}"
                if b["committed_spend"] is not None:
                    part += f" ({_amount(b['committed_spend'])} with reservations)"
                parts.append(part)
            if b["tokens"] is not None:
                part = f"tokens {used} of {b['tokens']}"
                if b["committed_tokens"] is not None:
                    part += f" ({b['committed_tokens']} with reservations)"
                parts.append(part)
            print(f"  budget per {b['period']} ({scope}, since {b['since']}): "
                  + ", ".join(parts))
