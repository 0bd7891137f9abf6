"""Placeholder: chunked-prefill checkpoint placement (filled in next)."""


def install_chunk_planning() -> None:
    return None
