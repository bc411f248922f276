"""Looking a kernel's statements up in its shipped CUDA source: what the CPU tests of the fp4 and indexer emulations tie
their mirrors to (a changed constant, comparison or shift in the source fails them)."""

import re


def source_text(src: str, comment: str) -> str:
    """``src`` with its ``comment`` comments dropped and its whitespace normalised: what a statement is looked up in."""
    return " ".join(re.sub(rf"{re.escape(comment)}.*", "", src).split())


def cuda_function(src: str, name: str) -> str:
    """The CUDA helper ``name`` defined in ``src``, from its name to its closing brace (see :func:`source_text`)."""
    head = re.search(rf"__device__ __forceinline__ [\w *]+\b{name}\(", src)
    assert head, f"{name} is not defined in the source"
    body, depth = src.index("{", head.end()), 0
    for end, ch in enumerate(src[body:], start=body):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return source_text(src[head.start() : end + 1], "//")
    raise AssertionError(f"{name}: its braces do not close")
