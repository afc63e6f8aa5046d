"""kernels/jit.py's compact sources: only comments and blanks go (CPU; the kernels
themselves run under --run-gpu)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qwen38_backend.kernels.jit import compact

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_comments_and_blanks_go_code_and_strings_stay():
    source = """
    // a whole-line comment
    const int a = 1;   // after code
#pragma unroll
        for (int i = 0; i < 4; ++i) x += "a // not a comment \\" still // quoted"[i];

    asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");  // the wait
    y = a / 2;  /* kept: no block comments in our sources */
    """
    assert compact(source) == (
        "const int a = 1;\n"
        "#pragma unroll\n"
        'for (int i = 0; i < 4; ++i) x += "a // not a comment \\" still // quoted"[i];\n'
        'asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");\n'
        "y = a / 2;  /* kept: no block comments in our sources */\n"
    )


def _sources() -> dict[str, str]:
    """Every string constant of 200+ characters in kernels/*.py (the CUDA sources)."""
    out = {}
    for path in KERNELS.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, str) and len(value) >= 200:
                    out[f"{path.name}:{node.targets[0].id}"] = value
    return out


def _tokens(source: str) -> list[str]:
    """C tokens of `source` with // comments dropped (a reference independent of compact:
    a regular expression over the whole text, string literals matched first)."""
    pattern = r'"(?:\\.|[^"\\])*"|//[^\n]*|\w+|[^\s\w]'
    return [t for t in re.findall(pattern, source) if not t.startswith("//")]


def test_our_kernel_sources_keep_every_token():
    sources = _sources()
    assert len(sources) >= 10
    for name, source in sources.items():
        short = compact(source)
        assert _tokens(short) == _tokens(source), name
        assert "//" not in re.sub(r'"(?:\\.|[^"\\])*"', "", short), name
        # preprocessor directives keep a line of their own
        assert all(line.startswith("#") for line in short.splitlines() if "#pragma" in line)
        assert len(short) < len(source), name


def test_a_kernel_name_changes_with_its_text():
    """MLX keeps compiled kernels by name on disk: the name given to MLX carries a digest of
    the compacted text, so an edited source (or header, or argument list) gets a new name,
    while an edit of comments or blanks alone keeps it."""
    from qwen38_backend.kernels import jit

    body = "    out[0] = x[0];  // copy\n"
    base = {
        "name": "k",
        "input_names": ["x"],
        "output_names": ["out"],
        "header": "",
        "source": body,
    }
    given = [
        jit.cuda_kernel(**options).spec["name"]
        for options in (
            base,
            {**base, "source": "out[0] = x[0];\n\n"},  # the same text once compacted
            {**base, "source": "out[0] = 2 * x[0];"},
            {**base, "header": "#define TWO 2"},
            {**base, "input_names": ["y"]},
            {**base, "name": "other"},
        )
    ]
    assert given[0] == given[1]
    assert re.fullmatch(r"k_[0-9a-f]{12}", given[0])
    assert len(set(given[1:])) == 5
