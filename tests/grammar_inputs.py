"""Grammars built to meet the structured-output engine's limits (ktd.text.grammar.LIMITS)."""


def wide_rows(n: int, prefix: str = "") -> str:
    """A Lark grammar whose every alternative starts with ``prefix`` + "a": after that "a" one
    Earley row holds ``n`` items (llguidance's max_items_in_row is 2000)."""
    alts = " | ".join(f'"{prefix}a" "{chr(98 + i % 20)}{i}"' for i in range(n))
    return f"start: x\nx: {alts}\n"
